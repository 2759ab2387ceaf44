#!/usr/bin/env python3
"""Table 10's drop-in rows: every path a framework calls to load a safetensors file to the GPU,
gpufeed's drop-in (``gpufeed.safe_open`` + ``get_tensor`` of each, ``get_tensors``,
``prefetch`` iterated, ``gpufeed.torch.load_file``) against safetensors 0.9's (``prefetch``
with 8 and 16 threads, ``load_file``, ``get_tensor`` of each) and gpufeed's own
``load_safetensors``, each in fresh processes that created torch's CUDA context before the
clock (warm page cache), and loaded again in one process (the third load).

The ``load_into`` rows write into tensors allocated before the clock (the same ones for each
load of a process) and report the device memory the first load took beyond them at its peak
(``extra_mib``, the most over the processes: the driver's free memory, sampled every
millisecond on a thread during each process's second load);
``DROPIN_INTO_STAGING_MIB`` sets ``load_into``'s staging buffers (default: its own).

Usage: dropin.py REPS FILE [FILE ...]  -> one JSON object on stdout (``DROPIN_METHODS``, a
       comma-separated list of the methods below, measures only those):
       {file: {"bytes": n, "tensors": n, "rows": {method: {"fresh": [GB/s], "again": [GB/s],
       "checksum": n} or {"error": "..."}}}}
       dropin.py --one METHOD FILE  -> (internal) one fresh process: JSON of its times.
       dropin.py --summary JSON  -> a line per row of a result: each process's GB/s fresh and
       again, their medians, the checksums.

safetensors 0.9 comes from ``GPUFEED_SAFETENSORS09`` (a folder put first on ``sys.path`` for its
rows only, BENCH.md); without it the safetensors rows are those of the installed safetensors,
and its ``prefetch`` rows say it has none.
"""
import json
import os
import subprocess
import sys
import time

METHODS = [
    "gpufeed load_safetensors",
    "gpufeed safe_open get_tensor",
    "gpufeed safe_open get_tensors",
    "gpufeed safe_open prefetch",
    "gpufeed torch.load_file",
    "safetensors prefetch threads=16",
    "safetensors prefetch threads=8",
    "safetensors load_file",
    "safetensors safe_open get_tensor",
    "gpufeed load_into",
    "safetensors prefetch threads=16 copy_ into",
]
# Methods that write into tensors allocated before the clock (an engine's preallocated
# parameters), the same ones for every load of a process.
INTO = ("gpufeed load_into", "safetensors prefetch threads=16 copy_ into")


def _destinations(path):
    """An empty CUDA tensor per tensor of ``path`` (its dtype and shape), by name."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            s = f.get_slice(name)
            dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16",
                                    "F64": "float64", "I64": "int64", "I32": "int32",
                                    "I16": "int16", "U8": "uint8", "I8": "int8",
                                    "U16": "uint16", "U32": "uint32", "U64": "uint64",
                                    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                                    "BOOL": "bool"}[s.get_dtype()])
            out[name] = torch.empty(s.get_shape(), dtype=dtype, device="cuda:0")
    return out


class _FreeMemoryWatch:
    """The device's free memory sampled every millisecond on a thread (the loads give up the
    GIL while they run): ``stop()`` returns how far it fell below where it started."""

    def __init__(self, torch):
        import threading

        self.torch, self.before = torch, torch.cuda.mem_get_info(0)[0]
        self.lowest, self.done = self.before, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(0.001):
            self.lowest = min(self.lowest, self.torch.cuda.mem_get_info(0)[0])

    def stop(self):
        self.done.set()
        self.thread.join()
        self.lowest = min(self.lowest, self.torch.cuda.mem_get_info(0)[0])
        return self.before - self.lowest


def _load_into(method, path, dst):
    """``path``'s tensors written into ``dst`` by ``method``; returns ``dst``."""
    if method == "gpufeed load_into":
        import gpufeed

        mib = os.environ.get("DROPIN_INTO_STAGING_MIB")
        gpufeed.load_into(path, dst, staging_bytes=int(mib) << 20 if mib else None)
        return dst
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cuda:0") as f:
        if not hasattr(f, "prefetch"):
            import safetensors

            raise RuntimeError(f"safetensors {safetensors.__version__} has no prefetch")
        with f.prefetch(threads=16) as loader:
            for name, t in loader:
                dst[name].copy_(t)
    return dst


