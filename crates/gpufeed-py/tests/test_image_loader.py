"""``gpufeed.ImageLoader`` (issue 40): an image folder and WebDataset shards into ``(images,
labels)`` batches, decoded, cropped, resized and mirrored — on the CPU (CI) each image equal to
the CPU reference of its own crop (drawn from the seed, the epoch and its record's index), close
to torch's antialiased interpolate of PIL's decode; labels from class folders and ``.cls``;
bad files raised naming them or skipped and listed; an elastic run's position and resume. On a
GPU (``GPUFEED_REQUIRE_GPU=1``): within one unit of torchvision's nvJPEG decode cropped by
torch's interpolate, the same batches whatever the decode threads.

Skipped with the reason without torch, numpy or Pillow (the GPU part also without a GPU or
torchvision), unless ``GPUFEED_REQUIRE_GPU=1``."""

import io
import os
import tarfile

import pytest

import gpufeed
from test_images import REQUIRED, _needs
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    """One process, whatever the environment says (the sampler reads RANK / WORLD_SIZE)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _jpeg(np, Image, w, h, seed, **kw):
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, w)[None, :]
    y = np.linspace(0, 255, h)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2 * 0.5 + 60], axis=-1)
    rgb = np.clip(rgb + rng.normal(0, 3, rgb.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _folder(np, Image, root, per=7):
    """An image folder of three classes; returns (path, label, bytes) in the folder's order
    (classes sorted, files sorted by path)."""
    kinds = [dict(subsampling=2), dict(subsampling=0), dict(progressive=True),
             dict(subsampling=1)]
    out = []
    for label, cls in enumerate(["ant", "bee", "cat"]):
        os.makedirs(os.path.join(root, cls))
        for i in range(per):
            k = label * per + i
            data = _jpeg(np, Image, 30 + 11 * (k % 5), 22 + 7 * (k % 4), k, **kinds[k % 4])
            path = os.path.join(root, cls, f"{i:03}.jpg")
            with open(path, "wb") as f:
                f.write(data)
            out.append((path, label, data))
    return out


def _reference(np, data, index, epoch, seed, height, width, train=True):
    """The CPU reference of record ``index``'s image: gpufeed's CPU decode, its crop and flip
    drawn from (seed, epoch, index), the CPU resize: uint8 [height, width, 3]."""
    (img,) = gpufeed.decode_jpegs([data])
    h, w = img.shape[:2]
    if train:
        crop = gpufeed._gpufeed.random_resized_crop(w, h, seed, epoch, index)
        flip = gpufeed._gpufeed.random_flip(seed, epoch, index)
    else:
        side = max(1, min(w, h, round(min(w, h) * 0.875)))
        crop, flip = (round((w - side) / 2), round((h - side) / 2), side, side), False
    values = gpufeed._gpufeed.resize_crop(img.numpy().tobytes(), w, h, crop, width, height, flip)
    f = np.frombuffer(values, dtype=np.float32).reshape(height, width, 3)
    return np.clip(np.round(f), 0, 255).astype(np.uint8), crop, flip


def test_a_folder_loads_on_the_cpu_as_the_reference_crops_with_its_labels(tmp_path):
    np, torch, Image = _needs()
    import torch.nn.functional as F

    samples = _folder(np, Image, str(tmp_path))
    loader = gpufeed.ImageLoader(tmp_path, batch_size=5, size=(20, 24), seed=3, device=None,
                                 workers=2)
    assert loader.cpu_only and loader.classes == ["ant", "bee", "cat"]
    assert len(loader) == 5
    seen = []
    epoch = loader.epoch(1)
    for images, labels in epoch:
        assert images.dtype == torch.uint8 and images.device.type == "cpu"
        assert images.shape == (len(epoch.indices), 20, 24, 3)
        assert labels.dtype == torch.int64
        assert labels.tolist() == [samples[i][1] for i in epoch.indices]
        for img, i in zip(images, epoch.indices):
            want, crop, flip = _reference(np, samples[i][2], i, 1, 3, 20, 24)
            assert np.array_equal(img.numpy(), want), f"record {i}"
            # And close to torch's antialiased interpolate of PIL's decode.
            pil = torch.from_numpy(np.asarray(Image.open(io.BytesIO(samples[i][2]))
                                              .convert("RGB")).copy())
            x, y, w, h = crop
            region = pil[y:y + h, x:x + w].permute(2, 0, 1)[None].float()
            r = F.interpolate(region, size=(20, 24), mode="bilinear", antialias=True,
                              align_corners=False)[0].permute(1, 2, 0)
            r = r.flip(1) if flip else r
            assert (img.float() - r).abs().mean().item() < 1.5, f"record {i}"
        seen.extend(epoch.indices)
    assert sorted(seen) == list(range(len(samples)))
    # The same epoch again: the same batches; the next: other crops.
    a = [x for x, _ in loader.epoch(1)]
    b = [x for x, _ in loader.epoch(1)]
    c = [x for x, _ in loader.epoch(2)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(a, c))

    # Evaluation crops, normalized float32 NCHW and float16 cast from it.
    for dtype in (torch.float32, torch.float16):
        ev = gpufeed.ImageLoader(tmp_path, batch_size=8, size=16, train=False, shuffle=False,
                                 device="cpu", dtype=dtype)
        it = ev.epoch(0)
        x, labels = next(it)
        assert x.shape == (8, 3, 16, 16) and x.dtype == dtype
        assert it.indices == list(range(8))
        want = np.stack([_reference(np, samples[i][2], i, 0, 0, 16, 16, train=False)[0]
                         for i in range(8)])
        m = torch.tensor(MEAN)[None, :, None, None]
        s = torch.tensor(STD)[None, :, None, None]
        ref = ((torch.from_numpy(want).permute(0, 3, 1, 2).float() / 255 - m) / s).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        # uint8 rounding is not in the float path: compare to the float reference loosely.
        assert (x.float() - ref.float()).abs().max().item() < 0.05 + tol


def _tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_give_images_and_cls_labels_and_bad_samples_follow_the_policy(
        tmp_path):
    np, torch, Image = _needs()
    records = []
    for shard in range(2):
        samples = []
        for s in range(5):
            data = _jpeg(np, Image, 40 + s, 30 + shard, 10 * shard + s)
            label = 7 * shard + s
            samples.append((f"s{shard}-{s}", [("jpg", data), ("cls", str(label).encode())]))
            records.append((label, data))
        _tar(tmp_path / f"train-{shard}.tar", samples)
    loader = gpufeed.ImageLoader(str(tmp_path / "train-*.tar"), batch_size=4, size=12,
                                 device=None, seed=5)
    assert loader.classes == [] and len(loader) == 3
    epoch = loader.epoch(0)
    got = []
    for images, labels in epoch:
        assert labels.tolist() == [records[i][0] for i in epoch.indices]
        for img, i in zip(images, epoch.indices):
            want, _, _ = _reference(np, records[i][1], i, 0, 5, 12, 12)
            assert np.array_equal(img.numpy(), want)
        got.extend(epoch.indices)
    assert sorted(got) == list(range(10))

    good = records[0][1]
    _tar(tmp_path / "bad.tar", [
        ("a", [("jpg", good), ("cls", b"1")]),
        ("b", [("jpg", good[: len(good) // 2]), ("cls", b"2")]),
        ("c", [("png", b"\x89PNG\r\n\x1a\n")]),
        ("d", [("jpg", good)]),
    ])
    strict = gpufeed.ImageLoader(tmp_path / "bad.tar", batch_size=4, size=8, device=None,
                                 shuffle=False)
    with pytest.raises(gpufeed.GpufeedError, match=r"bad\.tar:b: truncated JPEG"):
        next(strict.epoch(0))
    lenient = gpufeed.ImageLoader(tmp_path / "bad.tar", batch_size=4, size=8, device=None,
                                  shuffle=False, on_error="skip")
    epoch = lenient.epoch(0)
    images, labels = next(epoch)
    assert epoch.indices == [0, 3] and images.shape == (2, 8, 8, 3)
    assert labels.tolist() == [1, -1], "a sample without .cls has label -1"
    names = [n for n, _ in lenient.skipped]
    assert names[0].endswith("bad.tar:b") and names[1].endswith("bad.tar:c"), names
    assert "no .jpg or .jpeg member" in lenient.skipped[1][1]
    # Each epoch lists its own: a bad file once per epoch.
    del epoch
    for _ in lenient.epoch(1):
        pass
    assert [n for n, _ in lenient.skipped] == names


def test_an_elastic_run_resumes_where_it_stopped_and_bad_settings_are_refused(tmp_path):
    np, torch, Image = _needs()
    samples = _folder(np, Image, str(tmp_path), per=8)  # 24 records: 4 steps of 6
    make = lambda: gpufeed.ImageLoader(tmp_path, size=8, device=None, global_batch=6,  # noqa: E731
                                       drop_last=True, seed=2)
    loader = make()
    epoch = loader.epoch(0)
    first = []
    for _ in range(2):
        next(epoch)
        first.extend(epoch.indices)
    position = epoch.position()
    assert position["samples"] == 12 and position["epoch"] == 0
    del epoch
    rest = make().resume(position)
    after = []
    for _ in rest:
        after.extend(rest.indices)
    assert sorted(first + after) == list(range(len(samples)))
    assert rest.position()["epoch"] == 1

    with pytest.raises(ValueError, match="size"):
        gpufeed.ImageLoader(tmp_path, size=0, device=None)
    with pytest.raises(ValueError, match="on_error"):
        gpufeed.ImageLoader(tmp_path, device=None, on_error="ignore")
    with pytest.raises(ValueError, match="dtype"):
        gpufeed.ImageLoader(tmp_path, device=None, dtype=torch.int32)
    with pytest.raises(ValueError, match="crop_fraction"):
        gpufeed.ImageLoader(tmp_path, device=None, crop_fraction=0)
    with pytest.raises(ValueError, match="cuda_decoders"):
        gpufeed.ImageLoader(tmp_path, device=None, cuda_decoders=-1)
    np = pytest.importorskip("numpy")
    gpufeed.ImageLoader(tmp_path, size=(8.0, 8), seed=np.int64(3), shuffle=None, device=None)
    gpufeed.ImageLoader(tmp_path, size=np.int32(8), device=None)
    for size in ((8,), 8.5, True, ("8", 8)):
        with pytest.raises(ValueError, match="size"):
            gpufeed.ImageLoader(tmp_path, size=size, device=None)
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            gpufeed.ImageLoader(tmp_path, seed=seed, device=None)
    with pytest.raises(ValueError, match="shuffle"):
        gpufeed.ImageLoader(tmp_path, shuffle="nope", device=None)
    with pytest.raises(gpufeed.GpufeedError, match="scale"):
        gpufeed.ImageLoader(tmp_path, device=None, scale=(0.9, 0.1))
    with pytest.raises(gpufeed.GpufeedError, match="missing"):
        gpufeed.ImageLoader(tmp_path / "missing", device=None)
    if not torch.cuda.is_available():
        with pytest.raises(gpufeed.NoGpuError):
            gpufeed.ImageLoader(tmp_path, device=0)


def test_on_the_gpu_batches_are_torchvisions_decode_cropped_by_torch(tmp_path):
    np, torch, Image = _needs()
    try:
        from torchvision.io import decode_jpeg
    except ImportError as e:
        reason = f"torchvision is not installed ({e})"
    else:
        reason = None if torch.cuda.is_available() else "torch sees no CUDA device"
    if reason:
        if REQUIRED:
            raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
    import torch.nn.functional as F

    samples = _folder(np, Image, str(tmp_path), per=12)
    runs = []
    for decoders in (1, 3):
        loader = gpufeed.ImageLoader(tmp_path, batch_size=7, size=(40, 56), seed=9, device=0,
                                     decoders=decoders)
        if REQUIRED:
            assert loader.cpu_only is None, loader.cpu_only
        batches = []
        epoch = loader.epoch(3)
        for images, labels in epoch:
            assert images.device == torch.device("cuda:0") and labels.device == images.device
            batches.append((list(epoch.indices), labels.tolist(), images.clone()))
        runs.append(batches)
    for (i1, l1, x1), (i2, l2, x2) in zip(*runs):
        assert (i1, l1) == (i2, l2) and torch.equal(x1, x2), "1 and 3 decode threads"
    for indices, labels, images in runs[0]:
        assert labels == [samples[i][1] for i in indices]
        for img, i in zip(images, indices):
            if i % 4 == 2:
                # Progressive (see _folder): decoded on the CPU (nvJPEG decoded one wrongly
                # without an error), then resized on the GPU: the CPU reference within a unit.
                want, _, _ = _reference(np, samples[i][2], i, 3, 9, 40, 56)
                diff = (img.cpu().int() - torch.from_numpy(want).int()).abs()
                assert diff.max().item() <= 1, f"record {i}: {diff.max().item()}"
                continue
            data = torch.frombuffer(bytearray(samples[i][2]), dtype=torch.uint8)
            decoded = decode_jpeg(data, device="cuda:0").permute(1, 2, 0)
            h, w = decoded.shape[:2]
            x, y, cw, ch = gpufeed._gpufeed.random_resized_crop(w, h, 9, 3, i)
            flip = gpufeed._gpufeed.random_flip(9, 3, i)
            region = decoded[y:y + ch, x:x + cw].permute(2, 0, 1)[None].float()
            r = F.interpolate(region, size=(40, 56), mode="bilinear", antialias=True,
                              align_corners=False)[0].permute(1, 2, 0)
            r = r.flip(1) if flip else r
            diff = (img.float() - r).abs()
            assert diff.max().item() <= 1.0, f"record {i}: {diff.max().item()}"


def test_without_nvjpeg_a_gpu_loader_says_why_and_decodes_on_the_cpu(tmp_path):
    """nvJPEG missing (GPUFEED_NVJPEG_LIBRARY naming no file, in a child process: the library
    is looked for once per process): the loader says so in ``cpu_only`` and its batches are the
    CPU's decode, resized on the GPU (within one unit of the CPU reference)."""
    import subprocess
    import sys

    np, torch, Image = _needs()
    if not torch.cuda.is_available():
        if REQUIRED:
            raise AssertionError("GPUFEED_REQUIRE_GPU=1 but torch sees no CUDA device")
        pytest.skip("torch sees no CUDA device")
    samples = _folder(np, Image, str(tmp_path / "images"), per=3)
    child = f"""
import gpufeed, json, torch
loader = gpufeed.ImageLoader({str(tmp_path / "images")!r}, batch_size=9, size=16, seed=2,
                             device=0, shuffle=False)
epoch = loader.epoch(0)
x, y = next(epoch)
torch.save(x.cpu(), {str(tmp_path / "x.pt")!r})
print(json.dumps({{"cpu_only": loader.cpu_only, "device": str(x.device),
                   "indices": epoch.indices, "labels": y.tolist()}}))
"""
    env = dict(os.environ, GPUFEED_NVJPEG_LIBRARY="/nonexistent/libnvjpeg.so.13")
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "/nonexistent/libnvjpeg.so.13" in got["cpu_only"], got["cpu_only"]
    assert got["device"] == "cuda:0" and got["indices"] == list(range(9))
    assert got["labels"] == [s[1] for s in samples]
    x = torch.load(tmp_path / "x.pt")
    for img, i in zip(x, got["indices"]):
        want, _, _ = _reference(np, samples[i][2], i, 0, 2, 16, 16)
        diff = (img.int() - torch.from_numpy(want).int()).abs()
        assert diff.max().item() <= 1, f"record {i}: {diff.max().item()}"
