#!/usr/bin/env python3
"""Helper of cold_blocks.sh: KvikIO reads FILE cold with THREADS threads into a CuPy buffer.
Prints READY once warmed up (the file evicted), waits for a line on stdin, reads, prints
"GBPS x"."""
import sys, time, kvikio, kvikio.defaults, cupy
path, threads = sys.argv[1], int(sys.argv[2])
kvikio.defaults.set({"num_threads": threads})
import os
size = os.path.getsize(path); buf = cupy.empty(size, dtype=cupy.uint8)
with kvikio.CuFile(path, "r") as f: f.read(buf[: 256 << 20])
os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
print("READY", flush=True); sys.stdin.readline()
t = time.perf_counter()
with kvikio.CuFile(path, "r") as f: n = f.read(buf)
cupy.cuda.runtime.deviceSynchronize(); el = time.perf_counter() - t
print(f"GBPS {n/el/1e9:.3f}", flush=True)
