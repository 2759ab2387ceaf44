#!/usr/bin/env python3
"""Table 16's peer (issue 42): KvikIO reading a file cold into a CuPy device buffer.

Usage: cold.py FILE REPS -> one JSON object on stdout:
    {"env": {...}, "rows": {"kvikio_16": ROW, "kvikio_default": ROW}}
  ROW: {"threads": N, "gbps": [GB/s per cold read], "backends": {backend: bytes} (KvikIO's
        names: GDS for reads through cuFile, POSIX for its own compatibility mode),
        "max_resident_after_evict": share, "verified": "..."} or {"error": "..."}.
  Where kvikio or cupy cannot be imported: {"error": "..."} alone.

Each timed read: the file's pages dropped from the page cache (os.fsync, then
posix_fadvise(POSIX_FADV_DONTNEED) over the whole file: what gpufeed_os::cache::evict does for
the bench's own cold rows), then `kvikio.CuFile(path, "r").read(buf)` into a CuPy buffer of the
file's size and a device synchronize, the file's open inside the clock (as gpufeed's
`Loader::load_file` opens it inside its own). One untimed read of the first 256 MiB before the
timed ones (KvikIO's thread pool, the cuFile driver and its buffers). Rows: KvikIO's thread
pool at 16 threads, and at its own default (`KVIKIO_NTHREADS`, else 1).

`env` says how KvikIO reads here: its version, `compat_mode` (ON, OFF, AUTO) and whether it
prefers its compatibility mode (its own POSIX reads, no cuFile at all: not cuFile's
compatibility mode), the libcufile version and what the cuFile driver reports
(`is_gds_available`, `allow_compat_mode`); each row's `backends` are KvikIO's own statistics
(`kvikio.SummaryMonitor`: bytes per backend) over its timed reads, where this KvikIO has them.
kvikio comes from wheels (BENCH.md), cupy is on the GPU machine's image.
"""
import enum
import json
import os
import sys
import time

WARM_UP_BYTES = 256 << 20
WINDOW = 1 << 20


def evict(path):
    """The file's clean pages out of the page cache (dirty ones written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_share(kvikio, path):
    """The share of the file's pages in the page cache, or None where KvikIO cannot tell."""
    try:
        cached, total = kvikio.get_page_cache_info(path)
        return cached / total if total else 1.0
    except Exception:
        return None


def env_of(kvikio, cupy):
    """What this KvikIO says about itself and cuFile (each question optional)."""
    env = {"kvikio": kvikio.__version__, "cupy": cupy.__version__}

    def ask(key, fn):
        try:
            value = fn()
            if isinstance(value, enum.Enum):  # CompatMode, an IntEnum: its name, not 2
                value = value.name
            env[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
        except Exception as e:
            env[key] = f"unknown ({type(e).__name__}: {e})"

    import kvikio.cufile_driver
    import kvikio.defaults

    ask("compat_mode", lambda: kvikio.defaults.get("compat_mode"))
    ask("compat_mode_preferred", kvikio.defaults.is_compat_mode_preferred)
    ask("default_num_threads", lambda: kvikio.defaults.get("num_threads"))
    ask("task_size", lambda: kvikio.defaults.get("task_size"))
    ask("gds_threshold", lambda: kvikio.defaults.get("gds_threshold"))
    ask("bounce_buffer_size", lambda: kvikio.defaults.get("bounce_buffer_size"))
    ask("auto_direct_io_read", lambda: kvikio.defaults.get("auto_direct_io_read"))
    ask("libcufile", lambda: "%d.%d" % kvikio.cufile_driver.libcufile_version())
    ask("is_gds_available", lambda: kvikio.cufile_driver.get("is_gds_available"))
    ask("allow_compat_mode", lambda: kvikio.cufile_driver.get("allow_compat_mode"))
    def gpu_name():
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else name

    ask("gpu", gpu_name)
    return env


def verify(path, buf, size, cupy):
    """Three windows of the buffer (start, middle, end) against the file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for at in sorted({0, max(0, size // 2 - WINDOW // 2), max(0, size - WINDOW)}):
            n = min(WINDOW, size - at)
            if cupy.asnumpy(buf[at:at + n]).tobytes() != os.pread(fd, n, at):
                raise RuntimeError(f"the bytes KvikIO read differ from the file at offset {at}")
    finally:
        os.close(fd)
    return "3 windows of 1 MiB (start, middle, end) match the file"


def row(kvikio, cupy, path, size, reps, threads):
    """`reps` cold reads of the whole file with KvikIO's thread pool at `threads`."""
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": threads})
    buf = cupy.empty(size, dtype=cupy.uint8)
    with kvikio.CuFile(path, "r") as f:
        f.read(buf, min(size, WARM_UP_BYTES))
    cupy.cuda.runtime.deviceSynchronize()
    try:
        monitor = kvikio.SummaryMonitor()
    except Exception:
        monitor = None
    runs, resident = [], []
    for _ in range(reps):
        evict(path)
        share = resident_share(kvikio, path)
        if share is not None:
            resident.append(share)
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            n = f.read(buf)
        cupy.cuda.runtime.deviceSynchronize()
        seconds = time.perf_counter() - t
        if n != size:
            raise RuntimeError(f"read {n} bytes of {size}")
        runs.append(size / seconds / 1e9)
    out = {"threads": threads, "gbps": runs}
    if monitor is not None:
        try:
            summary = monitor.get()
            out["backends"] = {
                name: totals["bytes_transferred"]
                for name, totals in summary.by_backend.items()
                if totals["bytes_transferred"]
            }
            monitor.stop()
        except Exception as e:
            out["backends_error"] = f"{type(e).__name__}: {e}"
    if resident:
        out["max_resident_after_evict"] = max(resident)
    out["verified"] = verify(path, buf, size, cupy)
    del buf
    cupy.get_default_memory_pool().free_all_blocks()
    return out


def main():
    path, reps = sys.argv[1], int(sys.argv[2])
    size = os.path.getsize(path)
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    env = env_of(kvikio, cupy)
    default_threads = env.get("default_num_threads")
    results = {}
    plan = [("kvikio_16", 16)]
    if isinstance(default_threads, int) and default_threads != 16:
        plan.append(("kvikio_default", default_threads))
    elif not isinstance(default_threads, int):
        results["kvikio_default"] = {"error": f"KvikIO's default thread count: {default_threads}"}
    for name, threads in plan:
        try:
            results[name] = row(kvikio, cupy, path, size, reps, threads)
        except Exception as e:
            results[name] = {"threads": threads, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps({"env": env, "rows": results}))


if __name__ == "__main__":
    main()
