"""On a GPU, against PyTorch: every tensor of a generated checkpoint equals
``safetensors.torch.load_file``'s bit for bit (every dtype torch has, odd shapes, empty and 0-d
tensors, a sharded index), also cut for tensor parallelism (against ``torch.tensor_split``) and
replicated on every GPU, in one process and in processes started like torchrun; files and
device batches arrive byte for byte, tensors outlive their loader, and device memory is given
back when the tensors go.

Skipped (with the reason) without torch or a GPU, unless ``GPUFEED_REQUIRE_GPU=1`` (the GPU
machine), where that is a failure. Runs under pytest, or alone: ``python3 test_gpu.py``."""

import gc
import json
import os
import sys
import tempfile

import gpufeed

REQUIRED = os.environ.get("GPUFEED_REQUIRE_GPU") == "1"


class Skip(Exception):
    pass


def torch_on_gpu():
    """torch, or a skip (a failure where the GPU is required)."""
    try:
        import torch
    except ImportError as e:
        reason = f"torch is not installed ({e})"
    else:
        if torch.cuda.is_available():
            return torch
        reason = "torch sees no CUDA device"
    if REQUIRED:
        raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {reason}")
    try:
        import pytest

        pytest.skip(reason)
    except ImportError:
        raise Skip(reason)


