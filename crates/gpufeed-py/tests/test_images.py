"""JPEGs decoded by ``gpufeed.decode_jpegs`` (issue 40): on the CPU (zune-jpeg; CI) against
PIL's decode of the same bytes, and on a GPU (nvJPEG) against torchvision's
``decode_jpeg(device="cuda")`` — the same decoder — and PIL; every kind PIL makes (4:4:4, 4:2:2,
4:2:0, progressive, restart markers, gray, odd sizes); files that are no decodable JPEG
(truncated, corrupt, PNG, CMYK) raise naming the image, or are skipped where asked.

Skipped with the reason without torch or Pillow (the GPU part: without a GPU, or torchvision),
unless ``GPUFEED_REQUIRE_GPU=1`` (the GPU machine), where the GPU part is a failure."""

import io
import os

import pytest

import gpufeed

REQUIRED = os.environ.get("GPUFEED_REQUIRE_GPU") == "1"


def _needs():
    try:
        import numpy as np
        import torch
        from PIL import Image
    except ImportError as e:
        if REQUIRED:
            raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {e}") from None
        pytest.skip(f"torch, numpy or Pillow is not installed ({e})")
    return np, torch, Image


def _photo(np, w, h, seed):
    """A photo-like RGB image: smooth gradients and a little noise."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, w)[None, :]
    y = np.linspace(0, 255, h)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2 * 0.5 + 60], axis=-1)
    rgb = rgb + rng.normal(0, 2, rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def _kinds(np, Image):
    """name -> JPEG bytes, every kind Pillow makes."""
    out = {}
    for (w, h), seed in (((500, 375), 1), ((37, 51), 2), ((1, 1), 3), ((333, 127), 4)):
        img = Image.fromarray(_photo(np, w, h, seed))
        for sub in (0, 1, 2):
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=90, subsampling=sub)
            out[f"{w}x{h} subsampling {sub}"] = buf.getvalue()
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90, progressive=True)
        out[f"{w}x{h} progressive"] = buf.getvalue()
        buf = io.BytesIO()
        img.convert("L").save(buf, "JPEG", quality=90)
        out[f"{w}x{h} gray"] = buf.getvalue()
        try:
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=90, restart_marker_rows=1)
            out[f"{w}x{h} restart markers"] = buf.getvalue()
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=90, progressive=True, restart_marker_blocks=7)
            out[f"{w}x{h} progressive, restart markers"] = buf.getvalue()
        except TypeError:
            pass  # a Pillow before 10.2 makes no restart markers
    return out


def _bad(np, Image, good):
    """name -> bytes that are no decodable JPEG."""
    img = Image.fromarray(_photo(np, 64, 48, 9))
    png, cmyk = io.BytesIO(), io.BytesIO()
    img.save(png, "PNG")
    img.convert("CMYK").save(cmyk, "JPEG", quality=90)
    return {
        "truncated": good[: len(good) // 2],
        "cut before its end marker": good[:-2],
        "png": png.getvalue(),
        "cmyk": cmyk.getvalue(),
        "empty": b"",
        "noise": bytes(np.random.default_rng(5).integers(0, 256, 4000, dtype=np.uint8)),
    }


def _pil(np, Image, data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _psnr(np, a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def _check_against_pil(np, Image, kinds, got, where):
    for (name, data), t in zip(kinds.items(), got):
        want = _pil(np, Image, data)
        have = t.cpu().numpy()
        assert have.shape == want.shape, f"{where}, {name}: {have.shape} vs {want.shape}"
        if want.size > 3:
            psnr = _psnr(np, have, want)
            assert psnr >= 40.0, f"{where}, {name}: PSNR {psnr:.1f} dB against PIL"
        if "gray" in name:
            assert (have[..., 0] == have[..., 1]).all() and (have[..., 1] == have[..., 2]).all()


def _policies(np, torch, Image, kinds, device):
    good = kinds["500x375 subsampling 2"]
    bad = _bad(np, Image, good)
    for name, data in bad.items():
        batch = [good, data, good]
        with pytest.raises(gpufeed.GpufeedError, match="image 1") as raised:
            gpufeed.decode_jpegs(batch, device=device)
        print(f"{device}: {name}: {raised.value}")
        if name in ("png", "cmyk", "truncated", "empty"):
            want = {"png": "PNG", "cmyk": "CMYK", "truncated": "truncated", "empty": "empty"}
            assert want[name].lower() in str(raised.value).lower(), f"{name}: {raised.value}"
        out = gpufeed.decode_jpegs(batch, device=device, on_error="skip")
        assert out[1] is None, f"{name}: skipped image not None"
        assert torch.equal(out[0].cpu(), out[2].cpu()), name
        assert out[0].shape == (375, 500, 3)
    with pytest.raises(ValueError, match="on_error"):
        gpufeed.decode_jpegs([good], device=device, on_error="ignore")
    assert gpufeed.decode_jpegs([], device=device) == []


def test_jpegs_decode_on_the_cpu_as_pil_decodes_them():
    np, torch, Image = _needs()
    kinds = _kinds(np, Image)
    got = gpufeed.decode_jpegs(list(kinds.values()))
    assert all(t.device.type == "cpu" and t.dtype == torch.uint8 for t in got)
    _check_against_pil(np, Image, kinds, got, "cpu")
    # bytes-like inputs: bytearray, memoryview, a numpy array, a uint8 tensor
    data = kinds["37x51 subsampling 0"]
    for form in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8),
                 torch.frombuffer(bytearray(data), dtype=torch.uint8)):
        again = gpufeed.decode_jpegs([form])[0]
        assert torch.equal(again, got[list(kinds).index("37x51 subsampling 0")]), type(form)


def test_bad_files_on_the_cpu_raise_naming_the_image_or_are_skipped():
    np, torch, Image = _needs()
    _policies(np, torch, Image, _kinds(np, Image), None)


def _gpu():
    np, torch, Image = _needs()
    try:
        import torchvision  # noqa: F401
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as e:
        reason = f"torchvision is not installed ({e})"
    else:
        if torch.cuda.is_available():
            return np, torch, Image
        reason = "torch sees no CUDA device"
    if REQUIRED:
        raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def test_jpegs_decode_on_the_gpu_as_torchvisions_nvjpeg_decodes_them():
    np, torch, Image = _gpu()
    from torchvision.io import decode_jpeg

    kinds = _kinds(np, Image)
    got = gpufeed.decode_jpegs(list(kinds.values()), device=0)
    assert all(t.device == torch.device("cuda:0") and t.dtype == torch.uint8 for t in got)
    # Which decoder made each (progressive JPEGs go to the CPU: nvJPEG decoded one wrongly).
    _, _, by = gpufeed._gpufeed.decode_jpegs(list(kinds.values()), 0, False)
    print("decoded by:", dict(zip(kinds, by)))
    for name, b in zip(kinds, by):
        assert (b == "cpu") == ("progressive" in name), f"{name}: {b}"
    worst, failed = {}, {}
    for (name, data), mine, b in zip(kinds.items(), got, by):
        if b == "cpu":
            continue  # not nvJPEG's: compared with PIL below
        try:
            ref = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                              device="cuda:0")
        except RuntimeError as e:  # torchvision's own refusals (run 164: some it fails on)
            failed[name] = str(e).splitlines()[0]
            continue
        ref = ref.permute(1, 2, 0)
        if ref.shape[-1] == 1:
            ref = ref.expand(-1, -1, 3)
        assert mine.shape == ref.shape, f"{name}: {tuple(mine.shape)} vs {tuple(ref.shape)}"
        diff = (mine.int() - ref.int()).abs().max().item() if mine.numel() else 0
        worst[name] = diff
    print("max |gpufeed - torchvision| per kind:", worst)
    print("torchvision failed on:", failed)
    assert len(worst) >= 12, worst
    assert all(d <= 1 for d in worst.values()), worst
    _check_against_pil(np, Image, kinds, got, "cuda:0")
    # decoded tensors are ordinary CUDA tensors: kernels queued after them see the bytes
    assert int(torch.stack([t.sum() for t in got]).sum().item()) == sum(
        int(t.cpu().numpy().astype(np.int64).sum()) for t in got)


def test_bad_files_on_the_gpu_raise_naming_the_image_or_are_skipped():
    np, torch, Image = _gpu()
    _policies(np, torch, Image, _kinds(np, Image), 0)


def test_the_crop_resize_reference_computes_what_torchs_antialiased_interpolate_does():
    """gpufeed's CPU reference of the training crops (``_gpufeed.resize_crop``, the Rust
    ``gpufeed_data::resize_crop``) against torch's ``interpolate(mode="bilinear",
    antialias=True)`` of the same crop: shrinking and enlarging, odd sizes, flipped; and
    ``random_resized_crop``'s crops inside the image, the same for the same seed/epoch/index."""
    np, torch, _ = _needs()
    import torch.nn.functional as F

    rng = np.random.default_rng(40)
    cases = [((500, 375), (37, 11, 400, 300), (224, 224)), ((97, 61), (0, 0, 97, 61), (224, 160)),
             ((33, 17), (5, 3, 20, 9), (7, 5)), ((8, 8), (0, 0, 8, 8), (8, 8)),
             ((300, 200), (299, 0, 1, 200), (13, 31))]
    for (w, h), crop, (ow, oh) in cases:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        x, y, cw, ch = crop
        region = torch.from_numpy(img[y:y + ch, x:x + cw]).permute(2, 0, 1)[None].float()
        want = F.interpolate(region, size=(oh, ow), mode="bilinear", antialias=True,
                             align_corners=False)[0].permute(1, 2, 0).numpy()
        for flip in (False, True):
            raw = gpufeed._gpufeed.resize_crop(img.tobytes(), w, h, crop, ow, oh, flip)
            got = np.frombuffer(raw, dtype="<f4").reshape(oh, ow, 3)
            ref = want[:, ::-1] if flip else want
            worst = float(np.abs(got - ref).max())
            assert worst < 0.02, f"{(w, h)} crop {crop} to {(ow, oh)}, flip {flip}: {worst}"
    with pytest.raises(gpufeed.GpufeedError, match="crop"):
        gpufeed._gpufeed.resize_crop(bytes(3 * 4 * 4), 4, 4, (2, 2, 3, 3), 2, 2)
    seen = set()
    for index in range(200):
        c = gpufeed._gpufeed.random_resized_crop(500, 375, 9, 0, index)
        assert c == gpufeed._gpufeed.random_resized_crop(500, 375, 9, 0, index)
        x, y, cw, ch = c
        assert 0 < cw and 0 < ch and x + cw <= 500 and y + ch <= 375, c
        assert 0.75 * 0.95 <= cw / ch <= 4 / 3 * 1.05 or (cw, ch) == (500, 375), c
        seen.add(c)
    assert len(seen) > 190, len(seen)


