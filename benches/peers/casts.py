#!/usr/bin/env python3
"""Table 10's cast rows: a checkpoint loaded to cuda:0 in another floating dtype (issue 39's
item 2), each load in fresh processes that created torch's CUDA context before the clock (warm
page cache):

- ``gpufeed.load_safetensors(path, dtype=...)``: cast on the GPU on the way (bounded staging);
- the same load without a cast (what the cast costs);
- ``gpufeed.load_safetensors`` then torch's ``.to(dtype)`` of each tensor (what a user writes
  without ``dtype=``: both copies held for a moment);
- ``gpufeed.load_into`` into tensors allocated before the clock in the other dtype, and in the
  file's own dtype (no cast).

Two files of the same bytes: BF16 (cast to F16) and F32 (cast to BF16: half the bytes written,
GB/s counted by the bytes read). Each row reports a digest of what it made (per tensor, a sum
and a position-weighted sum of its elements' bits): rows that make the same dtype from the same
file must agree, the cast rows with torch's ``.to`` bit for bit.

Usage: casts.py REPS DIR BYTES [TENSORS]  -> one JSON object on stdout:
       {"bytes": n, "tensors": n, "rows": {method: {"seconds": [..], "gbps": [..],
       "digest": [..]} or {"error": "..."}}}
       (DIR: where the files are made once; TENSORS: 32 unless given.)
       casts.py --one METHOD FILE  -> (internal) one fresh process: JSON of its time.
       ``CASTS_METHODS`` (comma-separated) measures only those methods.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

# method -> (file's dtype, the dtype made)
METHODS = {
    "BF16 file: load_safetensors (no cast)": ("BF16", "bfloat16"),
    "BF16 file: load_safetensors dtype=float16": ("BF16", "float16"),
    "BF16 file: load_safetensors, then .to(float16)": ("BF16", "float16"),
    "BF16 file: load_into bfloat16 tensors (no cast)": ("BF16", "bfloat16"),
    "BF16 file: load_into float16 tensors": ("BF16", "float16"),
    "F32 file: load_safetensors (no cast)": ("F32", "float32"),
    "F32 file: load_safetensors dtype=bfloat16": ("F32", "bfloat16"),
    "F32 file: load_safetensors, then .to(bfloat16)": ("F32", "bfloat16"),
    "F32 file: load_into bfloat16 tensors": ("F32", "bfloat16"),
}


def make(path, dtype, nbytes, tensors):
    """A safetensors file of ``tensors`` random tensors of ``dtype`` (``nbytes`` in all, rows
    of 4096 elements), finite values with every low bit set at random (rounding ties
    included); nothing where it is there already."""
    if os.path.isfile(path):
        return
    import torch
    from safetensors.torch import save_file

    td = {"BF16": torch.bfloat16, "F32": torch.float32}[dtype]
    size = torch.finfo(td).bits // 8
    rows = max(1, nbytes // tensors // size // 4096)
    g = torch.Generator(device="cuda:0").manual_seed(39)
    state = {}
    for i in range(tensors):
        x = torch.randn(rows, 4096, device="cuda:0", generator=g, dtype=torch.float32)
        if td == torch.float32:
            # Random low bits: the mantissa bits BF16 rounds off, ties among them.
            bits = torch.randint(0, 1 << 16, (rows, 4096), device="cuda:0", generator=g,
                                 dtype=torch.int32)
            x = ((x.view(torch.int32) & ~0xFFFF) | bits).view(torch.float32)
        state[f"layers.{i}.weight"] = x.to(td).cpu()
    save_file(state, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)


def _digest(torch, tensors):
    """Per tensor (by name), the sum of its elements' bits and a position-weighted sum."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().view(-1)
        bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
        w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521
        h.update(name.encode())
        h.update(f"{int(bits.sum())},{int((bits * w).sum())},{t.dtype}".encode())
        del bits, w
    return h.hexdigest()[:16]


def one(method, path):
    """A fresh process: its imports and torch's context, then ``method`` timed."""
    import torch

    import gpufeed

    _, made = METHODS[method]
    dtype = getattr(torch, made)
    torch.zeros(1, device="cuda:0")
    dst = None
    if "load_into" in method:
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            dst = {k: torch.empty(f.get_slice(k).get_shape(), dtype=dtype, device="cuda:0")
                   for k in f.keys()}
    torch.cuda.synchronize()
    t = time.perf_counter()
    if dst is not None:
        gpufeed.load_into(path, dst)
        out = dst
    elif "dtype=" in method:
        out = gpufeed.load_safetensors(path, device=0, dtype=dtype)
    elif ".to(" in method:
        out = gpufeed.load_safetensors(path, device=0)
        out = {k: v.to(dtype) for k, v in out.items()}
    else:
        out = gpufeed.load_safetensors(path, device=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "digest": _digest(torch, out)}))


def measure(reps, directory, nbytes, tensors):
    os.makedirs(directory, exist_ok=True)
    files = {d: os.path.join(directory, f"casts-{d}-{nbytes}-{tensors}.safetensors")
             for d in ("BF16", "F32")}
    for d, path in files.items():
        make(path, d, nbytes, tensors)
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    sizes = {d: os.path.getsize(p) for d, p in files.items()}
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_PATCH_SAFETENSORS"}
    chosen = [m for m in os.environ.get("CASTS_METHODS", "").split(",") if m]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        sys.exit(f"casts.py: unknown methods {unknown}; the methods are {list(METHODS)}")
    rows = {}
    for method in chosen or list(METHODS):
        path = files[METHODS[method][0]]
        seconds, digests = [], set()
        try:
            for _ in range(reps):
                run = subprocess.run([sys.executable, __file__, "--one", method, path],
                                     capture_output=True, text=True, timeout=600, env=env)
                if run.returncode != 0:
                    tail = run.stderr.strip().splitlines()
                    raise RuntimeError(tail[-1] if tail else f"exit {run.returncode}")
                r = json.loads(run.stdout.strip().splitlines()[-1])
                seconds.append(r["seconds"])
                digests.add(r["digest"])
            size = sizes[METHODS[method][0]]
            rows[method] = {"seconds": seconds, "gbps": [size / s / 1e9 for s in seconds],
                            "digest": sorted(digests)}
        except Exception as e:  # noqa: BLE001 (a row's failure is reported, not fatal)
            rows[method] = {"error": f"{type(e).__name__}: {e}"}
        print(f"casts: {method}: {rows[method]}", file=sys.stderr)
    return {"bytes": sizes["BF16"], "tensors": tensors, "rows": rows}


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4:
        tensors = int(sys.argv[4]) if len(sys.argv) > 4 else 32
        print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), tensors)))
    else:
        sys.exit(__doc__)