def dtypes(torch):
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
             "float32", "float64", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def random_tensor(torch, dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def checkpoint(torch, directory):
    """A checkpoint of every dtype in odd shapes, as one file and as two shards with an index."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(17)
    shapes = [(3, 7), (1,), (), (0, 5), (13, 17, 3), (1001,)]
    tensors = {}
    for i, dtype in enumerate(dtypes(torch)):
        for j, shape in enumerate(shapes):
            tensors[f"layer{i}.t{j}"] = random_tensor(torch, dtype, shape, gen)
    single = os.path.join(directory, "model.safetensors")
    save_file(tensors, single)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return single, index


def raises(call, *texts, what):
    """Calls ``call``; it must raise a ``GpufeedError`` whose message holds every one of
    ``texts`` (``what`` names the case when it does not raise)."""
    try:
        call()
    except gpufeed.GpufeedError as e:
        assert all(t in str(e) for t in texts), e
    else:
        raise AssertionError(f"no error: {what}")


def same_bits(torch, a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def test_checkpoints_equal_safetensors_bit_for_bit():
    torch = torch_on_gpu()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        single, index = checkpoint(torch, d)
        want = load_file(single, device="cuda:0")
        for path in (single, index):
            got = gpufeed.load_safetensors(path)
            assert sorted(got) == sorted(want), path
            for name, t in got.items():
                assert t.device == torch.device("cuda:0"), (name, t.device)
                assert same_bits(torch, t, want[name]), (path, name, t.dtype, t.shape)


def test_safe_open_loads_each_tensor_on_demand_bit_for_bit():
    """``gpufeed.safe_open`` against safetensors' own ``safe_open``, tensor by tensor, for a
    file and a sharded index; unknown names and a closed checkpoint are clear errors."""
    torch = torch_on_gpu()
    from safetensors import safe_open as st_open

    with tempfile.TemporaryDirectory() as d:
        single, index = checkpoint(torch, d)
        with st_open(single, framework="pt", device="cpu") as f:
            want = {n: f.get_tensor(n) for n in f.keys()}
        for path in (single, index):
            with gpufeed.safe_open(path, device="cuda:0") as f:
                assert f.keys() == sorted(want) and len(f) == len(want), path
                assert "layer0.t0" in f and "nope" not in f
                for name in reversed(f.keys()):
                    t = f.get_tensor(name)
                    assert t.device == torch.device("cuda:0"), (name, t.device)
                    assert same_bits(torch, t.cpu(), want[name]), (path, name, t.dtype)
                raises(lambda: f.get_tensor("nope"), "nope", what="an unknown tensor")
                kept = f.get_tensor("layer0.t0")
            raises(lambda: f.get_tensor("layer0.t0"), "closed",
                   what="a closed checkpoint still loads")
            assert same_bits(torch, kept.cpu(), want["layer0.t0"]), "a tensor outlives close"


def test_registered_files_load_ranges_byte_for_byte():
    torch = torch_on_gpu()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "records.bin")
        data = os.urandom((5 << 20) + 13)
        with open(path, "wb") as f:
            f.write(data)
        loader = gpufeed.Loader(0)
        with loader.register_file(path) as file:
            assert len(file) == len(data), (len(file), len(data))
            assert os.fspath(file.path) == path, file.path
            for start, end in ((0, None), (1, 4099), ((1 << 20) + 5, (3 << 20) + 1), (7, 7)):
                t = loader.load_registered(file, start, end)
                assert t.device == torch.device("cuda:0") and t.dtype == torch.uint8, (t.device, t.dtype)
                assert bytes(t.cpu().numpy()) == data[start:end], (start, end)
            # Small loads do not wait for the frees of the ones dropped before them; what they
            # let go still comes back.
            gpufeed._gpufeed._wait_for_frees()
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(0)[0]
            for _ in range(300):
                t = loader.load_registered(file, 0, 1 << 20)
                del t
            gpufeed._gpufeed._wait_for_frees()
            torch.cuda.synchronize()
            lost = free_before - torch.cuda.mem_get_info(0)[0]
            assert lost < 128 << 20, f"300 loads of 1 MiB, each dropped, kept {lost >> 20} MiB"
            raises(lambda: loader.load_registered(file, 10, len(data) + 1),
                   "reaches past the end of the file", what="a range past the end loaded")
            with open(path, "ab") as f:
                f.write(b"more")
            raises(lambda: loader.load_registered(file, 0, 10), "register the file again",
                   what="a changed file loaded")
        raises(lambda: loader.load_registered(file, 0, 10), "closed",
               what="a closed file loaded")


def test_closing_while_another_thread_loads_neither_hangs_nor_breaks_the_loads():
    """``close`` on one thread while another thread loads from the same registered file and
    the same ``safe_open`` checkpoint: every load either succeeds with the right bytes or says
    the file was closed, and both threads end (a close waiting for the lock with the GIL
    held would deadlock against a load that needs the GIL back)."""
    import threading

    torch = torch_on_gpu()
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.safetensors")
        save_file({f"t{i}": torch.full((4096,), float(i)) for i in range(64)}, path)
        loader = gpufeed.Loader(0)
        for _ in range(20):
            file = loader.register_file(path)
            f = gpufeed.safe_open(path, device=0)
            outcomes = []

            def load():
                for i in range(200):
                    try:
                        t = f.get_tensor(f"t{i % 64}")
                        if not bool((t == float(i % 64)).all()):
                            outcomes.append(f"wrong values in t{i % 64}")
                            return
                        loader.load_registered(file, 0, 4096)
                        outcomes.append("ok")
                    except gpufeed.GpufeedError as e:
                        outcomes.append("closed" if "closed" in str(e) else f"error: {e}")
                        return
                    except Exception as e:  # noqa: BLE001 (reported to the main thread)
                        outcomes.append(f"error: {type(e).__name__}: {e}")
                        return

            worker = threading.Thread(target=load)
            worker.start()
            f.close()
            file.close()
            worker.join(timeout=30)
            assert not worker.is_alive(), "a load and a close deadlocked"
            assert outcomes, "the loading thread ran"
            bad = [o for o in outcomes if o not in ("ok", "closed")]
            assert not bad, bad


def test_arrays_without_torch_hold_the_same_tensors():
    """The path taken where torch is not installed: ``Array`` views, one per tensor."""
    torch = torch_on_gpu()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        _, index = checkpoint(torch, d)
        want = load_file(os.path.join(d, "model.safetensors"), device="cuda:0")
        got = gpufeed._arrays(gpufeed.Loader(0)._native.load_safetensors_files(index))
        assert sorted(got) == sorted(want)
        for name, array in got.items():
            assert same_bits(torch, torch.from_dlpack(array), want[name]), name


def test_a_dtype_this_torch_lacks_is_a_clear_error():
    torch = torch_on_gpu()
    raises(lambda: gpufeed._torch_dtype(torch, {}, "F8_E4M3"), "F8_E4M3", "gpufeed.load_file",
           what="a dtype missing from the table")


def test_many_small_tensors_of_mixed_dtypes():
    """10,000 tensors whose dtypes alternate: every one a view at its own offset."""
    torch = torch_on_gpu()
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(29)
    kinds = [torch.float16, torch.float32, torch.int8, torch.int64, torch.bfloat16]
    tensors = {f"t{i:05}": random_tensor(torch, kinds[i % len(kinds)], (i % 7, 3), gen)
               for i in range(10_000)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "many.safetensors")
        save_file(tensors, path)
        got = gpufeed.load_safetensors(path)
        want = load_file(path, device="cuda:0")
        assert sorted(got) == sorted(want)
        for name, t in got.items():
            assert same_bits(torch, t, want[name]), name


def test_a_tensor_at_an_unaligned_offset():
    """safetensors writers align tensors, but the format does not require it: an F32 tensor at
    byte 3 still arrives (exported alone through DLPack)."""
    torch = torch_on_gpu()
    import struct

    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    values = struct.pack("<2f", 1.5, -2.25)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "odd.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + b"\x01\x02\x03" + values)
        got = gpufeed.load_safetensors(path)
        assert got["a"].tolist() == [1, 2, 3]
        assert got["b"].dtype == torch.float32 and got["b"].tolist() == [1.5, -2.25]


def test_files_and_ranges_arrive_byte_for_byte():
    torch = torch_on_gpu()
    with tempfile.TemporaryDirectory() as d:
        data = os.urandom(5_000_003)
        path = os.path.join(d, "f.bin")
        with open(path, "wb") as f:
            f.write(data)
        want = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        t = gpufeed.load_file(path)
        assert t.dtype == torch.uint8 and t.is_cuda and t.shape == (len(data),)
        assert torch.equal(t.cpu(), want)
        r = gpufeed.load_range(path, 4097, 1_000_001)
        assert torch.equal(r.cpu(), want[4097:1_000_001])


def test_a_gds_loader_loads_byte_for_byte():
    # strategy="gds": cuFile where it reads the file (its compatibility mode on the H200
    # machine), else gpufeed's own path; the bytes are the file's either way.
    torch = torch_on_gpu()
    with tempfile.TemporaryDirectory() as d:
        data = os.urandom(9_000_011)
        path = os.path.join(d, "g.bin")
        with open(path, "wb") as f:
            f.write(data)
        loader = gpufeed.Loader(0, strategy="gds")
        want = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert torch.equal(loader.load_file(path).cpu(), want)
        assert torch.equal(loader.load_range(path, 4099, 8_000_001).cpu(), want[4099:8_000_001])


def test_tensors_outlive_their_loader():
    torch = torch_on_gpu()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        single, _ = checkpoint(torch, d)
        loader = gpufeed.Loader(0)
        got = loader.load_safetensors(single)
        del loader
        gc.collect()
        torch.cuda.synchronize()
        want = load_file(single, device="cuda:0")
        for name, t in got.items():
            assert same_bits(torch, t, want[name]), name


def test_device_memory_is_given_back_when_the_tensors_go():
    torch = torch_on_gpu()
    with tempfile.TemporaryDirectory() as d:
        size = 512 << 20
        path = os.path.join(d, "big.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * (size >> 20))
        gpufeed.load_file(path)  # the shared loader and its first allocation exist
        gc.collect()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(0)[0]
        for _ in range(8):
            t = gpufeed.load_file(path)
            assert t.shape == (size,)
            del t
            gc.collect()
        torch.cuda.synchronize()
        gpufeed._gpufeed._wait_for_frees()
        lost = free_before - torch.cuda.mem_get_info(0)[0]
        assert lost < 2 * size, f"8 loads of 512 MiB, each dropped, kept {lost >> 20} MiB"


def test_dropping_a_tensor_does_not_wait_for_the_gpu():
    """The last tensor of a load going away does not block the Python thread on the GPU's
    queued work (a training loop moving on to its next batch), yet the memory is freed only
    after that work: a second of GPU sleep queued, the drop returns at once, the free after."""
    torch = torch_on_gpu()
    import time

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
        t = gpufeed.load_file(path)
        torch.cuda._sleep(int(2e9))  # about a second of spinning on torch's current stream
        started = time.perf_counter()
        del t
        gc.collect()
        dropped = time.perf_counter() - started
        gpufeed._gpufeed._wait_for_frees()
        freed = time.perf_counter() - started
        assert dropped < 0.25, f"the drop waited {dropped:.3f} s for the GPU"
        assert freed > 0.4, f"freed after {freed:.3f} s: before the queued work ended"


def test_device_batches_arrive_byte_for_byte():
    torch = torch_on_gpu()
    import numpy as np

    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory() as d:
        count, size = 2000, 65_537
        data = np.random.default_rng(3).integers(0, 256, (count, size), dtype=np.uint8)
        path = os.path.join(d, "records.bin")
        data.tofile(path)
        loader = gpufeed.BatchLoader(path, record_bytes=size, batch_size=256, seed=5, device=0)
        seen = 0
        for batch in loader.epoch(0):
            x = gpufeed.as_tensor(batch.data)
            assert x.is_cuda and tuple(x.shape) == (len(batch.indices), size)
            assert torch.equal(x.cpu(), torch.from_numpy(data[batch.indices]))
            seen += len(batch.indices)
        assert seen == count


def test_records_gathered_by_the_gpu_arrive_byte_for_byte():
    """gpu_gather=True: the GPU gathers each batch out of the file's registered mapping;
    records of 4,096 bytes (16-byte copies) and of 4,099 (single bytes), two epochs."""
    torch = torch_on_gpu()
    import numpy as np

    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    for size in (4096, 4099):
        with tempfile.TemporaryDirectory() as d:
            count = 1500
            data = np.random.default_rng(size).integers(0, 256, (count, size), dtype=np.uint8)
            path = os.path.join(d, "records.bin")
            data.tofile(path)
            loader = gpufeed.BatchLoader(path, record_bytes=size, batch_size=128, seed=5,
                                         device=0, workers=2, gpu_gather=True)
            for epoch in range(2):
                seen = 0
                for batch in loader.epoch(epoch):
                    x = gpufeed.as_tensor(batch.data)
                    assert x.is_cuda and tuple(x.shape) == (len(batch.indices), size)
                    assert torch.equal(x.cpu(), torch.from_numpy(data[batch.indices]))
                    seen += len(batch.indices)
                assert seen == count
            del loader


def test_image_folder_batches_on_the_gpu():
    """A folder of class folders: each batch's file bytes on the GPU, labels beside them;
    gathered by the CPU's workers and by the GPU (gpu_gather=True), each file's bytes at its
    offsets (files of unaligned sizes land at unaligned offsets)."""
    torch = torch_on_gpu()
    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory() as d:
        bodies = {}
        for c, cls in enumerate(("a", "b")):
            os.mkdir(os.path.join(d, cls))
            for j in range(150):
                body = os.urandom(1000 + 37 * j)
                with open(os.path.join(d, cls, f"{j}.bin"), "wb") as f:
                    f.write(body)
                bodies.setdefault(c, set()).add(body)
        for gpu_gather in (False, True):
            loader = gpufeed.BatchLoader(d, batch_size=64, seed=1, device=0,
                                         gpu_gather=gpu_gather)
            seen = 0
            for batch in loader.epoch(0):
                x = gpufeed.as_tensor(batch.data)
                assert x.is_cuda and x.dtype == torch.uint8
                host = x.cpu().numpy().tobytes()
                assert len(host) == batch.offsets[-1]
                for k, label in enumerate(batch.labels):
                    body = host[batch.offsets[k]:batch.offsets[k + 1]]
                    assert body in bodies[label], (gpu_gather, batch.indices[k], label)
                seen += len(batch.labels)
            assert seen == 300
            del loader


def test_a_device_other_than_torchs_current_one():
    torch = torch_on_gpu()
    if torch.cuda.device_count() < 2:
        reason = "one GPU: no other device to load onto"
        try:
            import pytest

            pytest.skip(reason)
        except ImportError:
            raise Skip(reason)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(3_000_001))
        torch.cuda.set_device(0)
        t = gpufeed.load_file(path, device=1)
        assert t.device == torch.device("cuda:1")
        assert torch.equal(t.cpu(), torch.frombuffer(bytearray(open(path, "rb").read()),
                                                      dtype=torch.uint8))
        from safetensors.torch import load_file

        single, _ = checkpoint(torch, d)
        want = load_file(single, device="cuda:1")
        got = gpufeed.Loader(1).load_safetensors(single)
        assert torch.cuda.current_device() == 0
        for name, t in got.items():
            assert t.device == torch.device("cuda:1"), (name, t.device)
            assert same_bits(torch, t, want[name]), name


def test_replicated_and_sharded_on_every_gpu():
    torch = torch_on_gpu()
    devices = list(range(min(torch.cuda.device_count(), 4)))
    with tempfile.TemporaryDirectory() as d:
        paths, datas = [], []
        for i, n in enumerate([(9 << 20) + 5, 3 << 20]):
            path = os.path.join(d, f"f{i}.bin")
            data = os.urandom(n)
            with open(path, "wb") as f:
                f.write(data)
            paths.append(path)
            datas.append(data)
        torch.cuda.set_device(0)
        copies = gpufeed.load_replicated(paths[0], devices=devices)
        assert torch.cuda.current_device() == 0
        assert len(copies) == len(devices)
        for dev, t in zip(devices, copies):
            assert t.device == torch.device(f"cuda:{dev}"), t.device
            assert bytes(t.cpu().numpy()) == datas[0], dev
        shares, pieces = gpufeed.load_sharded(paths, devices=devices)
        for dev, t, parts in zip(devices, shares, pieces):
            assert t.device == torch.device(f"cuda:{dev}")
            want = b"".join(datas[i][a:b] for i, a, b in parts)
            assert bytes(t.cpu().numpy()) == want, dev
        assert sum(t.numel() for t in shares) == sum(len(x) for x in datas)


def tensor_parallel_part(torch, t, dim, ranks, rank):
    """What rank ``rank`` of ``ranks`` holds of ``t`` cut along ``dim``: torch.tensor_split's
    part (numpy.array_split's shares), or all of it where ``t`` lacks the dimension."""
    if t.dim() <= dim:
        return t
    return torch.tensor_split(t, ranks, dim)[rank]


def test_tensor_parallel_and_replicated_checkpoints_on_every_gpu():
    torch = torch_on_gpu()
    from safetensors.torch import load_file

    devices = list(range(min(torch.cuda.device_count(), 4)))
    with tempfile.TemporaryDirectory() as d:
        single, index = checkpoint(torch, d)
        want = load_file(single, device="cpu")
        torch.cuda.set_device(0)
        for path in (single, index):
            for split, dim in (("rows", 0), ("columns", 1), (2, 2)):
                parts = gpufeed.load_tensor_parallel(path, devices=devices, split=split)
                assert len(parts) == len(devices)
                for rank, (dev, got) in enumerate(zip(devices, parts)):
                    assert sorted(got) == sorted(want), (path, split)
                    for name, t in got.items():
                        assert t.device == torch.device(f"cuda:{dev}"), (name, t.device)
                        part = tensor_parallel_part(torch, want[name], dim, len(devices), rank)
                        assert same_bits(torch, t.cpu(), part), (path, split, rank, name)
            copies = gpufeed.load_replicated_safetensors(path, devices=devices)
            for dev, got in zip(devices, copies):
                assert sorted(got) == sorted(want), path
                for name, t in got.items():
                    assert t.device == torch.device(f"cuda:{dev}"), (name, t.device)
                    assert same_bits(torch, t.cpu(), want[name]), (path, dev, name)
        assert torch.cuda.current_device() == 0


def run_ranks(world, code, arg, job, replicate="staging"):
    """``world`` Python processes started as torchrun starts them (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, one job name; ``GPUFEED_REPLICATE`` as given) running ``code`` on
    ``arg``; each must print ``OK <rank> of <world>``."""
    import subprocess

    env = dict(os.environ, LOCAL_WORLD_SIZE=str(world), GPUFEED_JOB=job,
               GPUFEED_REPLICATE=replicate)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, arg], env=dict(env, LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and f"OK {r} of {world}" in out, out


def ranks_for(torch):
    """Two ranks or one per GPU (at most 4): with one GPU two ranks share it (a rank's GPU is
    LOCAL_RANK modulo the GPUs it sees)."""
    return max(2, min(torch.cuda.device_count(), 4))


def test_ranks_started_like_torchrun_load_tensor_parallel_shares():
    torch = torch_on_gpu()
    world = ranks_for(torch)
    with tempfile.TemporaryDirectory() as d:
        single, _ = checkpoint(torch, d)
        code = (
            "import sys, gpufeed, torch\n"
            "from safetensors.torch import load_file\n"
            "got, rank, world = gpufeed.load_tensor_parallel_rank(sys.argv[1], split='columns')\n"
            "want = load_file(sys.argv[1])\n"
            "assert sorted(got) == sorted(want)\n"
            "for name, t in got.items():\n"
            "    assert t.device == torch.device(f'cuda:{rank % torch.cuda.device_count()}'), t.device\n"
            "    w = want[name]\n"
            "    part = torch.tensor_split(w, world, 1)[rank] if w.dim() > 1 else w\n"
            "    a = t.cpu().contiguous().reshape(-1).view(torch.uint8)\n"
            "    b = part.contiguous().reshape(-1).view(torch.uint8)\n"
            "    assert t.shape == part.shape and torch.equal(a, b), name\n"
            "print(f'OK {rank} of {world}')\n"
        )
        run_ranks(world, code, single, f"pytest-tp-{os.getpid()}")


def test_ranks_started_like_torchrun_load_replicated():
    torch = torch_on_gpu()
    world = ranks_for(torch)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.bin")
        data = os.urandom((13 << 20) + 3)
        with open(path, "wb") as f:
            f.write(data)
        code = (
            "import sys, gpufeed, torch\n"
            "t, rank, world = gpufeed.load_replicated_rank(sys.argv[1])\n"
            "assert t.device == torch.device(f'cuda:{rank % torch.cuda.device_count()}'), t.device\n"
            "assert bytes(t.cpu().numpy()) == open(sys.argv[1], 'rb').read()\n"
            "print(f'OK {rank} of {world}')\n"
        )
        run_ranks(world, code, path, f"pytest-{os.getpid()}")
        # Through NCCL: a rank per GPU (NCCL refuses two ranks on one GPU), one on one GPU.
        gpus = min(torch.cuda.device_count(), 4)
        run_ranks(gpus, code, path, f"pytest-nccl-{os.getpid()}", replicate="nccl")


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except BaseException as e:  # noqa: BLE001 (report each, then the exit code)
                if isinstance(e, Skip) or type(e).__name__ == "Skipped":  # pytest's skip
                    print(f"SKIP {name}: {e}")
                    continue
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