def _reference_batch(np, torch, decoded, crops, flips, height, width):
    """Each decoded image ([H, W, 3] uint8 on the GPU) cropped, resized by torch's antialiased
    bilinear interpolate, mirrored: [n, height, width, 3] float32."""
    import torch.nn.functional as F

    out = []
    for img, (x, y, w, h), flip in zip(decoded, crops, flips):
        region = img[y:y + h, x:x + w].permute(2, 0, 1)[None].float()
        r = F.interpolate(region, size=(height, width), mode="bilinear", antialias=True,
                          align_corners=False)[0].permute(1, 2, 0)
        out.append(r.flip(1) if flip else r)
    return torch.stack(out)


def test_a_training_batch_is_the_crops_torch_makes_of_the_decoded_images():
    np, torch, Image = _gpu()
    kinds = _kinds(np, Image)
    data = list(kinds.values())
    n = len(data)
    decoded = gpufeed.decode_jpegs(data, device=0)
    indices = list(range(1000, 1000 + n))
    height, width = 160, 224
    for train in (True, False):
        x, kept = gpufeed.decode_batch(data, (height, width), device=0, train=train, seed=4,
                                       epoch=2, indices=indices)
        assert kept == list(range(n))
        assert x.shape == (n, height, width, 3) and x.dtype == torch.uint8
        assert x.device == torch.device("cuda:0")
        crops, flips = [], []
        for img, index in zip(decoded, indices):
            h, w = img.shape[:2]
            if train:
                crops.append(gpufeed._gpufeed.random_resized_crop(w, h, 4, 2, index))
                flips.append(gpufeed._gpufeed.random_flip(4, 2, index))
            else:
                side = max(1, min(w, h, round(min(w, h) * 0.875)))
                crops.append((round((w - side) / 2), round((h - side) / 2), side, side))
                flips.append(False)
        if train:
            assert any(flips) and not all(flips), flips
        want = _reference_batch(np, torch, decoded, crops, flips, height, width)
        diff = (x.float() - want).abs()
        assert diff.max().item() <= 1.0, f"train={train}: {diff.max().item()}"
        assert (diff > 0.5).float().mean().item() < 0.01, f"train={train}"
        # the same seed, epoch and indices again: the same batch; another epoch: another
        again, _ = gpufeed.decode_batch(data, (height, width), device=0, train=train, seed=4,
                                        epoch=2, indices=indices)
        assert torch.equal(again, x)
        if train:
            other, _ = gpufeed.decode_batch(data, (height, width), device=0, seed=4, epoch=3,
                                            indices=indices)
            assert not torch.equal(other, x)
        # normalized float32 NCHW, and float16 cast from it
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        f, _ = gpufeed.decode_batch(data, (height, width), device=0, train=train, seed=4,
                                    epoch=2, indices=indices, dtype=torch.float32)
        assert f.shape == (n, 3, height, width) and f.dtype == torch.float32
        m = torch.tensor(mean, device="cuda:0")[None, :, None, None]
        s = torch.tensor(std, device="cuda:0")[None, :, None, None]
        ref = (want.permute(0, 3, 1, 2) / 255 - m) / s
        assert (f - ref).abs().max().item() < 1e-3
        h16, _ = gpufeed.decode_batch(data, (height, width), device=0, train=train, seed=4,
                                      epoch=2, indices=indices, dtype=torch.float16)
        assert h16.dtype == torch.float16 and torch.equal(h16, f.half())
    # bad files: skipped and left out of the batch, or raised naming them
    bad = data[:3] + [b"\x89PNG\r\n\x1a\n", data[0][:100]] + data[3:5]
    x, kept = gpufeed.decode_batch(bad, 64, device=0, on_error="skip")
    assert kept == [0, 1, 2, 5, 6] and x.shape[0] == 5
    with pytest.raises(gpufeed.GpufeedError, match="image 3"):
        gpufeed.decode_batch(bad, 64, device=0)
    empty, kept = gpufeed.decode_batch([], 64, device=0)
    assert empty.shape == (0, 64, 64, 3) and kept == []


def test_decode_batch_without_a_gpu_says_so():
    np, torch, _ = _needs()
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_a_training_batch_... covers decode_batch")
    with pytest.raises(ValueError, match="decode_jpegs decodes on the CPU"):
        gpufeed.decode_batch([b""], 224, device="cpu")
    with pytest.raises(gpufeed.NoGpuError):
        gpufeed.decode_batch([b"\xff\xd8"], 224, device=0)
