#!/usr/bin/env python3
"""Where a drop-in load's time goes: the same load three times in one process (torch's CUDA
context made first, ``del`` between), with Python's marks (ms from the load's start, and
``@`` seconds since ``import gpufeed`` began) on stderr between gpufeed's debug events, whose
seconds count from the log's start inside that import: at most the ``imported`` mark later,
so an event's time plus that mark is on the ``@`` clock. Not run by the bench
(docs/benchmarks.md, GPU runs 139-140).

Usage: GPUFEED_LOG=debug timeline.py METHOD FILE 2> timeline.log
       METHOD: get_tensor | prefetch | get_tensors | object
       ``object``: ``gpufeed.load_safetensors(FILE, device=0)`` of a URL (``s3://...``, the
       server from the AWS_* variables), its first load with ``import gpufeed`` inside the
       clock, as a fresh process pays it (bench table 14's Python row).
"""
import os
import sys
import time


def main(method, path):
    import torch

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    imported = time.perf_counter()
    if method == "object":
        t0 = imported
    import gpufeed

    def mark(what, t0):
        now = time.perf_counter()
        print(f"PY {what} {1e3 * (now - t0):.2f} @{now - imported:.6f}s", file=sys.stderr,
              flush=True)

    def load(t0):
        if method == "object":
            return gpufeed.load_safetensors(path, device=0)
        with gpufeed.safe_open(path, framework="pt", device="cuda:0") as f:
            mark("opened", t0)
            if method == "get_tensors":
                return f.get_tensors()
            if method == "get_tensor":
                out = {}
                for i, name in enumerate(f.keys()):
                    out[name] = f.get_tensor(name)
                    if i == 0:
                        mark("first", t0)
                mark("last", t0)
                return out
            with f.prefetch() as loader:
                mark("started", t0)
                out = {}
                for name, tensor in loader:
                    if not out:
                        mark("first", t0)
                    out[name] = tensor
                mark("last", t0)
            return out

    mark("imported", imported)
    nbytes = None if method == "object" else os.path.getsize(path)
    for rep in range(3):
        print(f"PY ===== {method} rep {rep}", file=sys.stderr, flush=True)
        if method != "object" or rep > 0:
            t0 = time.perf_counter()
        tensors = load(t0)
        torch.cuda.synchronize()
        if nbytes is None:
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        mark(f"synced {nbytes / (time.perf_counter() - t0) / 1e9:.1f} GB/s", t0)
        del tensors
        mark("deleted", t0)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("get_tensor", "prefetch", "get_tensors",
                                                  "object"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
