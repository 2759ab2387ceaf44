#!/usr/bin/env python3
"""The peers of gpufeed's GPU bench, measured in the same run on the same files.

Usage: peers.py FILE SAFETENSORS REPS  -> one JSON object on stdout: name -> list of GB/s
       (loads, and saves of the checkpoint's GPU tensors back to files).
       peers.py --one-shot SAFETENSORS   -> (internal) one fresh-process load, timed.
       peers.py --one-shot-gpufeed SAFETENSORS -> (internal) the same with gpufeed's Python
       package.
       peers.py --one-shot-safe-open[-gpufeed] SAFETENSORS -> (internal) the same, tensor by
       tensor through safetensors' (gpufeed's) `safe_open`, the open included.
       peers.py --python-checkpoints FEW MANY REPS -> table 10: the Python package against
       safetensors.torch on a checkpoint of 16 tensors and the same bytes in 10,000 tensors.
       peers.py --records FILE RECORD BATCH REPS -> PyTorch's DataLoader and gpufeed's Python
       BatchLoader on the same records of FILE.
       peers.py --image-folder ROOT REPS -> PyTorch's DataLoader over an image folder (raw file
       bytes, batches of 256 shuffled, num_workers=8, pin_memory=True, each batch to the GPU):
       {name: list of GB/s per epoch}.
       peers.py --multi SAFETENSORS N REPS -> table 11's peers on N GPUs, one process each
       (torch.multiprocessing, NCCL): safetensors.torch load_file on every rank, and load_file on
       rank 0 then torch.distributed.broadcast of every tensor; {name: list of seconds until
       every rank holds the checkpoint}.
Every peer is optional: one that cannot run reports {"error": "..."} instead.
kvikio and fastsafetensors come from wheels (BENCH.md); torch, numpy, cupy and safetensors are
on the GPU machine's image.
"""
import json
import os
import sys
import time


def attempt(results, name, make):
    """`results[name] = make()`, or the error where it cannot run (the others go on)."""
    try:
        results[name] = make()
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {e}"}


def timed(fn, nbytes, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(nbytes / (time.perf_counter() - t) / 1e9)
    return out


def one_shot(st_path, load_file=None):
    """A fresh process (imports done): the CUDA context, then `load_file` (safetensors.torch's
    by default) to the GPU."""
    import torch

    if load_file is None:
        from safetensors.torch import load_file

    t0 = time.perf_counter()
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    tensors = load_file(st_path, device="cuda:0")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({"bytes": nbytes, "context_s": t1 - t0, "load_s": t2 - t1}))


