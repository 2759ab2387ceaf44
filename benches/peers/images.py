#!/usr/bin/env python3
"""Bench table 15 ("images", issue 40): training batches of JPEGs decoded on the GPU.

A folder of JPEGs in torchvision ``ImageFolder``'s layout (``root/<class>/<file>.jpg``) made
here (``--make``), then, with the page cache warm, decoded 224x224 training batches of 256
(RandomResizedCrop, random horizontal flip) by each pipeline, in the same run (``--rows``):

- ``gpufeed_uint8``: ``gpufeed.ImageLoader(root, 256, 224, train=True, device=0)``, uint8
  ``[B, 224, 224, 3]`` on ``cuda:0``; ``gpufeed_float32``: the same with
  ``dtype=torch.float32`` (normalized ``[B, 3, 224, 224]``); ``gpufeed_fresh``: the first epoch
  of a new process, the loader made inside the clock (torch's CUDA context made before it and
  timed apart); ``gpufeed_cpu``: ``device=None`` (decoded on the CPU into host tensors).
- ``torchvision``: the user's GPU pipeline: per batch ``torchvision.io.read_file`` of each file,
  ``decode_jpeg(list, device="cuda:0")``, per image ``RandomResizedCrop.get_params`` +
  ``v2.functional.resized_crop(antialias=True)`` + a random ``horizontal_flip``, ``torch.stack``;
  the labels to the GPU.
- ``dataloader_8`` / ``dataloader_all``: ``torch.utils.data.DataLoader`` over
  ``torchvision.datasets.ImageFolder`` with PIL transforms ``RandomResizedCrop(224)``,
  ``RandomHorizontalFlip()``, ``PILToTensor()`` (uint8), batches of 256, ``shuffle=True``,
  ``pin_memory=True``, persistent workers (8, and ``os.cpu_count()``), each batch
  ``.to("cuda:0", non_blocking=True)``.
- ``dataloader_8_totensor``: ``dataloader_8`` with ``ToTensor()`` for ``PILToTensor()``: float32
  in [0, 1], the peer exactly as issue 40's table wrote it.
- ``in_memory``: the decode alone and the training batch from bytes already in memory (the
  first 4096 files): ``gpufeed.decode_jpegs`` / ``gpufeed.decode_batch`` against torchvision's
  ``decode_jpeg`` (+ crops), on the CPU, and PIL on one thread.

Each row runs in a process of its own (nothing left from another row: threads, pinned memory,
the allocator's cache). A row: the first ``WARM_BATCHES`` batches of an epoch not timed (the
workers, decoders and memory made; a whole epoch for the gpufeed GPU rows), then ``--reps``
whole epochs (fewer for the slow ones: see ``REPS_CAP``), each giving images/s and the CPU
cores busy (user + system CPU seconds of the process, its threads and its live descendants from ``/proc``, over the epoch's
wall seconds: the DataLoader's workers count), and the GPU busy over the timed epochs (the mean
``utilization.gpu`` of ``nvidia-smi -lms 100`` running meanwhile; ``None`` with the reason where
nvidia-smi is missing).

Usage:
  images.py --dir DIR --make N [--classes 100] [--seed 40] [--like imagenet|issue40]   make
      the folder (once: reused while its manifest matches) -> the manifest as JSON on stdout
  images.py --dir DIR --rows all|ID,ID... [--reps 5] [--batch 256] [--size 224]
      -> {"dataset": ..., "env": ..., "rows": {ID: {...} or {"error": ...}}} on stdout
  images.py --dir DIR --row ID ...     (internal) one row in this process
  images.py [N]    the in-memory rows alone on N images made in memory (8192 by default) by
      the folder's generator (GPU runs 164-169 ran an earlier one: 250-500 px sides, less
      noise, 49 KiB per JPEG on average)
Progress goes to stderr. A row that cannot run (no GPU, no torchvision, a gpufeed without
``ImageLoader``) reports {"error": why}; the script itself does not fail for it.
"""
import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROWS = ["gpufeed_uint8", "gpufeed_float32", "gpufeed_fresh", "gpufeed_cpu", "torchvision",
        "dataloader_8", "dataloader_all", "dataloader_8_totensor", "in_memory"]
