#!/usr/bin/env python3
"""JPEG decoding throughput (issue 40, before the loader's stage exists), images/s over batches
of 256 whose bytes are in memory (no file reads): decode only, ``gpufeed.decode_jpegs`` on a GPU
and on the CPU against torchvision's ``decode_jpeg(list, device="cuda")`` (nvJPEG, batched) and
PIL; then a training batch, ``gpufeed.decode_batch(224)`` (decode, RandomResizedCrop, flip,
uint8 NHWC) against torchvision's decode plus ``resized_crop(antialias=True)`` and a flip per
image, stacked. The JPEGs are made here:
photo-like images of ImageNet-like sizes (sides 250-500 px), quality 90, 4:2:0, by PIL.
Not run by the bench yet (docs/benchmarks.md).

Usage: images.py [N]   (N images, 8192 by default) -> one JSON object on stdout
"""
import io
import json
import sys
import time


def make(n):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(40)
    out = []
    for i in range(n):
        w, h = int(rng.integers(250, 501)), int(rng.integers(250, 501))
        x = np.linspace(0, 255, w)[None, :, None]
        y = np.linspace(0, 255, h)[:, None, None]
        base = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2 + 0 * x], axis=2)
        img = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def rate(fn, batches, reps=3):
    fn(batches[0])  # warm-up (handles, allocators)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        for b in batches:
            fn(b)
        best.append(sum(len(b) for b in batches) / (time.perf_counter() - t))
    return sorted(best)


def main(n):
    import torch
    from PIL import Image
    from torchvision.io import decode_jpeg

    import gpufeed

    data = make(n)
    batches = [data[i:i + 256] for i in range(0, n, 256)]
    tensors = [[torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in b] for b in batches]
    torch.zeros(1, device="cuda:0")
    rows = {}

    def ours(b):
        out = gpufeed.decode_jpegs(b, device=0)
        torch.cuda.synchronize()
        return out

    def theirs(b):
        out = decode_jpeg(b, device="cuda:0")
        torch.cuda.synchronize()
        return out

    rows["gpufeed.decode_jpegs(device=0)"] = rate(ours, batches)
    rows["torchvision decode_jpeg(list, device='cuda')"] = rate(theirs, tensors)

    # A training batch: decode, RandomResizedCrop(224), flip, [256, 224, 224, 3] uint8.
    epoch = [0]

    def ours_train(b):
        epoch[0] += 1
        out, _ = gpufeed.decode_batch(b, 224, device=0, seed=1, epoch=epoch[0])
        torch.cuda.synchronize()
        return out

    from torchvision import transforms as T
    from torchvision.transforms.v2 import functional as F

    def theirs_train(b):
        imgs = decode_jpeg(b, device="cuda:0")
        out = []
        for img in imgs:
            top, left, h, w = T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
            r = F.resized_crop(img, top, left, h, w, [224, 224], antialias=True)
            out.append(F.horizontal_flip(r) if torch.rand(()) < 0.5 else r)
        batch = torch.stack(out).permute(0, 2, 3, 1).contiguous()
        torch.cuda.synchronize()
        return batch

    rows["gpufeed.decode_batch(224, train) uint8 NHWC"] = rate(ours_train, batches)
    rows["torchvision decode_jpeg + resized_crop(antialias) + flip + stack"] = rate(
        theirs_train, tensors)
    small = batches[:4]
    rows["gpufeed.decode_jpegs() on the CPU"] = rate(lambda b: gpufeed.decode_jpegs(b), small, 1)
    rows["PIL, one thread"] = rate(
        lambda b: [Image.open(io.BytesIO(d)).convert("RGB").load() for d in b], small[:1], 1)
    print(json.dumps({"images": n, "mean_kib": sum(map(len, data)) / n / 1024,
                      "images_per_s": rows}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