def image_folder(root, reps):
    """Table 9's peer: torch.utils.data.DataLoader over the same folder, raw bytes."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    samples = []
    for label, c in enumerate(classes):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            samples += [(os.path.join(dirpath, n), label) for n in sorted(names)]

    class Raw(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            path, label = samples[i]
            with open(path, "rb") as f:
                return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), label

    def collate(items):
        sizes = torch.tensor([0] + [len(t) for t, _ in items]).cumsum(0)
        return torch.cat([t for t, _ in items]), sizes, torch.tensor([l for _, l in items])

    loader = DataLoader(Raw(), batch_size=256, shuffle=True, num_workers=8, pin_memory=True,
                        collate_fn=collate, persistent_workers=True, prefetch_factor=4)
    total = sum(os.path.getsize(p) for p, _ in samples)
    out = {}
    name = "torch DataLoader (num_workers=8, pin_memory=True, raw bytes, batches of 256 to the GPU)"
    try:
        runs = []
        for epoch in range(reps + 1):  # the first epoch starts the workers: not timed
            t = time.perf_counter()
            for data, offsets, labels in loader:
                data.cuda(non_blocking=True)
                labels.cuda(non_blocking=True)
            torch.cuda.synchronize()
            if epoch > 0:
                runs.append(total / (time.perf_counter() - t) / 1e9)
        out[name] = runs
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out))


def fresh_runs(mode, st_path, reps, results, key):
    """`reps` fresh processes (`peers.py MODE st_path`) each timing its context and load:
    records the GB/s of context + load under `results[key]` and returns those after the
    context."""
    import subprocess

    runs = []
    for _ in range(reps):
        out = subprocess.run(
            [sys.executable, __file__, mode, st_path],
            check=True, capture_output=True, text=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    results[key] = [
        r["bytes"] / (r["context_s"] + r["load_s"]) / 1e9 for r in runs
    ]
    return [r["bytes"] / r["load_s"] / 1e9 for r in runs]


def gpufeed_python(path, st_path, reps, results, peer, sync):
    """gpufeed's Python package (crates/gpufeed-py), measured as the peers are: time to torch
    tensors on the GPU, synchronized."""
    import tempfile

    import torch

    import gpufeed

    def reused(method, p):
        loader = gpufeed.Loader(0)
        getattr(loader, method)(p)  # warm-up: the loader's staging and device pool

        def run():
            out = getattr(loader, method)(p)
            sync()
            del out

        return timed(run, os.path.getsize(p), reps)

    peer("gpufeed (Python) load_file, reused Loader", lambda: reused("load_file", path))
    peer("gpufeed (Python) load_safetensors, reused Loader",
         lambda: reused("load_safetensors", st_path))

    name = "gpufeed (Python) load_safetensors"
    peer(f"{name}, fresh process: load after the context",
         lambda: fresh_runs("--one-shot-gpufeed", st_path, reps, results,
                            f"{name}, fresh process: context + load"))



def python_checkpoints(few, many, reps):
    """Table 10 (`--only python`): gpufeed's Python package against `safetensors.torch` on one
    warm checkpoint (`few`: 16 tensors) and the same bytes in 10,000 tensors (`many`), reused
    and in fresh processes, plus the per-tensor cost on 10,000 tensors of 16 KiB. Each entry a
    list of GB/s (seconds for the `seconds,` ones) or an error."""
    import tempfile

    import torch

    results = {}

    def part(name, make):
        attempt(results, name, make)

    def sync():
        torch.cuda.synchronize()

    def st_load(p):
        from safetensors.torch import load_file

        t = load_file(p, device="cuda:0")
        sync()
        del t

    import gpufeed

    loader = gpufeed.Loader(0)

    def gf_load(p):
        t = loader.load_safetensors(p)
        sync()
        del t

    def reused(load, p):
        load(p)  # warm-up: the loader's staging and device pool, torch's caching allocator
        return timed(lambda: load(p), os.path.getsize(p), reps)

    part("gpufeed reused", lambda: reused(gf_load, few))
    part("gpufeed reused, 10000 tensors", lambda: reused(gf_load, many))
    part("safetensors reused", lambda: reused(st_load, few))
    for mode, name in (("--one-shot-gpufeed", "gpufeed"), ("--one-shot", "safetensors")):
        part(f"{name} fresh", lambda m=mode, n=name: fresh_runs(m, few, reps, results,
                                                               f"{n} fresh with context"))

    def on_demand(open_, path, count):
        """GB/s of ``get_tensor`` of the first ``count`` tensors in name order, one at a time,
        the file opened beforehand (not timed)."""
        with open_(path) as f:
            names = sorted(f.keys())[:count]

            def run():
                total = 0
                for n in names:
                    t = f.get_tensor(n)
                    total += t.numel() * t.element_size()
                    del t
                sync()
                return total

            nbytes = run()  # warm-up
            return timed(run, nbytes, reps)

    def gf_open(p):
        return gpufeed.safe_open(p, device="cuda:0")

    def st_open(p):
        from safetensors import safe_open

        return safe_open(p, framework="pt", device="cuda:0")

    def gf_open_seconds():
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            f = gf_open(few)
            out.append(time.perf_counter() - t)
            f.close()
        return out

    part("gpufeed safe_open, 16 tensors", lambda: on_demand(gf_open, few, 16))
    part("safetensors safe_open, 16 tensors", lambda: on_demand(st_open, few, 16))
    part("gpufeed safe_open, 1000 of 10000 tensors", lambda: on_demand(gf_open, many, 1000))
    part("safetensors safe_open, 1000 of 10000 tensors", lambda: on_demand(st_open, many, 1000))
    part("seconds, gpufeed safe_open open", gf_open_seconds)
    for mode, name in (("--one-shot-safe-open-gpufeed", "gpufeed"),
                       ("--one-shot-safe-open", "safetensors")):
        part(f"{name} safe_open fresh",
             lambda m=mode, n=name: fresh_runs(m, few, reps, results,
                                               f"{n} safe_open fresh with context"))

    def per_tensor():
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(few))) as d:
            small = os.path.join(d, "small.safetensors")
            large = os.path.join(d, "large.safetensors")
            save_file({f"t{i}": torch.zeros(4096, dtype=torch.float32) for i in range(10_000)},
                      small)
            save_file({f"t{i}": torch.zeros(4096 * 1000, dtype=torch.float32)
                       for i in range(10)}, large)
            out = {}
            for key, p in (("seconds, 10 tensors of 16000 KiB", large),
                           ("seconds, 10000 tensors of 16 KiB", small)):
                gf_load(p)
                out[key] = [os.path.getsize(p) / g / 1e9 for g in timed(
                    lambda p=p: gf_load(p), os.path.getsize(p), max(reps, 9))]
            return out

    try:
        results.update(per_tensor())
    except Exception as e:
        results["seconds, 10000 tensors of 16 KiB"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))


def records_peers(path, record, batch, reps):
    """Issue 17's comparison: PyTorch's DataLoader (a map-style dataset over a numpy memmap,
    shuffled, num_workers=8, pin_memory=True, each batch to the GPU) and gpufeed's Python
    BatchLoader (8 workers, device batches) on the same records of `path`: GB/s per epoch (the
    first epoch of each warms up and is not counted)."""
    import numpy as np
    import torch

    results = {}
    size = os.path.getsize(path) // record * record

    def epochs(run):
        out = []
        for e in range(reps + 1):
            t = time.perf_counter()
            n = run(e)
            torch.cuda.synchronize()
            if e:
                out.append(n / (time.perf_counter() - t) / 1e9)
        return out

    def dataloader():
        data = np.memmap(path, dtype=np.uint8, mode="r", shape=(size // record, record))

        class Records(torch.utils.data.Dataset):
            def __len__(self):
                return data.shape[0]

            def __getitem__(self, i):
                return torch.from_numpy(np.array(data[i]))

        loader = torch.utils.data.DataLoader(
            Records(), batch_size=batch, shuffle=True, num_workers=8, pin_memory=True,
            drop_last=True, persistent_workers=True)

        def run(_):
            n = 0
            for b in loader:
                n += b.cuda(non_blocking=True).numel()
            return n

        return epochs(run)

    def gpufeed_loader():
        import gpufeed

        loader = gpufeed.BatchLoader(path, record_bytes=record, batch_size=batch, seed=1,
                                     device=0, workers=8, drop_last=True)

        def run(e):
            n = 0
            for b in loader.epoch(e):
                n += gpufeed.as_tensor(b.data).numel()
            return n

        return epochs(run)

    kib = record >> 10
    attempt(results, f"PyTorch DataLoader, {kib} KiB records, batches of {batch}, "
            "8 workers, pinned, to the GPU", dataloader)
    attempt(results, "gpufeed (Python) BatchLoader, same records, 8 workers, device batches",
            gpufeed_loader)
    print(json.dumps(results))


def _multi_rank(rank, world, st_path, reps, port, out):
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    dev = f"cuda:{rank}"

    def every_rank():
        t = load_file(st_path, device=dev)
        torch.cuda.synchronize()
        return t

    def broadcast():
        if rank == 0:
            t = load_file(st_path, device=dev)
        else:
            from safetensors import safe_open

            with safe_open(st_path, framework="pt") as f:
                names = list(f.keys())
                shapes = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in names}
            dtypes = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                      "U8": torch.uint8}
            t = {n: torch.empty(s, dtype=dtypes[d], device=dev) for n, (s, d) in shapes.items()}
        for name in sorted(t):
            dist.broadcast(t[name], src=0)
        torch.cuda.synchronize()
        return t

    results = {}
    for name, fn in [("safetensors load_file on every rank", every_rank),
                     ("safetensors load_file on rank 0, torch.distributed.broadcast (NCCL)",
                      broadcast)]:
        secs = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            tensors = fn()
            dist.barrier()
            if i:
                secs.append(time.perf_counter() - t0)
            del tensors
            torch.cuda.empty_cache()
        results[name] = secs
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def multi(st_path, world, reps):
    """Table 11's peers: N processes (one per GPU) load the checkpoint; seconds from a barrier
    before until a barrier after every rank holds it."""
    import tempfile

    import torch.multiprocessing as mp

    out = os.path.join(tempfile.mkdtemp(), "multi.json")
    port = 29500 + os.getpid() % 1000
    try:
        mp.spawn(_multi_rank, args=(world, st_path, reps, port, out), nprocs=world)
        with open(out) as f:
            print(f.read())
    except Exception as e:
        print(json.dumps({"peers": {"error": f"{type(e).__name__}: {e}"}}))


def main():
    if sys.argv[1] == "--multi":
        multi(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    if sys.argv[1] == "--one-shot":
        one_shot(sys.argv[2])
        return
    if sys.argv[1] == "--one-shot-gpufeed":
        import gpufeed

        one_shot(sys.argv[2], lambda p, device: gpufeed.load_safetensors(p, device=0))
        return
    if sys.argv[1] in ("--one-shot-safe-open", "--one-shot-safe-open-gpufeed"):
        if sys.argv[1].endswith("gpufeed"):
            import gpufeed

            def opened(p):
                return gpufeed.safe_open(p, device="cuda:0")
        else:
            from safetensors import safe_open

            def opened(p):
                return safe_open(p, framework="pt", device="cuda:0")

        def every_tensor(p, device):
            with opened(p) as f:
                return {n: f.get_tensor(n) for n in f.keys()}

        one_shot(sys.argv[2], every_tensor)
        return
    if sys.argv[1] == "--python-checkpoints":
        python_checkpoints(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if sys.argv[1] == "--records":
        records_peers(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    if sys.argv[1] == "--image-folder":
        image_folder(sys.argv[2], int(sys.argv[3]))
        return
    path, st_path, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    size = os.path.getsize(path)
    results = {}

    def peer(name, make):
        attempt(results, name, make)

    import numpy as np
    import torch

    def sync():
        torch.cuda.synchronize()

    def np_fromfile():
        t = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).cuda()
        sync()
        del t

    peer("torch np.fromfile().cuda()", lambda: timed(np_fromfile, size, reps))

    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def pinned_readinto():
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(pinned.numpy()))
        t = pinned.cuda(non_blocking=True)
        sync()
        del t

    peer("torch pinned readinto + .cuda()", lambda: timed(pinned_readinto, size, reps))
    del pinned

    def from_file():
        t = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).cuda()
        sync()
        del t

    peer("torch.from_file().cuda()", lambda: timed(from_file, size, reps))

    def kvikio_runs(threads):
        import cupy
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set({"num_threads": threads})
        buf = cupy.empty(size, dtype=cupy.uint8)

        def read():
            with kvikio.CuFile(path, "r") as f:
                f.read(buf)
            cupy.cuda.runtime.deviceSynchronize()

        read()  # warm-up: kvikio's own pinned bounce buffers
        return timed(read, size, reps)

    for n in (1, 8, 16):
        peer(f"kvikio {n} threads", lambda n=n: kvikio_runs(n))

    st_size = os.path.getsize(st_path)

    def st_load():
        from safetensors.torch import load_file

        t = load_file(st_path, device="cuda")
        sync()
        del t

    peer("safetensors load_file(device=cuda)", lambda: timed(st_load, st_size, reps))

    name = "safetensors load_file(device=cuda)"
    peer(f"{name}, fresh process: load after the context",
         lambda: fresh_runs("--one-shot", st_path, reps, results,
                            f"{name}, fresh process: context + load"))

    try:
        gpufeed_python(path, st_path, reps, results, peer, sync)
    except ImportError as e:
        results["gpufeed (Python)"] = {
            "error": f"{e}: pip install ./crates/gpufeed-py (or the wheel of cargo xtask device)"
        }

    def fst_runs():
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def load():
            loader = SafeTensorsFileLoader(SingleGroup(), torch.device("cuda:0"), nogds=True)
            loader.add_filenames({0: [st_path]})
            fb = loader.copy_files_to_device()
            sync()
            fb.close()
            loader.close()

        return timed(load, st_size, reps)

    peer("fastsafetensors (nogds)", fst_runs)

    # Saves (table 8's peers): the checkpoint's tensors on the GPU written back to a file in the
    # bench's directory, synced (os.fsync) so that the figure is the disk's, not the page cache's.
    out_dir = os.path.dirname(os.path.abspath(st_path))

    def synced(write, out):
        def run():
            write(out)
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        return run

    def save_runs(name, write):
        from safetensors.torch import load_file

        tensors = load_file(st_path, device="cuda")
        sync()
        out = os.path.join(out_dir, f"peer-save-{name}.bin")
        try:
            return timed(synced(lambda o: write(tensors, o), out), st_size, reps)
        finally:
            if os.path.exists(out):
                os.remove(out)

    def torch_save(tensors, out):
        torch.save(tensors, out)

    def st_save(tensors, out):
        from safetensors.torch import save_file

        save_file(tensors, out)

    peer("save: torch.save of the GPU tensors (synced)", lambda: save_runs("torch", torch_save))
    peer("save: safetensors.torch.save_file of the GPU tensors (synced)",
         lambda: save_runs("st", st_save))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