# The most timed epochs (or fresh processes) of the slow rows, so that the table fits in a few
# minutes on the GPU machine.
REPS_CAP = {"gpufeed_fresh": 3, "gpufeed_cpu": 2, "torchvision": 3, "dataloader_8": 3,
            "dataloader_8_totensor": 3, "dataloader_all": 3}
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
# The data sets (``--like``): each image's size, and its noise (luma sigma) drawn in a range.
# "imagenet": ImageNet-like sizes (below) at about 0.8 bytes per pixel at quality 90, ImageNet's
# ~110 KB for its ~400x350 mean. "issue40": the set issue 40's table of peers was measured on,
# "8,192 JPEGs of about 500x375, 68 KiB each, quality 90, 4:2:0, made with PIL": every image
# 500x375, noise drawn so that the mean is 68 KiB (68.1-68.3 KiB over 80 images here).
LIKE = {"imagenet": (20.0, 58.0), "issue40": (6.5, 12.0)}


START = time.perf_counter()
TAG = "images.py"
# The untimed warm-up: the first batches of epoch 0 (workers, decoders, pinned and device memory
# made), not a whole epoch: the slow peers' epochs take several seconds each. (benches/src/
# images.rs says this number in the table's text.)
WARM_BATCHES = 12


def log(msg):
    print(f"{TAG} [{time.perf_counter() - START:5.1f} s]: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The data set


def _dims(rng):
    """ImageNet-like sizes: the long side mostly 280-480 px with a tail to 1600, 4:3 most often,
    three in four landscape (mean about 410x365)."""
    u = rng.random()
    if u < 0.85:
        long = int(rng.integers(280, 481))
    elif u < 0.97:
        long = int(rng.integers(480, 801))
    else:
        long = int(rng.integers(800, 1601))
    a = rng.random()
    aspect = 4 / 3 if a < 0.5 else 3 / 2 if a < 0.7 else 1.0 if a < 0.8 else float(
        rng.uniform(1.0, 2.0))
    short = max(32, round(long / aspect))
    return (long, short) if rng.random() < 0.75 else (short, long)


def _jpeg(seed, i, like="imagenet"):
    """Image `i` of the set `like` (``LIKE``): a smooth random colour field (a 4x3 grid of
    colours, bicubic) with luma noise and a little chroma noise, quality 90, 4:2:0, by PIL;
    (bytes, width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    w, h = _dims(rng) if like == "imagenet" else (500, 375)
    grid = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(grid).resize((w, h), Image.BICUBIC), dtype=np.float32)
    sigma = float(rng.uniform(*LIKE[like]))
    luma = rng.standard_normal((h, w, 1), dtype=np.float32) * sigma
    chroma = rng.standard_normal((h, w, 3), dtype=np.float32) * (sigma / 4)
    pixels = np.clip(base + luma + chroma, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, subsampling=2)
    return buf.getvalue(), w, h


def _class_dir(root, c):
    return os.path.join(root, f"class-{c:03d}")


def _write_some(job):
    """Writes images `first..last` of the folder; their (bytes, width sum, height sum)."""
    root, seed, classes, first, last, like = job
    total = ws = hs = 0
    for i in range(first, last):
        data, w, h = _jpeg(seed, i, like)
        path = os.path.join(_class_dir(root, i % classes), f"{i:07d}.jpg")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        total += len(data)
        ws += w
        hs += h
    return total, ws, hs


def ensure_dataset(root, n, classes, seed, like="imagenet"):
    """The folder's manifest, making the folder first unless a manifest of the same images is
    there (then it is reused as it is)."""
    want = {"version": MANIFEST_VERSION, "images": n, "classes": classes, "seed": seed,
            "quality": 90, "subsampling": "4:2:0", "noise": list(LIKE[like]), "like": like}
    path = os.path.join(root, MANIFEST)
    try:
        with open(path) as f:
            have = json.load(f)
        if all(have.get(k) == v for k, v in want.items()):
            have["made_seconds"] = None
            have["dir"] = root
            return have
    except (OSError, ValueError):
        pass
    import multiprocessing

    try:
        os.remove(path)
    except OSError:
        pass
    classes = max(1, min(classes, n))
    # Another set's leftovers (more classes, more files) would join this one: gone first.
    for name in os.listdir(root):
        if name.startswith("class-"):
            shutil.rmtree(os.path.join(root, name))
    for c in range(classes):
        os.makedirs(_class_dir(root, c), exist_ok=True)
    workers = os.cpu_count() or 1
    step = max(1, min(256, n // (workers * 4) or 1))
    jobs = [(root, seed, classes, i, min(n, i + step), like) for i in range(0, n, step)]
    log(f"making {n} JPEGs in {classes} classes under {root} ({workers} processes)")
    t = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_write_some, jobs, chunksize=1)
    made = time.perf_counter() - t
    total = sum(p[0] for p in parts)
    manifest = dict(want, bytes=total, mean_kib=total / n / 1024,
                    mean_width=sum(p[1] for p in parts) / n,
                    mean_height=sum(p[2] for p in parts) / n)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f)
    os.replace(path + ".tmp", path)
    log(f"made {n} JPEGs ({total / 1e9:.2f} GB, {manifest['mean_kib']:.0f} KiB mean) in "
        f"{made:.1f} s")
    return dict(manifest, made_seconds=made, dir=root)


def listing(root):
    """(paths, labels) in ImageFolder's order: class folders sorted, files sorted."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    paths, labels = [], []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(root, c))):
            if name.lower().endswith((".jpg", ".jpeg")):
                paths.append(os.path.join(root, c, name))
                labels.append(label)
    return paths, labels


def warm(paths):
    """Every file read once (the page cache warm)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(p):
        with open(p, "rb") as f:
            return len(f.read())

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(read, paths))


# ---------------------------------------------------------------------------------------------
# What a row is measured with


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid):
    """(parent pid, user + system ticks of the process and of its waited-for children)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime fields 14-17.
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def cpu_seconds(exclude=()):
    """User + system CPU seconds of this process (every thread), of the children it waited
    for, and of its live descendants (theirs likewise), except the processes in `exclude`
    (the nvidia-smi sampler) and theirs."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                procs[int(name)] = _proc_stat(name)
            except (OSError, ValueError, IndexError):
                pass
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    ticks, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        ticks += procs.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, []))
    return ticks / CLK_TCK


class GpuBusy:
    """`nvidia-smi --query-gpu=utilization.gpu -lms 100` in the background: timestamped
    samples of the share of time a kernel ran on the GPU."""

    def __init__(self, gpu):
        self.samples = []
        self.error = None
        self.proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi is not on the PATH"
            return
        try:
            self.proc = subprocess.Popen(
                [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i",
                 str(gpu), "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.error = f"cannot start nvidia-smi: {e}"
            return
        self.first = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.first.wait(10):
            self.error = "nvidia-smi gave no sample in 10 s"

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:
                self.error = f"nvidia-smi: {line.strip()}"
            self.first.set()
        if not self.samples and self.error is None:
            self.error = f"nvidia-smi: {self.proc.stderr.read().strip() or 'no output'}"
        self.first.set()

    def pid(self):
        return self.proc.pid if self.proc else None

    def stop(self):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def mean(self, windows):
        """The mean of the samples taken inside `windows` ((start, end) pairs); (mean or None,
        samples, why None)."""
        got = [v for t, v in self.samples if any(a < t <= b for a, b in windows)]
        if got:
            return sum(got) / len(got), len(got), None
        return None, 0, self.error or "no nvidia-smi sample fell inside the timed epochs"


def smi_target():
    """What `nvidia-smi -i` calls torch's cuda:0: its PCI bus id where torch says it, else the
    first entry of CUDA_VISIBLE_DEVICES, else 0."""
    import torch

    p = torch.cuda.get_device_properties(0)
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first.isdigit() else "0"


def timed_epochs(run_epoch, reps, gpu, warm_batches=WARM_BATCHES, prepare=None):
    """`warm_batches` batches of epoch 0 not timed (`run_epoch(0, warm_batches)`: the epoch
    left there; `None`: all of it), then `reps` whole epochs timed, each after `prepare()`
    (outside the clock): images/s and cores busy per epoch, the GPU's mean busy share over
    them (when `gpu`)."""
    run_epoch(0, warm_batches)
    smi = GpuBusy(smi_target()) if gpu else None
    exclude = {smi.pid()} if smi and smi.pid() else set()
    rates, cores, windows = [], [], []
    try:
        for e in range(1, reps + 1):
            if prepare:
                prepare()
            c0 = cpu_seconds(exclude)
            t0 = time.perf_counter()
            n = run_epoch(e, None)
            t1 = time.perf_counter()
            c1 = cpu_seconds(exclude)
            rates.append(n / (t1 - t0))
            cores.append((c1 - c0) / (t1 - t0))
            windows.append((t0, t1))
            log(f"epoch {e}: {n} images, {n / (t1 - t0):.0f} images/s, "
                f"{(c1 - c0) / (t1 - t0):.1f} cores busy")
    finally:
        if smi:
            smi.stop()
    out = {"images_per_s": rates, "cores_busy": cores, "images_per_epoch": n}
    if smi is None:
        out["gpu_busy_why"] = "this row does not use the GPU"
    else:
        busy, count, why = smi.mean(windows)
        out.update(gpu_busy_pct=busy, gpu_busy_samples=count)
        if busy is None:
            out["gpu_busy_why"] = why
    return out


def need_cuda():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    torch.zeros(1, device="cuda:0")


def need_image_loader():
    import gpufeed

    if not hasattr(gpufeed, "ImageLoader"):
        raise RuntimeError(
            f"this gpufeed ({getattr(gpufeed, '__version__', '?')} at "
            f"{os.path.dirname(gpufeed.__file__)}) has no ImageLoader: rebuild the package")
    return gpufeed


def describe(t):
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} {t.device}"


# ---------------------------------------------------------------------------------------------
# The rows


def row_gpufeed(args, dtype_name, device):
    import torch

    gpufeed = need_image_loader()
    if device is not None:
        need_cuda()
    dtype = getattr(torch, dtype_name) if dtype_name else None
    loader = gpufeed.ImageLoader(args.dir, batch_size=args.batch, size=args.size, train=True,
                                 seed=1, device=device, dtype=dtype)
    first = {}

    def epoch(e, batches):
        n = 0
        for b, (images, labels) in enumerate(loader.epoch(e)):
            if not first:
                first.update(batch=describe(images), labels=describe(labels))
            n += images.shape[0]
            if b + 1 == batches:
                break  # the epoch's iterator dropped: the loader takes the next one
        if device is not None:
            torch.cuda.synchronize()
        return n

    # A GPU epoch takes about a second: the warm-up is a whole one (nothing of an epoch left
    # behind to overlap the first timed one).
    out = timed_epochs(epoch, args.reps, device is not None,
                       warm_batches=None if device is not None else WARM_BATCHES)
    out.update(first, batches_per_epoch=len(loader), cpu_only=loader.cpu_only)
    return out


def row_gpufeed_fresh(args):
    """In a new process: torch's CUDA context (timed apart), then the loader made and its first
    epoch iterated inside the clock."""
    import torch

    t = time.perf_counter()
    gpufeed = need_image_loader()
    need_cuda()
    torch.cuda.synchronize()
    context = time.perf_counter() - t
    smi = GpuBusy(smi_target())
    exclude = {smi.pid()} if smi.pid() else set()
    try:
        c0 = cpu_seconds(exclude)
        t0 = time.perf_counter()
        loader = gpufeed.ImageLoader(args.dir, batch_size=args.batch, size=args.size,
                                     train=True, seed=1, device=0)
        n, first_batch = 0, None
        for images, labels in loader.epoch(0):
            if first_batch is None:
                torch.cuda.synchronize()
                first_batch = time.perf_counter() - t0
            n += images.shape[0]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        c1 = cpu_seconds(exclude)
    finally:
        smi.stop()
    busy, count, why = smi.mean([(t0, t1)])
    out = {"images_per_s": [n / (t1 - t0)], "cores_busy": [(c1 - c0) / (t1 - t0)],
           "first_batch_s": [first_batch], "context_s": [context], "images_per_epoch": n,
           "gpu_busy_pct": busy, "gpu_busy_samples": count}
    if busy is None:
        out["gpu_busy_why"] = why
    return out


def row_torchvision(args):
    import torch
    from torchvision import transforms as T
    from torchvision.io import decode_jpeg, read_file
    from torchvision.transforms.v2 import functional as F

    need_cuda()
    paths, labels = listing(args.dir)
    labels = torch.tensor(labels, dtype=torch.int64)
    generator = torch.Generator().manual_seed(1)
    first = {}

    def epoch(e, batches):
        order = torch.randperm(len(paths), generator=generator)
        n = 0
        stop = len(paths) if batches is None else min(len(paths), batches * args.batch)
        for i in range(0, stop, args.batch):
            idx = order[i:i + args.batch]
            data = [read_file(paths[j]) for j in idx.tolist()]
            decoded = decode_jpeg(data, device="cuda:0")
            crops = []
            for img in decoded:
                top, left, h, w = T.RandomResizedCrop.get_params(img, [0.08, 1.0],
                                                                 [3 / 4, 4 / 3])
                r = F.resized_crop(img, top, left, h, w, [args.size, args.size],
                                   antialias=True)
                crops.append(F.horizontal_flip(r) if torch.rand(()) < 0.5 else r)
            images = torch.stack(crops)
            batch_labels = labels[idx].to("cuda:0", non_blocking=True)
            if not first:
                first.update(batch=describe(images), labels=describe(batch_labels))
            n += images.shape[0]
        torch.cuda.synchronize()
        return n

    out = timed_epochs(epoch, args.reps, True)
    out.update(first)
    return out


def row_dataloader(args, workers, to_tensor=False):
    import torch
    from torchvision import datasets
    from torchvision import transforms as T

    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda:0")
    transform = T.Compose([T.RandomResizedCrop(args.size), T.RandomHorizontalFlip(),
                           T.ToTensor() if to_tensor else T.PILToTensor()])
    folder = datasets.ImageFolder(args.dir, transform=transform)
    loader = torch.utils.data.DataLoader(
        folder, batch_size=args.batch, shuffle=True, num_workers=workers, pin_memory=cuda,
        persistent_workers=True, generator=torch.Generator().manual_seed(1))
    first = {}

    started = []

    def prepare():
        # The iterator of the next epoch, before the clock: with persistent workers, iter()
        # first drains what they still do for the epoch the warm-up left.
        started.append(iter(loader))

    def epoch(e, batches):
        n = 0
        for b, (images, labels) in enumerate(started.pop() if started else loader):
            if cuda:
                images = images.to("cuda:0", non_blocking=True)
                labels = labels.to("cuda:0", non_blocking=True)
            if not first:
                first.update(batch=describe(images), labels=describe(labels))
            n += images.shape[0]
            if b + 1 == batches:
                # The persistent workers' rest of this epoch is dropped when the next starts.
                break
        if cuda:
            torch.cuda.synchronize()
        return n

    out = timed_epochs(epoch, args.reps, cuda, prepare=prepare)
    out.update(first, workers=workers)
    if not cuda:
        out["note"] = "no CUDA device: the batches stay in host memory (not pinned)"
    return out


def _rate(fn, batches, reps=3):
    """images/s of `fn` over `batches`, `reps` passes after one batch of warm-up."""
    fn(batches[0])
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for b in batches:
            fn(b)
        out.append(sum(len(b) for b in batches) / (time.perf_counter() - t))
    return sorted(out)


def _attempt(rows, name, make):
    try:
        rows[name] = make()
    except Exception as e:  # a row that cannot run here says why; the others go on
        rows[name] = {"error": f"{type(e).__name__}: {e}"}


def in_memory_rows(data):
    """The decode alone and the training batch, the JPEGs' bytes in memory (no file reads):
    {name: [images/s of each pass]} or {name: {"error": ...}}."""
    import torch
    from PIL import Image

    rows = {}
    batches = [data[i:i + 256] for i in range(0, len(data), 256)]
    tensors = [[torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in b] for b in batches]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda:0")

    def gpu_only(fn):
        def run():
            if not cuda:
                raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
            return fn()
        return run

    try:
        import gpufeed
    except Exception as e:
        gpufeed = None
        why = f"{type(e).__name__}: {e}"

    def need_gpufeed(fn):
        def run():
            if gpufeed is None:
                raise RuntimeError(f"gpufeed does not import: {why}")
            return fn()
        return run

    def ours(b):
        out = gpufeed.decode_jpegs(b, device=0)
        torch.cuda.synchronize()
        return out

    def theirs(b):
        from torchvision.io import decode_jpeg

        out = decode_jpeg(b, device="cuda:0")
        torch.cuda.synchronize()
        return out

    _attempt(rows, "gpufeed.decode_jpegs(device=0)",
             gpu_only(need_gpufeed(lambda: _rate(ours, batches))))
    _attempt(rows, "torchvision decode_jpeg(list, device='cuda')",
             gpu_only(lambda: _rate(theirs, tensors)))

    # A training batch: decode, RandomResizedCrop(224), flip, [256, 224, 224, 3] uint8.
    epoch = [0]

    def ours_train(b):
        epoch[0] += 1
        out, _ = gpufeed.decode_batch(b, 224, device=0, seed=1, epoch=epoch[0])
        torch.cuda.synchronize()
        return out

    def theirs_train(b):
        from torchvision import transforms as T
        from torchvision.io import decode_jpeg
        from torchvision.transforms.v2 import functional as F

        imgs = decode_jpeg(b, device="cuda:0")
        out = []
        for img in imgs:
            top, left, h, w = T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
            r = F.resized_crop(img, top, left, h, w, [224, 224], antialias=True)
            out.append(F.horizontal_flip(r) if torch.rand(()) < 0.5 else r)
        batch = torch.stack(out).permute(0, 2, 3, 1).contiguous()
        torch.cuda.synchronize()
        return batch

    _attempt(rows, "gpufeed.decode_batch(224, train) uint8 NHWC",
             gpu_only(need_gpufeed(lambda: _rate(ours_train, batches))))
    _attempt(rows, "torchvision decode_jpeg + resized_crop(antialias) + flip + stack",
             gpu_only(lambda: _rate(theirs_train, tensors)))
    small = batches[:4]
    _attempt(rows, "gpufeed.decode_jpegs() on the CPU",
             need_gpufeed(lambda: _rate(lambda b: gpufeed.decode_jpegs(b), small, 1)))
    _attempt(rows, "PIL, one thread", lambda: _rate(
        lambda b: [Image.open(io.BytesIO(d)).convert("RGB").load() for d in b], small[:1], 1))
    return rows


def row_in_memory(args):
    paths, _ = listing(args.dir)
    data = []
    for p in paths[:4096]:
        with open(p, "rb") as f:
            data.append(f.read())
    rows = in_memory_rows(data)
    return {"images": len(data), "mean_kib": sum(map(len, data)) / len(data) / 1024,
            "images_per_s": rows, "order": list(rows)}


def run_row(args):
    """One row in this process; its JSON on stdout ({"error": why} where it cannot run)."""
    global TAG
    TAG = f"images.py {args.row}"
    try:
        out = measure_row(args)
    except Exception as e:
        if not isinstance(e, (RuntimeError, ImportError)):
            import traceback

            traceback.print_exc()
        log(f"not measured: {type(e).__name__}: {e}")
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


def measure_row(args):
    row = args.row
    if row == "gpufeed_uint8":
        out = row_gpufeed(args, None, 0)
    elif row == "gpufeed_float32":
        out = row_gpufeed(args, "float32", 0)
    elif row == "gpufeed_cpu":
        out = row_gpufeed(args, None, None)
    elif row == "gpufeed_fresh":
        out = row_gpufeed_fresh(args)
    elif row == "torchvision":
        out = row_torchvision(args)
    elif row == "dataloader_8":
        out = row_dataloader(args, 8)
    elif row == "dataloader_8_totensor":
        out = row_dataloader(args, 8, to_tensor=True)
    elif row == "dataloader_all":
        out = row_dataloader(args, os.cpu_count() or 1)
    elif row == "in_memory":
        out = row_in_memory(args)
    else:
        raise SystemExit(f"unknown row {row!r}: one of {', '.join(ROWS)}")
    return out


def probe():
    """What this machine has for the rows (run in a process of its own)."""
    env = {"cpus": os.cpu_count(), "python": sys.version.split()[0],
           "nvidia_smi": shutil.which("nvidia-smi") is not None}
    for name in ("torch", "torchvision", "PIL", "gpufeed"):
        try:
            mod = __import__(name)
            env[name] = getattr(mod, "__version__", "?")
        except Exception as e:
            env[name] = None
            env[f"{name}_error"] = f"{type(e).__name__}: {e}"
    if env.get("gpufeed") is not None:
        import gpufeed

        env["image_loader"] = hasattr(gpufeed, "ImageLoader")
    if env.get("torch") is not None:
        import torch

        env["cuda"] = torch.cuda.is_available()
        if env["cuda"]:
            env["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(env))


def child(args, extra, timeout):
    """This script with `extra` in a new process: its JSON, or {"error": why}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--reps",
           str(args.reps), "--batch", str(args.batch), "--size", str(args.size)] + extra
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        sys.stderr.write(e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "")
        return {"error": f"did not finish in {timeout} s"}
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exited with status {done.returncode}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"no JSON in its output: {done.stdout[-200:]!r}"}


