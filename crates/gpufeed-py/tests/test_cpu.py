"""The Python package on a machine without a GPU (CI): it imports, the CPU paths work (host
batches through DLPack into numpy, byte for byte), and the GPU calls and bad input raise the
Rust errors' messages as Python exceptions; the stubs (``.pyi``) name every public function and
class with its parameters. Run: ``pytest crates/gpufeed-py/tests``."""

import ast
import inspect
import json
import os
import pathlib
import struct

import numpy as np
import pytest

import gpufeed
from gpufeed import _gpufeed


def _has_gpu():
    try:
        gpufeed.load_range("/proc/self/exe", 0, 1)  # any file: the GPU is opened first
    except gpufeed.NoGpuError:
        return False
    except gpufeed.GpufeedError:
        return True
    return True


HAS_GPU = _has_gpu()


@pytest.fixture(autouse=True)
def _no_rank_from_the_caller(monkeypatch):
    """BatchLoader shards by RANK / WORLD_SIZE: no test inherits the caller's."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def records_file(tmp_path, count, size, seed=7):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    path = tmp_path / "records.bin"
    data.tofile(path)
    return path, data


def tiny_safetensors(path):
    """A valid safetensors file of one 4 x 2 F32 tensor, written by hand."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 2], "data_offsets": [0, 32]}})
    header = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(32)))
    return path


def test_imports_with_a_version_and_the_documented_names():
    assert gpufeed.__version__
    for name in gpufeed.__all__:
        assert hasattr(gpufeed, name), name
    assert issubclass(gpufeed.NoGpuError, gpufeed.GpufeedError)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the no-GPU error is not exercised")
def test_gpu_calls_without_a_gpu_raise_no_gpu_error(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(gpufeed.NoGpuError, match="NVIDIA driver"):
        gpufeed.load_file(path)
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.Loader(0)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the no-GPU error is not exercised")
def test_several_gpus_without_a_gpu_raise_no_gpu_error(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_000)
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_replicated(path, devices=[0, 1])
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_sharded([path], devices=[0, 1])
    ckpt = tiny_safetensors(tmp_path / "m.safetensors")
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_tensor_parallel(ckpt, devices=[0, 1], split="columns")
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_replicated_safetensors(ckpt, devices=[0, 1])
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("GPUFEED_JOB", f"pytest-{os.getpid()}")
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_replicated_rank(path)
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.load_tensor_parallel_rank(ckpt)


def test_two_threads_calling_rank_functions_at_once_do_not_deadlock(tmp_path):
    """Two Python threads calling ``load_replicated_rank`` at the same time (each joining this
    process's rank, or failing to without a GPU) both finish: before, the second blocked on the
    rank's lock while holding the GIL that the first needed to return (a deadlock)."""
    import subprocess
    import sys

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(10_007))
    code = (
        "import sys, threading, gpufeed\n"
        "done = []\n"
        "def go():\n"
        "    for _ in range(20):\n"
        "        try:\n"
        "            gpufeed.load_replicated_rank(sys.argv[1])\n"
        "        except gpufeed.GpufeedError:\n"
        "            pass\n"
        "    done.append(1)\n"
        "ts = [threading.Thread(target=go) for _ in range(2)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print('DONE', len(done))\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RESTART_COUNT", "GPUFEED_REPLICATE")}
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GPUFEED_JOB=f"pytest-threads-{os.getpid()}")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(path)], env=env,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("two threads calling load_replicated_rank at once deadlocked")
    assert out.returncode == 0 and "DONE 2" in out.stdout, out.stdout + out.stderr


def test_several_gpus_name_bad_input_before_any_gpu(tmp_path, monkeypatch):
    with pytest.raises(gpufeed.GpufeedError, match="given twice"):
        gpufeed.load_replicated(tmp_path / "f.bin", devices=[0, 0])
    with pytest.raises(gpufeed.GpufeedError, match="at least one GPU"):
        gpufeed.load_replicated(tmp_path / "f.bin", devices=[])
    with pytest.raises(gpufeed.GpufeedError, match="no such file"):
        gpufeed.load_sharded([tmp_path / "missing.bin"], devices=[0, 1])
    ckpt = tiny_safetensors(tmp_path / "m.safetensors")
    for split in ("diagonal", -1, 1.5, True):
        with pytest.raises(gpufeed.GpufeedError, match="invalid setting: split"):
            gpufeed.load_tensor_parallel(ckpt, devices=[0, 1], split=split)
        with pytest.raises(gpufeed.GpufeedError, match="invalid setting: split"):
            gpufeed.load_tensor_parallel_rank(ckpt, split=split)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    for load in (gpufeed.load_tensor_parallel, gpufeed.load_replicated_safetensors):
        with pytest.raises(gpufeed.GpufeedError, match="not a valid safetensors file"):
            load(bad, devices=[0, 1])
        with pytest.raises(gpufeed.GpufeedError, match="no such file"):
            load(tmp_path / "missing.safetensors", devices=[0, 1])
    with pytest.raises(gpufeed.GpufeedError, match="at least one"):
        gpufeed.load_tensor_parallel(ckpt, devices=[])
    with pytest.raises(gpufeed.GpufeedError, match="given twice"):
        gpufeed.load_replicated_safetensors(ckpt, devices=[1, 1])
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(gpufeed.GpufeedError, match="LOCAL_RANK is not set"):
        gpufeed.load_replicated_rank(tmp_path / "f.bin")
    # A bad checkpoint is named before the rank joins its job (no other rank waits for it).
    with pytest.raises(gpufeed.GpufeedError, match="not a valid safetensors file"):
        gpufeed.load_tensor_parallel_rank(bad)
    with pytest.raises(gpufeed.GpufeedError, match="LOCAL_RANK is not set"):
        gpufeed.load_tensor_parallel_rank(ckpt)


