#!/usr/bin/env python3
"""Where the drop-in's cost per tensor goes (issue 38): each part of each path timed apart,
reused in one process (a warm-up, then medians of 9), on 10,000 F32 tensors of 16 KiB against
10 of 16,000 KiB (the same bytes), as ``pertensor.py`` makes them; us per tensor for each part
((small - large) / 9,990). With a third FILE argument (a checkpoint to load again, e.g. 4 GiB
in 4,096 tensors), the marks of its loads: the open, the first tensor, the last, synced
(ms from the start, medians of 5 after a warm-up). Not run by the bench; needs torch,
safetensors (0.9 for its rows: ``GPUFEED_SAFETENSORS09`` names its folder) and gpufeed.

Usage: parts.py DIR [CHECKPOINT]   (DIR: a directory of the caller's, e.g. from mktemp -d;
       the two files are written there)
"""
import os
import statistics
import sys
import time


def main(folder, checkpoint=None):
    if os.environ.get("GPUFEED_SAFETENSORS09"):
        sys.path.insert(0, os.environ["GPUFEED_SAFETENSORS09"])
    import torch
    import safetensors
    from safetensors import safe_open as st_open

    import gpufeed
    from gpufeed import _gpufeed

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pertensor import make_files

    small, large = make_files(folder)  # pertensor.py's two files, written afresh
    sync = torch.cuda.synchronize

    def timed(setup, part, teardown=lambda s, o: None, k=9):
        """Median ms of ``part(setup())`` (setup and teardown outside the clock)."""
        times = []
        for i in range(k + 1):
            s = setup()
            sync()
            t = time.perf_counter()
            out = part(s)
            sync()
            dt = time.perf_counter() - t
            teardown(s, out)
            del out
            if i:
                times.append(dt)
        return statistics.median(times) * 1e3

    def handle(p):
        return lambda: gpufeed.safe_open(p, framework="pt", device="cuda:0")

    def close(s, _out):
        s.close()

    parts = {
        "gpufeed.safe_open": lambda p: timed(lambda: None, lambda _: gpufeed.safe_open(
            p, framework="pt", device="cuda:0")),
        "  native open_safetensors": lambda p: timed(
            lambda: None, lambda _: _gpufeed.open_safetensors(p)),
        "  native entries": lambda p: timed(
            lambda: _gpufeed.open_safetensors(p), lambda fs: fs[0].entries(0)),
        "get_tensor of each (opened)": lambda p: timed(
            handle(p), lambda f: {n: f.get_tensor(n) for n in f.keys()}, close),
        "get_tensors (opened)": lambda p: timed(handle(p), lambda f: f.get_tensors(), close),
        "prefetch() call (opened)": lambda p: timed(
            handle(p), lambda f: (f, f.prefetch()), lambda f, o: (o[1].close(), f.close())),
        "prefetch iterated (started)": lambda p: timed(
            lambda: (lambda f: (f, f.prefetch()))(handle(p)()), lambda s: dict(s[1]),
            lambda s, o: (s[1].close(), s[0].close())),
        "safetensors safe_open": lambda p: timed(
            lambda: None, lambda _: st_open(p, framework="pt", device="cuda:0")),
        "safetensors prefetch(16) iterated (opened)": lambda p: timed(
            lambda: st_open(p, framework="pt", device="cuda:0"),
            lambda f: dict(f.prefetch(threads=16))),
    }
    print("gpufeed", gpufeed.__file__, "safetensors", safetensors.__version__, flush=True)
    # The floor: torch's own import of a DLPack capsule per tensor.
    base = torch.empty(10_000, 4096, device="cuda:0")
    imp = getattr(torch._C, "_from_dlpack", torch.from_dlpack)
    caps_times = []
    for _ in range(10):
        caps = [base[i].__dlpack__() for i in range(10_000)]
        t = time.perf_counter()
        got = [imp(c) for c in caps]
        caps_times.append(time.perf_counter() - t)
        del got, caps
    print(f"floor: torch import of a capsule {statistics.median(caps_times[1:]) * 1e2:.2f} us"
          " per tensor", flush=True)
    for name, part in parts.items():
        if name.startswith("safetensors") and not hasattr(
                st_open(large, framework="pt"), "prefetch") and "prefetch" in name:
            continue
        a, b = part(large), part(small)
        print(f"{name:45s} large {a:7.2f} ms  small {b:7.2f} ms  "
              f"{(b - a) / 9990 * 1e3:5.2f} us per tensor", flush=True)

    if checkpoint:
        nbytes = os.path.getsize(checkpoint)
        for method in ("get_tensor", "prefetch", "safetensors prefetch(16)"):
            marks = []
            for i in range(6):
                sync()
                t0 = time.perf_counter()
                if method.startswith("safetensors"):
                    f = st_open(checkpoint, framework="pt", device="cuda:0")
                else:
                    f = gpufeed.safe_open(checkpoint, framework="pt", device="cuda:0")
                t1 = time.perf_counter()
                out = {}
                if method == "get_tensor":
                    for n in f.keys():
                        out[n] = f.get_tensor(n)
                        if len(out) == 1:
                            t2 = time.perf_counter()
                else:
                    loader = f.prefetch(threads=16) if method.startswith("safetensors") \
                        else f.prefetch()
                    for n, x in loader:
                        out[n] = x
                        if len(out) == 1:
                            t2 = time.perf_counter()
                t3 = time.perf_counter()
                sync()
                t4 = time.perf_counter()
                del out
                f = loader = None
                if i:
                    marks.append([t1 - t0, t2 - t0, t3 - t0, t4 - t0])
            med = [statistics.median(m[j] for m in marks) * 1e3 for j in range(4)]
            print(f"{method:25s} opened {med[0]:6.2f}  first {med[1]:6.2f}  last {med[2]:6.2f}"
                  f"  synced {med[3]:6.2f} ms  ({nbytes / med[3] / 1e6:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