def run_rows(args):
    wanted = ROWS if args.rows == "all" else [r for r in args.rows.split(",") if r]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    try:
        with open(os.path.join(args.dir, MANIFEST)) as f:
            dataset = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"no data set at {args.dir} ({e}): make it with --make N first")
    paths, _ = listing(args.dir)
    t = time.perf_counter()
    read = warm(paths)
    log(f"page cache warmed: {len(paths)} files, {read / 1e9:.2f} GB in "
        f"{time.perf_counter() - t:.1f} s")
    dataset.update(dir=args.dir, files=len(paths), bytes_read=read)
    env = child(args, ["--probe"], 120)
    out = {"dataset": dataset, "env": env, "batch": args.batch, "size": args.size,
           "reps": args.reps, "rows": {}}
    for row in wanted:
        reps = min(args.reps, REPS_CAP.get(row, args.reps))
        log(f"row {row} ({reps} timed epochs or processes)")
        t = time.perf_counter()
        if row == "dataloader_all" and (os.cpu_count() or 1) == 8:
            result = {"error": "os.cpu_count() is 8 here: the same as dataloader_8"}
        elif row == "gpufeed_fresh":
            runs = []
            for _ in range(reps):
                runs.append(child(args, ["--row", row], args.row_timeout))
                if "error" in runs[-1]:
                    break
            result = runs[-1] if "error" in runs[-1] else merge_fresh(runs)
        else:
            sub = argparse.Namespace(**vars(args))
            sub.reps = reps
            result = child(sub, ["--row", row], args.row_timeout)
        result["seconds"] = time.perf_counter() - t
        out["rows"][row] = result
    print(json.dumps(out))