def test_bad_files_are_named_before_the_gpu(tmp_path):
    with pytest.raises(gpufeed.GpufeedError, match="no such file; check the path"):
        gpufeed.load_safetensors(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(gpufeed.GpufeedError, match="not a valid safetensors file"):
        gpufeed.load_safetensors(bad)
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "../escape.safetensors"}}))
    with pytest.raises(gpufeed.GpufeedError, match="leaves the checkpoint's directory"):
        gpufeed.load_safetensors(index)


def test_safe_open_names_bad_input_before_the_gpu(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such file or directory: .*missing"):
        gpufeed.safe_open(tmp_path / "missing.safetensors")
    with pytest.raises(gpufeed.SafetensorError, match="No such file or directory"):
        gpufeed.safe_open(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(gpufeed.GpufeedError, match="not a valid safetensors file"):
        gpufeed.safe_open(bad, device="cuda:0")
    ckpt = tiny_safetensors(tmp_path / "m.safetensors")
    with pytest.raises(gpufeed.SafetensorError, match="framework np is invalid"):
        gpufeed.safe_open(ckpt, framework="np")
    for device in ("mps", "cuda:x", True, -1):
        with pytest.raises(gpufeed.SafetensorError, match="is invalid"):
            gpufeed.safe_open(ckpt, device=device)
    with pytest.raises(gpufeed.SafetensorError, match='backend "bad" is invalid'):
        gpufeed.safe_open(ckpt, backend="bad")
    # The CPU is the default device, as in safetensors; its header needs no GPU.
    with gpufeed.safe_open(ckpt) as f:
        assert f.keys(), "a handle on the CPU lists its tensors"
    if not HAS_GPU:
        with gpufeed.safe_open(ckpt, device="cuda:0") as f:
            with pytest.raises(gpufeed.NoGpuError):
                f.get_tensor(f.keys()[0])
        with pytest.raises(gpufeed.NoGpuError):
            gpufeed.OnDemand(ckpt)


def test_host_batches_reach_numpy_byte_for_byte(tmp_path):
    count, size = 1000, 4099  # an odd record size: nothing aligned by accident
    path, data = records_file(tmp_path, count, size)
    loader = gpufeed.BatchLoader(path, record_bytes=size, batch_size=64, seed=3, workers=2)
    assert len(loader) == (count + 63) // 64
    seen = []
    for batch in loader.epoch(0):
        assert batch.data.device == "cpu"
        assert batch.data.shape == [len(batch.indices), size]
        host = np.from_dlpack(batch.data)
        assert host.dtype == np.uint8 and host.shape == (len(batch.indices), size)
        np.testing.assert_array_equal(host, data[batch.indices])
        seen.extend(batch.indices)
    assert sorted(seen) == list(range(count)), "every record once"
    assert seen != list(range(count)), "shuffled"
    # The same seed and epoch give the same order; the next epoch another.
    again = [i for b in loader.epoch(0) for i in b.indices]
    assert again == seen
    other = [i for b in loader.epoch(1) for i in b.indices]
    assert sorted(other) == sorted(seen) and other != seen


def test_an_array_outlives_its_loader_and_its_epoch(tmp_path):
    path, data = records_file(tmp_path, 100, 512, seed=11)
    loader = gpufeed.BatchLoader(path, record_bytes=512, batch_size=10, shuffle=False)
    it = loader.epoch(0)
    first = next(it)
    with pytest.raises(gpufeed.GpufeedError, match="already running"):
        loader.epoch(1)
    del it, loader
    np.testing.assert_array_equal(np.from_dlpack(first.data), data[:10])


def test_batches_are_sharded_by_rank_and_world_size(tmp_path, monkeypatch):
    path, _ = records_file(tmp_path, 300, 64, seed=5)
    shards = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        loader = gpufeed.BatchLoader(path, record_bytes=64, batch_size=32, seed=9)
        shards.append([i for b in loader.epoch(0) for i in b.indices])
    assert all(len(s) == 100 for s in shards)
    assert sorted(sum(shards, [])) == list(range(300)), "the ranks split the records"


def test_a_truncated_record_file_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(b"\0" * 1000)
    with pytest.raises(gpufeed.GpufeedError, match="1000"):
        gpufeed.BatchLoader(path, record_bytes=300)


def test_doctor_and_advise_return_plain_dicts(tmp_path):
    checks = gpufeed.doctor(str(tmp_path))
    assert {c["name"] for c in checks} >= {"io_uring", "O_DIRECT", "CUDA driver"}
    assert all(c["status"] in ("ok", "warn", "fail") for c in checks)
    rec = gpufeed.advise(size=1 << 30, persistent=True, processes=4)
    assert rec["recommendation"]["storage"] == "mmap(MAP_SHARED)"
    assert rec["trials"] is None
    with pytest.raises(gpufeed.GpufeedError, match="path=FILE"):
        gpufeed.advise(size=1 << 20, measure=True)
    with pytest.raises(gpufeed.GpufeedError, match="how large"):
        gpufeed.advise()


def test_a_view_of_an_array_shares_its_bytes_and_checks_its_shape(tmp_path):
    path, data = records_file(tmp_path, 4, 1024, seed=13)
    batch = next(iter(gpufeed.BatchLoader(path, record_bytes=1024, batch_size=4,
                                          shuffle=False).epoch(0)))
    view = batch.data.view_of(8, 24, "F32", [2, 2])
    assert view.shape == [2, 2] and view.dtype == "F32" and view.nbytes == 16
    want = np.frombuffer(data.reshape(-1)[8:24].tobytes(), dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(np.from_dlpack(view), want)
    with pytest.raises(gpufeed.GpufeedError, match="does not fill 10 bytes"):
        batch.data.view_of(0, 10, "F32", [3])
    with pytest.raises(gpufeed.GpufeedError, match="of an array of 4096 bytes"):
        batch.data.view_of(4000, 5000, "U8", [1000])
    with pytest.raises(gpufeed.GpufeedError, match="no DLPack type"):
        batch.data.view_of(0, 4, "F4", [8])


def test_the_collector_is_paused_only_inside():
    """A checkpoint's tensors are made with the cyclic collector off; it is on again after, even
    when the load fails, and stays off where the caller had turned it off."""
    import gc

    with pytest.raises(gpufeed.GpufeedError):
        with gpufeed._collector_paused():
            assert not gc.isenabled()
            raise gpufeed.GpufeedError("a failed load")
    assert gc.isenabled()
    gc.disable()
    try:
        with gpufeed._collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_variable_records_through_an_offsets_index(tmp_path):
    rng = np.random.default_rng(13)
    records = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
               for n in rng.integers(0, 5000, 300)]
    path, index = tmp_path / "var.bin", tmp_path / "var.idx"
    path.write_bytes(b"".join(records))
    starts = np.cumsum([0] + [len(r) for r in records], dtype=np.uint64)
    index.write_bytes(starts.astype("<u8").tobytes())
    loader = gpufeed.BatchLoader(path, index=index, batch_size=32, seed=4, workers=2)
    seen = []
    for batch in loader.epoch(0):
        host = np.from_dlpack(batch.data)
        assert batch.data.shape == [batch.offsets[-1]], "one run of bytes"
        for k, i in enumerate(batch.indices):
            assert host[batch.offsets[k]:batch.offsets[k + 1]].tobytes() == records[i], i
        seen.extend(batch.indices)
    assert sorted(seen) == list(range(len(records)))
    # An index that points past the end of the file is named.
    bad = tmp_path / "bad.idx"
    bad.write_bytes(np.array([0, starts[-1] + 1], dtype="<u8").tobytes())
    with pytest.raises(gpufeed.GpufeedError, match="bad.idx"):
        gpufeed.BatchLoader(path, index=bad)


def test_an_image_folder_gives_file_bytes_and_labels(tmp_path):
    rng = np.random.default_rng(21)
    files = {}
    for cls in ("cat", "dog", "emu"):
        (tmp_path / cls).mkdir()
        for j in range(7):
            body = rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes()
            (tmp_path / cls / f"{j}.jpg").write_bytes(body)
            files[(cls, body)] = True
    loader = gpufeed.BatchLoader(tmp_path, batch_size=5, seed=2)
    assert loader.classes == ["cat", "dog", "emu"] and loader.skipped == 0
    got = []
    for batch in loader.epoch(0):
        host = np.from_dlpack(batch.data)
        assert len(batch.labels) == len(batch.indices)
        for k, label in enumerate(batch.labels):
            body = host[batch.offsets[k]:batch.offsets[k + 1]].tobytes()
            got.append((loader.classes[label], body))
    assert sorted(got) == sorted(files), "every file once, with its class"
    # A FIFO among the files: named, or left out and counted with skip_bad=True.
    os.mkfifo(tmp_path / "dog" / "pipe.jpg")
    with pytest.raises(gpufeed.GpufeedError, match="pipe.jpg"):
        gpufeed.BatchLoader(tmp_path)
    lenient = gpufeed.BatchLoader(tmp_path, skip_bad=True, batch_size=64)
    assert lenient.skipped == 1
    assert sum(len(b.indices) for b in lenient.epoch(0)) == 21


def test_how_records_are_cut_must_be_said_once(tmp_path):
    path, _ = records_file(tmp_path, 10, 8)
    with pytest.raises(gpufeed.GpufeedError, match="record_bytes=N or index"):
        gpufeed.BatchLoader(path)
    with pytest.raises(gpufeed.GpufeedError, match="not both"):
        gpufeed.BatchLoader(path, record_bytes=8, index=path)
    with pytest.raises(gpufeed.GpufeedError, match="image folder"):
        gpufeed.BatchLoader(tmp_path, record_bytes=8)


def test_an_elastic_loader_resumes_with_another_world_size(tmp_path, monkeypatch):
    """Two ranks run 5 steps and save the position (JSON); four ranks resume: together they
    see every record of the epoch once, each byte for byte."""
    count, size, global_batch = 960, 101, 24
    path, data = records_file(tmp_path, count, size, seed=17)

    def rank(r, world):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return gpufeed.BatchLoader(path, record_bytes=size, global_batch=global_batch, seed=8,
                                   drop_last=True)

    def take(batch):
        host = np.from_dlpack(batch.data)
        np.testing.assert_array_equal(host, data[batch.indices])
        return list(batch.indices)

    seen = []
    epochs = [rank(r, 2).epoch(0) for r in range(2)]
    for _ in range(5):
        for e in epochs:
            batch = next(e)
            assert len(batch.indices) == global_batch // 2
            seen.extend(take(batch))
    saved = json.dumps(epochs[0].position())
    assert json.loads(saved)["samples"] == 5 * global_batch
    assert epochs[1].position() == epochs[0].position()
    del epochs
    for r in range(4):
        loader = rank(r, 4)
        it = loader.resume(json.loads(saved))
        numbers = []
        for batch in it:
            assert len(batch.indices) == global_batch // 4
            numbers.append(batch.number)
            seen.extend(take(batch))
        assert numbers[0] == 5, "numbering goes on from the saved step"
        assert it.position()["epoch"] == 1 and it.position()["samples"] == 0
    assert sorted(seen) == list(range(count)), "every record once"
    # A position of another seed is refused; a non-elastic loader has none.
    other = dict(json.loads(saved), order={"kind": "shuffled", "seed": 9})
    with pytest.raises(gpufeed.GpufeedError, match="order"):
        list(rank(0, 2).resume(other))
    with pytest.raises(gpufeed.GpufeedError, match="global_batch"):
        gpufeed.BatchLoader(path, record_bytes=size).epoch(0).position()
    with pytest.raises(gpufeed.GpufeedError, match="divide"):
        rank(0, 5)


def test_npy_rows_come_out_with_their_dtype_and_shape(tmp_path):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((n, 3, 5)).astype(np.float32) for n in (37, 1, 20)]
    for i, a in enumerate(arrays):
        np.save(tmp_path / f"part-{i}.npy", a)
    whole = np.concatenate(arrays)
    for path in (str(tmp_path / "part-*.npy"), [tmp_path / f"part-{i}.npy" for i in range(3)]):
        loader = gpufeed.BatchLoader(path, batch_size=8, seed=1)
        seen = []
        for batch in loader.epoch(0):
            host = np.from_dlpack(batch.data)
            assert host.dtype == np.float32 and host.shape == (len(batch.indices), 3, 5)
            np.testing.assert_array_equal(host, whole[batch.indices])
            seen.extend(batch.indices)
        assert sorted(seen) == list(range(len(whole)))
    # One .npy file alone; a truncated one is named.
    single = gpufeed.BatchLoader(tmp_path / "part-0.npy", batch_size=64, shuffle=False)
    np.testing.assert_array_equal(np.from_dlpack(next(single.epoch(0)).data), arrays[0])
    cut = tmp_path / "cut.npy"
    cut.write_bytes((tmp_path / "part-0.npy").read_bytes()[:-3])
    with pytest.raises(gpufeed.GpufeedError, match="cut.npy"):
        gpufeed.BatchLoader(cut)


def test_settings_past_the_data_set_neither_abort_hang_nor_resume_past_its_end(tmp_path, monkeypatch):
    """A global batch or a prefetch far past the data set's size works (one short batch; the
    process had aborted allocating for 2**40 records, and spun forever queueing 2**62 jobs); a
    position past the end of the epoch is refused (it had given an empty epoch silently)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path, data = records_file(tmp_path, 10, 3, seed=41)
    for global_batch in (2**40, 2**63):
        loader = gpufeed.BatchLoader(path, record_bytes=3, global_batch=global_batch, seed=2)
        batches = list(loader.epoch(0))
        assert [sorted(b.indices) for b in batches] == [list(range(10))]
    loader = gpufeed.BatchLoader(path, record_bytes=3, prefetch=2**62, workers=1, batch_size=4,
                                 shuffle=False)
    got = [list(b.indices) for b in loader.epoch(0)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader = gpufeed.BatchLoader(path, record_bytes=3, global_batch=4, seed=0)
    end = dict(loader.epoch(0).position(), samples=12)
    assert list(loader.resume(end)) == [], "the end of an epoch is a position"
    with pytest.raises(gpufeed.GpufeedError, match="past the end"):
        loader.resume(dict(end, samples=16))


def test_npy_and_tar_files_keep_their_own_records(tmp_path):
    """record_bytes or index given for a .npy or .tar file (any case) is refused: its header
    bytes had come out as records."""
    a = np.arange(8, dtype=np.uint32).reshape(4, 2)
    for name in ("a.npy", "B.NPY"):
        np.save(tmp_path / "tmp.npy", a)
        (tmp_path / "tmp.npy").rename(tmp_path / name)
        with pytest.raises(gpufeed.GpufeedError, match="leave record_bytes and index out"):
            gpufeed.BatchLoader(tmp_path / name, record_bytes=8)
    upper = gpufeed.BatchLoader(tmp_path / "B.NPY", batch_size=64, shuffle=False)
    np.testing.assert_array_equal(np.from_dlpack(next(upper.epoch(0)).data), a)


def test_a_link_in_one_class_to_another_class_or_the_root_labels_nothing_wrong(tmp_path):
    """cat/more -> ../dog and cat/loop -> .. had made dog's files samples labelled cat (the
    link was walked first and claimed them); now the link is the folder reached a second
    time: named in strict mode, skipped with skip_bad, and dog's files keep their label."""
    root = tmp_path / "root"
    for rel, data in {"cat/a.jpg": b"CAT", "dog/b.jpg": b"DOG"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    for link, to in (("more", "../dog"), ("loop", "..")):
        (root / "cat" / link).symlink_to(to)
        with pytest.raises(gpufeed.GpufeedError, match=f"cat/{link}.*second time"):
            gpufeed.BatchLoader(root, shuffle=False)
        loader = gpufeed.BatchLoader(root, skip_bad=True, shuffle=False, batch_size=8, workers=1)
        batch = next(loader.epoch(0))
        data = np.from_dlpack(batch.data).tobytes()
        got = [(data[batch.offsets[k]:batch.offsets[k + 1]], loader.classes[label])
               for k, label in enumerate(batch.labels)]
        assert got == [(b"CAT", "cat"), (b"DOG", "dog")], got
        assert loader.skipped == 1, loader.skipped
        (root / "cat" / link).unlink()


def test_a_folder_file_that_grew_since_listed_is_an_error_naming_it(tmp_path):
    """A file that grew after the loader listed it had come out cut to its old size, no error;
    now the open's size is compared with the listed one (a shrunk one too)."""
    (tmp_path / "cat").mkdir()
    grown = tmp_path / "cat" / "a.jpg"
    grown.write_bytes(b"AAAA")
    (tmp_path / "cat" / "b.jpg").write_bytes(b"BB")
    for change in (b"AAAABBBB", b"A"):
        grown.write_bytes(b"AAAA")
        loader = gpufeed.BatchLoader(tmp_path, shuffle=False, batch_size=8, workers=1)
        grown.write_bytes(change)
        with pytest.raises(gpufeed.GpufeedError, match=f"a.jpg changed.*4 bytes when the files "
                                                      f"were listed, {len(change)} bytes now"):
            list(loader.epoch(0))


def test_an_epoch_iterates_the_loaders_own_epoch_and_gives_the_loader_back(tmp_path, monkeypatch):
    """An epoch's batches come straight from the loader's epoch: byte for byte, its position
    advancing a global batch per step; the loader is back when the epoch ends (no need to drop
    the iterator), when it is dropped mid-epoch, and when a resume is refused."""
    count, size, global_batch = 250, 33, 16
    path, data = records_file(tmp_path, count, size, seed=29)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = gpufeed.BatchLoader(path, record_bytes=size, global_batch=global_batch, seed=4,
                                 workers=3)
    steps = (count + global_batch - 1) // global_batch
    assert len(loader) == steps
    it = loader.epoch(3)
    assert it.position() == {"epoch": 3, "samples": 0, "records": count,
                             "order": {"kind": "shuffled", "seed": 4},
                             "global_batch": global_batch}
    first = []
    for k, batch in enumerate(it):
        assert (batch.epoch, batch.number) == (3, k)
        np.testing.assert_array_equal(np.from_dlpack(batch.data), data[batch.indices])
        first.append(list(batch.indices))
        at = it.position()
        if k + 1 < steps:
            assert (at["epoch"], at["samples"]) == (3, (k + 1) * global_batch)
    assert len(first) == steps
    assert (it.position()["epoch"], it.position()["samples"]) == (4, 0)
    with pytest.raises(StopIteration):
        next(it)
    # Ended: the loader is back although `it` lives; the same seed, the same batches.
    again = loader.epoch(3)
    assert [list(b.indices) for b in again] == first
    # Dropped mid-epoch: the loader is back; resumed from a saved position, the rest.
    it = loader.epoch(3)
    for _ in range(4):
        next(it)
    saved = it.position()
    with pytest.raises(gpufeed.GpufeedError, match="already running"):
        loader.epoch(0)
    del it
    rest = loader.resume(saved)
    assert [list(b.indices) for b in rest] == first[4:]
    # A refused resume raises at once and leaves the loader as it was.
    with pytest.raises(gpufeed.GpufeedError, match="global batch"):
        loader.resume(dict(saved, global_batch=2 * global_batch))
    assert [list(b.indices) for b in loader.epoch(3)] == first


def test_webdataset_tar_samples_arrive_whole(tmp_path):
    import io
    import tarfile

    rng = np.random.default_rng(9)
    samples = {}
    for shard in range(2):
        with tarfile.open(tmp_path / f"train-{shard}.tar", "w") as tar:  # pax headers
            for s in range(25):
                key = f"{'deep/' * 30}s{shard}_{s:04}"  # a long name: a pax header
                parts = [("jpg", rng.integers(0, 256, int(rng.integers(1, 4000)),
                                              dtype=np.uint8).tobytes()),
                         ("cls", str(s % 3).encode())]
                for ext, data in parts:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                samples[(shard, s)] = b"".join(d for _, d in parts)
    loader = gpufeed.BatchLoader(str(tmp_path / "train-*.tar"), batch_size=10, seed=3)
    want = [samples[(sh, s)] for sh in range(2) for s in range(25)]
    got = {}
    for batch in loader.epoch(0):
        host = np.from_dlpack(batch.data).tobytes()
        for k, i in enumerate(batch.indices):
            got[i] = host[batch.offsets[k]:batch.offsets[k + 1]]
    assert [got[i] for i in range(len(want))] == want, "each sample's members back to back"
    bad = tmp_path / "bad.tar"
    raw = bytearray((tmp_path / "train-0.tar").read_bytes())
    raw[1024 + 10] ^= 0xFF  # the first member's own header, after the pax header and its data
    bad.write_bytes(bytes(raw))
    with pytest.raises(gpufeed.GpufeedError, match=r"bad\.tar.*offset"):
        gpufeed.BatchLoader(bad)


def test_gpu_gather_without_a_device_is_a_clear_error(tmp_path):
    """gpu_gather=True gathers on the GPU: host batches (device=None) refuse it, saying so."""
    path, _ = records_file(tmp_path, 64, 512)
    with pytest.raises(gpufeed.GpufeedError, match="gpu_gather needs device batches"):
        gpufeed.BatchLoader(path, record_bytes=512, gpu_gather=True)


def test_blocks_read_with_o_direct_resume_with_another_world_size(tmp_path, monkeypatch):
    """block= and direct=: batches of whole blocks of neighbouring records, read with
    O_DIRECT, byte for byte; the position names the block order and resumes with another
    world size, every record once."""
    count, size, block, global_batch = 640, 4099, 8, 32
    path, data = records_file(tmp_path, count, size, seed=23)

    def rank(r, world):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return gpufeed.BatchLoader(path, record_bytes=size, global_batch=global_batch, seed=5,
                                   block=block, direct=True, direct_depth=1 + r,
                                   drop_last=True)

    seen = []

    def take(batch):
        host = np.from_dlpack(batch.data)
        np.testing.assert_array_equal(host, data[batch.indices])
        idx = sorted(batch.indices)
        for k in range(0, len(idx), block):  # whole blocks of neighbours
            assert idx[k] % block == 0 and idx[k + block - 1] == idx[k] + block - 1, idx
        seen.extend(batch.indices)

    epochs = [rank(r, 2).epoch(0) for r in range(2)]
    for _ in range(3):
        for e in epochs:
            take(next(e))
    saved = epochs[0].position()
    assert saved["order"] == {"kind": "blocks", "seed": 5, "block": block}
    del epochs
    for r in range(4):
        for batch in rank(r, 4).resume(saved):
            take(batch)
    assert sorted(seen) == list(range(count)), "every record once"


# The stubs (python/gpufeed/__init__.pyi and _gpufeed.pyi, shipped with py.typed) against the
# installed package: every public name of `gpufeed` and of the native module is in its stub and
# every name in a stub exists, classes have the same members, bases and finality (a pyo3 class
# cannot be subclassed: `@final`), and every function, method and constructor has the same
# parameters: names, kinds and defaults (`inspect.signature`, which reads `__text_signature__`
# for pyo3 functions).

_PACKAGE_DIR = pathlib.Path(gpufeed.__file__).parent
# What Python or pyo3 puts in every class (the constructor is compared on its own).
_CLASS_DUNDERS = {"__dict__", "__doc__", "__firstlineno__", "__init__", "__module__", "__new__",
                  "__qualname__", "__static_attributes__", "__weakref__"}


def _stub(module):
    """The stub of ``module`` as ``{name: ast node}``: its classes, functions and variables, and
    what it re-exports (``from m import X as X``, PEP 484); imports without ``as`` are the
    stub's own helpers."""
    path = _PACKAGE_DIR / (
        "__init__.pyi" if module is gpufeed else module.__name__.rpartition(".")[2] + ".pyi"
    )
    assert path.is_file(), f"{path} is not in the installed package"
    names = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            names.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update((a.name, node) for a in node.names if a.asname == a.name)
    return names


def _stub_all(stub):
    return ast.literal_eval(stub["__all__"].value) if "__all__" in stub else None


def _public(name):
    return not name.startswith("_") or name == "__version__"


def _runtime_names(module):
    """The public names of ``module``: its ``__all__``; for the package also every public
    function and class defined in ``__init__.py`` and every name it re-exports from the native
    module (whether or not ``__all__`` lists it)."""
    names = set(module.__all__)
    if module is gpufeed:
        for name, obj in vars(gpufeed).items():
            if not _public(name):
                continue
            defined_here = ((inspect.isfunction(obj) or inspect.isclass(obj))
                            and obj.__module__ == "gpufeed")
            if defined_here or getattr(_gpufeed, name, None) is obj:
                names.add(name)
    return names


def _stub_params(fn, method):
    """``[(name, kind, default)]`` of a stub function (``default``: ``inspect.Parameter.empty``
    when there is none, ``...`` when the stub does not say)."""
    a = fn.args
    empty, kinds = inspect.Parameter.empty, inspect.Parameter
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + a.defaults
    params = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = kinds.POSITIONAL_ONLY if i < len(a.posonlyargs) else kinds.POSITIONAL_OR_KEYWORD
        params.append((arg.arg, kind, default))
    if a.vararg:
        params.append((a.vararg.arg, kinds.VAR_POSITIONAL, None))
    params += [(arg.arg, kinds.KEYWORD_ONLY, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append((a.kwarg.arg, kinds.VAR_KEYWORD, None))
    out = [(name, kind, empty if d is None else ast.literal_eval(d)) for name, kind, d in params]
    return out[1:] if method else out


def _runtime_params(obj, method):
    params = [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]
    return params[1:] if method else params


def _signature(params):
    try:
        return str(inspect.Signature([inspect.Parameter(n, k, default=d) for n, k, d in params]))
    except (TypeError, ValueError):  # not a valid signature (a stub with the kinds misordered)
        return repr(params)


def _check_signature(where, fn, obj, problems, method=True, constructor=False):
    """``fn`` of the stub against ``obj``; for a method without its first parameter, for a
    constructor against the class's own signature (which has none)."""
    stub = _stub_params(fn, method or constructor)
    runtime = _runtime_params(obj, method and not constructor)
    # A default the stub leaves as `...` is not compared.
    stub = [(n, k, d2 if d is ... else d) for (n, k, d), (_, _, d2) in zip(stub, runtime)] \
        + stub[len(runtime):]
    if stub != runtime:
        problems.append(f"{where}: the stub says {_signature(stub)}, the package "
                        f"{_signature(runtime)}")


def _is_final(node):
    return any(isinstance(d, ast.Name) and d.id == "final" for d in node.decorator_list)


def _is_property(node):
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def _check_class(where, node, cls, problems):
    bases = [b.id for b in node.bases if isinstance(b, ast.Name)] or ["object"]
    if bases != [b.__name__ for b in cls.__bases__]:
        problems.append(f"{where}: bases {bases} in the stub, {cls.__bases__} in the package")
    subclassable = bool(cls.__flags__ & (1 << 10))  # Py_TPFLAGS_BASETYPE
    if _is_final(node) == subclassable:
        problems.append(f"{where}: @final must mark exactly the classes Python cannot subclass "
                        f"(this one: {'can' if subclassable else 'cannot'})")
    members = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
    members.update((m.target.id, m) for m in node.body
                   if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name))
    runtime = {k for k in vars(cls) if k not in _CLASS_DUNDERS
               and (not k.startswith("_") or (k.startswith("__") and k.endswith("__")))}
    stub = set(members) - {"__init__", "__new__"}
    for name in sorted(runtime - stub):
        problems.append(f"{where}.{name} is not in the stub")
    for name in sorted(stub - runtime):
        problems.append(f"{where}.{name} is in the stub, not in the package")
    # The constructor: Python's `__init__`, pyo3's `#[new]` (its `__text_signature__`).
    ctor = members.get("__init__") or members.get("__new__")
    native = cls.__module__ == _gpufeed.__name__
    has_ctor = cls.__text_signature__ is not None if native else "__init__" in vars(cls)
    if not issubclass(cls, BaseException) and (ctor is not None) != has_ctor:
        problems.append(f"{where}: a constructor in the stub: {ctor is not None}, in the "
                        f"package: {has_ctor}")
    elif ctor is not None:
        _check_signature(f"{where}()", ctor, cls, problems, constructor=True)
    for name in sorted(stub & runtime):
        attr = vars(cls)[name]
        if isinstance(members[name], ast.AnnAssign) or _is_property(members[name]):
            if not inspect.isdatadescriptor(attr):
                problems.append(f"{where}.{name}: an attribute in the stub, a method here")
        elif inspect.isdatadescriptor(attr) or not callable(attr):
            problems.append(f"{where}.{name}: a method in the stub, an attribute here")
        else:
            _check_signature(f"{where}.{name}", members[name], getattr(cls, name), problems)


def _stub_problems(module):
    stub, problems = _stub(module), []
    name = module.__name__
    stub_all = set(_stub_all(stub) or ())
    if _stub_all(stub) is None:
        problems.append(f"{name}: the stub has no __all__")
    elif stub_all != set(module.__all__):
        lacks, besides = set(module.__all__) - stub_all, stub_all - set(module.__all__)
        problems.append(f"{name}: __all__ of the stub lacks {sorted(lacks)} and has "
                        f"{sorted(besides)} besides")
    runtime = _runtime_names(module)
    in_stub = {n for n in stub if _public(n) and n != "__all__"} | stub_all
    for missing in sorted(runtime - in_stub):
        problems.append(f"{name}.{missing} is not in the stub")
    for extra in sorted(n for n in in_stub if not hasattr(module, n)):
        problems.append(f"{name}.{extra} is in the stub, not in the package")
    for n in sorted(in_stub & runtime):
        node, obj = stub.get(n), getattr(module, n)
        if isinstance(node, ast.ClassDef):
            _check_class(f"{name}.{n}", node, obj, problems)
        elif isinstance(node, ast.FunctionDef):
            if inspect.isclass(obj) or not callable(obj):
                problems.append(f"{name}.{n}: a function in the stub, {obj!r} here")
            else:
                _check_signature(f"{name}.{n}", node, obj, problems, method=False)
        elif node is None:
            problems.append(f"{name}.{n} is in the stub's __all__ but not defined there")
        elif inspect.isclass(obj) or inspect.isroutine(obj):
            if not isinstance(node, ast.ImportFrom):
                problems.append(f"{name}.{n}: not a class or function in the stub")
    return problems


def test_the_package_is_typed_and_ships_its_stubs():
    assert (_PACKAGE_DIR / "py.typed").is_file()
    for stub in ("__init__.pyi", "_gpufeed.pyi"):
        assert (_PACKAGE_DIR / stub).is_file(), stub


@pytest.mark.parametrize("module", [gpufeed, _gpufeed], ids=["gpufeed", "gpufeed._gpufeed"])
def test_the_stub_names_every_public_function_and_class_with_its_parameters(module):
    problems = _stub_problems(module)
    assert not problems, "\n".join(problems)


def test_the_stub_check_finds_what_is_missing(monkeypatch):
    """The check itself: a function, a parameter or a method added to the package without its
    stub entry is found."""

    def load_everything(path, device=0):
        pass

    load_everything.__module__ = "gpufeed"
    monkeypatch.setattr(gpufeed, "load_everything", load_everything, raising=False)
    monkeypatch.setattr(gpufeed, "load_file", lambda path, device=0, strict=False: None)
    monkeypatch.setattr(gpufeed.Loader, "prefetch", lambda self, path: None, raising=False)
    problems = "\n".join(_stub_problems(gpufeed))
    assert "gpufeed.load_everything is not in the stub" in problems, problems
    assert "gpufeed.load_file: the stub says" in problems, problems
    assert "gpufeed.Loader.prefetch is not in the stub" in problems, problems