def _load(method, path):
    """The tensors of ``path`` on cuda:0 by ``method``, as a dict."""
    if method.startswith("gpufeed"):
        import gpufeed
        import gpufeed.torch

        if method == "gpufeed load_safetensors":
            return gpufeed.load_safetensors(path, device=0)
        if method == "gpufeed torch.load_file":
            return gpufeed.torch.load_file(path, device="cuda:0")
        with gpufeed.safe_open(path, framework="pt", device="cuda:0") as f:
            if method == "gpufeed safe_open get_tensor":
                return {n: f.get_tensor(n) for n in f.keys()}
            if method == "gpufeed safe_open get_tensors":
                return f.get_tensors()
            with f.prefetch() as loader:
                return dict(loader)
    from safetensors import safe_open
    from safetensors.torch import load_file

    if method == "safetensors load_file":
        return load_file(path, device="cuda:0")
    with safe_open(path, framework="pt", device="cuda:0") as f:
        if method == "safetensors safe_open get_tensor":
            return {n: f.get_tensor(n) for n in f.keys()}
        threads = int(method.rsplit("=", 1)[1])
        if not hasattr(f, "prefetch"):
            import safetensors

            raise RuntimeError(f"safetensors {safetensors.__version__} has no prefetch")
        with f.prefetch(threads=threads) as loader:
            return dict(loader)


def one(method, path):
    """A fresh process: torch's context, then ``method`` timed (to the tensors on the GPU,
    synchronized), then the same twice more in this process; a checksum of the bytes."""
    if method.startswith("safetensors") and os.environ.get("GPUFEED_SAFETENSORS09"):
        sys.path.insert(0, os.environ["GPUFEED_SAFETENSORS09"])
    import torch

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    times = []
    checksum = None
    dst = _destinations(path) if method in INTO else None
    extra = None
    for rep in range(3):
        torch.cuda.synchronize()
        # The peak is watched in the second load, so that the first (fresh) is timed as
        # every other row's is.
        watch = _FreeMemoryWatch(torch) if dst is not None and rep == 1 else None
        t = time.perf_counter()
        tensors = _load_into(method, path, dst) if dst is not None else _load(method, path)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if watch is not None:
            # Device memory the load took beyond the destinations, at its peak.
            extra = watch.stop()
        if rep == 0:
            nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
            checksum = 0
            for name in sorted(tensors):
                b = tensors[name].contiguous().view(-1).view(torch.uint8)
                checksum = (checksum * 1000003 + int(b.sum(dtype=torch.int64)) + len(name)) % (1 << 61)
        del tensors
    print(json.dumps({"bytes": nbytes, "seconds": times, "checksum": checksum,
                      "extra_bytes": extra}))


def measure(paths, reps):
    """Each method's fresh processes (``reps``) on each of ``paths``, after one untimed
    process (the first method's) per path."""
    # The safetensors rows must measure safetensors: no routing to gpufeed from outside.
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_PATCH_SAFETENSORS"}
    chosen = [m for m in os.environ.get("DROPIN_METHODS", "").split(",") if m]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        sys.exit(f"dropin.py: unknown methods {unknown}; the methods are {METHODS}")
    out = {}
    for path in paths:
        rows = {}
        # One process before the timed ones, its figures dropped: the first process to load a
        # file just written ran slower than the next ones (H100 machines, GPU runs 245 and 247,
        # `get_tensor` of each: 26.7 GB/s against 35.3 and 37.7; 19.4 against 28.3 and 34.3;
        # 24.3 against 43.4 and 43.0 on 8 GiB), and it was always the first row's.
        try:
            subprocess.run([sys.executable, __file__, "--one", (chosen or METHODS)[0], path],
                           capture_output=True, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            pass  # its row's own processes say what is wrong
        for method in chosen or METHODS:
            fresh, again, sums, extras = [], [], set(), []
            try:
                for _ in range(reps):
                    run = subprocess.run([sys.executable, __file__, "--one", method, path],
                                         capture_output=True, text=True, timeout=600, env=env)
                    if run.returncode != 0:
                        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip()
                                           else f"exit {run.returncode}")
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    fresh.append(r["bytes"] / r["seconds"][0] / 1e9)
                    again.append(r["bytes"] / r["seconds"][2] / 1e9)
                    sums.add(r["checksum"])
                    extras.append(r.get("extra_bytes"))
                rows[method] = {"fresh": fresh, "again": again, "checksum": sorted(sums)}
                extras = [e for e in extras if e is not None]
                if extras:
                    rows[method]["extra_mib"] = max(extras) / (1 << 20)
            except Exception as e:  # noqa: BLE001 (a peer that cannot run says why)
                rows[method] = {"error": f"{type(e).__name__}: {e}"}
            print(f"dropin: {os.path.basename(path)} {method}: {rows[method]}", file=sys.stderr)
        out[path] = {"bytes": os.path.getsize(path), "rows": rows}
    print(json.dumps(out))


def summary(path):
    """A line per row of ``measure``'s JSON in ``path``."""
    import statistics

    def gb(xs):
        return " ".join(f"{x:.1f}" for x in xs) + f" ({statistics.median(xs):.1f})"

    with open(path) as f:
        result = json.load(f)
    for v in result.values():
        for method, r in v["rows"].items():
            if "error" in r:
                print(f"{method}: {r['error']}")
                continue
            print(f"{method:40s} fresh {gb(r['fresh'])} / again {gb(r['again'])} "
                  f"checksum {r['checksum']}")


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--summary":
        summary(sys.argv[2])
    else:
        measure(sys.argv[2:], int(sys.argv[1]))