def merge_fresh(runs):
    """The fresh-process runs as one row: their lists joined, the GPU busy averaged."""
    out = {}
    for key in ("images_per_s", "cores_busy", "first_batch_s", "context_s"):
        out[key] = [x for r in runs for x in r[key]]
    out["images_per_epoch"] = runs[0]["images_per_epoch"]
    busy = [r["gpu_busy_pct"] for r in runs if r.get("gpu_busy_pct") is not None]
    out["gpu_busy_pct"] = sum(busy) / len(busy) if busy else None
    out["gpu_busy_samples"] = sum(r.get("gpu_busy_samples", 0) for r in runs)
    if not busy:
        out["gpu_busy_why"] = next((r["gpu_busy_why"] for r in runs if "gpu_busy_why" in r),
                                   "no sample")
    return out


def make_in_memory(n):
    """`n` JPEGs made in memory (the in-memory rows alone, `images.py N`)."""
    return [_jpeg(40, i)[0] for i in range(n)]


def main():
    if len(sys.argv) == 2 and sys.argv[1].isdigit() or len(sys.argv) == 1:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
        data = make_in_memory(n)
        print(json.dumps({"images": n, "mean_kib": sum(map(len, data)) / n / 1024,
                          "images_per_s": in_memory_rows(data)}))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="the image folder (made by --make)")
    p.add_argument("--make", type=int, help="make (or reuse) a folder of this many JPEGs")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--seed", type=int, default=40)
    p.add_argument("--like", choices=sorted(LIKE), default="imagenet",
                   help="the data set --make makes: ImageNet-like sizes and bytes (default), "
                        "or issue 40's (500x375, 68 KiB mean)")
    p.add_argument("--rows", help=f"'all' or a comma-separated list of: {', '.join(ROWS)}")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--row-timeout", type=int, default=240,
                   help="seconds a row may take before it is reported as not finished")
    args = p.parse_args()
    args.dir = os.path.abspath(args.dir)
    if args.probe:
        return probe()
    if args.row:
        return run_row(args)
    if args.make is not None:
        os.makedirs(args.dir, exist_ok=True)
        manifest = ensure_dataset(args.dir, args.make, args.classes, args.seed, args.like)
        if not args.rows:
            print(json.dumps(manifest))
            return
    if args.rows:
        return run_rows(args)
    p.error("give --make N, --rows ..., or both")


if __name__ == "__main__":
    main()
