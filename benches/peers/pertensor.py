#!/usr/bin/env python3
"""The cost per tensor of each gpufeed path to cuda:0: 10,000 F32 tensors of 16 KiB against 10
of 16,000 KiB (the same bytes), reused in one process (a warm-up, then medians of 9). Not run
by the bench (docs/benchmarks.md, GPU run 141); needs torch, safetensors and gpufeed.

Usage: pertensor.py [DIR]   (the two files are written to DIR; by default to a new private
       temporary directory, removed afterwards: a fixed name in /tmp could be another user's
       link)
"""
import os
import statistics
import sys
import time


def make_files(folder):
    """``(small, large)``: 10,000 F32 tensors of 16 KiB and 10 of 16,000 KiB written in
    ``folder``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    small = os.path.join(folder, "small.safetensors")
    large = os.path.join(folder, "large.safetensors")
    g = torch.Generator().manual_seed(3)
    save_file({f"t{i}": torch.randn(4096, generator=g) for i in range(10_000)}, small)
    save_file({f"t{i}": torch.randn(4096 * 1000, generator=g) for i in range(10)}, large)
    return small, large


def main(folder):
    import torch

    import gpufeed
    import gpufeed.torch

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    small, large = make_files(folder)
    loader = gpufeed.Loader(0)

    def get_tensor(p):
        with gpufeed.safe_open(p, framework="pt", device="cuda:0") as f:
            return {n: f.get_tensor(n) for n in f.keys()}

    def get_tensors(p):
        with gpufeed.safe_open(p, framework="pt", device="cuda:0") as f:
            return f.get_tensors()

    def prefetch(p):
        with gpufeed.safe_open(p, framework="pt", device="cuda:0") as f:
            with f.prefetch() as tensors:
                return dict(tensors)

    paths = {
        "torch.load_file": lambda p: gpufeed.torch.load_file(p, device="cuda:0"),
        "get_tensors": get_tensors,
        "Loader.load_safetensors": loader.load_safetensors,
        "prefetch": prefetch,
        "get_tensor": get_tensor,
    }
    for name, load in paths.items():
        row = {}
        for key, p in (("large_ms", large), ("small_ms", small)):
            out = load(p)
            torch.cuda.synchronize()
            del out
            times = []
            for _ in range(9):
                t = time.perf_counter()
                out = load(p)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                del out
            row[key] = statistics.median(times) * 1e3
        row["us_per_tensor"] = (row["small_ms"] - row["large_ms"]) / (10_000 - 10) * 1e3
        print(name, {k: round(v, 2) for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gpufeed-pertensor-") as private:
            main(private)
