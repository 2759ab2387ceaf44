"""Casts on the way of a load (issue 39, item 2): ``gpufeed.load_into`` into tensors of another
floating dtype, ``gpufeed.load_safetensors(dtype=)`` and ``safe_open(...).get_tensor(dtype=)``.

On a GPU (skipped with the reason without torch or a GPU, a failure where
``GPUFEED_REQUIRE_GPU=1``), against torch's own ``.to(dtype)`` on the same GPU, bit for bit:
every value of BF16, F16, F8_E4M3 and F8_E5M2, and F32 values with every high half and the low
halves where rounding turns (ties) plus random ones, each tensor at an odd offset of a file
written by hand; a staging small enough to split tensors into pieces; row and column plans
with a cast;
``load_safetensors(dtype=)`` of a file of mixed types (integers kept, F64 cast by torch) and
with nothing to cast. Without a GPU: the refusals that need none."""

import json
import struct

import pytest

import gpufeed

from test_load_into import _torch, _torch_on_gpu  # the same skips and requirements


def _write_raw(path, entries):
    """A safetensors file by hand, tensors in the order given, no alignment, no header
    padding: ``entries`` are (name, dtype string, shape, bytes)."""
    header, offset = {}, 0
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    if (8 + len(text)) % 2 == 0:
        text += b" "  # an odd start for the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(e[3] for e in entries))


def _sources(torch):
    """Name -> (safetensors dtype, torch dtype, CPU tensor): every one- and two-byte value, and
    F32 values around every rounding point."""
    import numpy as np

    u16 = np.arange(1 << 16, dtype=np.uint16)
    u8 = np.arange(256, dtype=np.uint8)
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001,
                     0xF000, 0xFFFF], dtype=np.uint32)
    f32 = (u16.astype(np.uint32)[:, None] << 16 | lows[None, :]).reshape(-1)
    rng = np.random.default_rng(39)
    f32 = np.concatenate([f32, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    as_t = lambda a, dt: torch.from_numpy(a.copy()).view(dt)  # noqa: E731
    return {
        "bf16": ("BF16", torch.bfloat16, as_t(u16, torch.int16).view(torch.bfloat16)),
        "f16": ("F16", torch.float16, as_t(u16, torch.int16).view(torch.float16)),
        "e4m3": ("F8_E4M3", torch.float8_e4m3fn, as_t(u8, torch.uint8).view(torch.float8_e4m3fn)),
        "e5m2": ("F8_E5M2", torch.float8_e5m2, as_t(u8, torch.uint8).view(torch.float8_e5m2)),
        "f32": ("F32", torch.float32, as_t(f32, torch.int32).view(torch.float32)),
    }


def _file(torch, tmp_path):
    """Every source after a 3-byte tensor (so each starts at an odd offset of the data section,
    and of a staging that holds ``pad`` too), the F32 one 2 x n (rows for plans)."""
    src = _sources(torch)
    entries = [("pad", "U8", [3], b"\x01\x02\x03")]
    for name, (st, _, t) in src.items():
        shape = [2, t.numel() // 2] if name == "f32" else [t.numel()]
        entries.append((name, st, shape, t.view(torch.uint8).numpy().tobytes()))
        src[name] = (st, _, t.reshape(shape))
    path = str(tmp_path / "casts.safetensors")
    _write_raw(path, entries)
    return path, src


def _bits(torch, t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(torch, got, want, what):
    g, w = _bits(torch, got), _bits(torch, want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = (g != w).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}: "
        f"{hex(int(g[tuple(diff[0])]) & 0xFFFFFFFF)} != {hex(int(w[tuple(diff[0])]) & 0xFFFFFFFF)}"
    )


TARGETS = ("float32", "float16", "bfloat16")


def test_load_into_casts_every_value_as_torch_does_on_the_gpu(tmp_path):
    torch = _torch_on_gpu()
    path, src = _file(torch, tmp_path)
    for staging in (None, 1 << 20):  # 1 MiB: the F32 tensor (7 MiB) in pieces
        for target in TARGETS:
            dt = getattr(torch, target)
            dst = {n: torch.full(t.shape, 7, dtype=dt, device="cuda:0")
                   for n, (_, sdt, t) in src.items() if sdt != dt}
            # `pad` first in the staging: the sources after it at odd addresses there.
            pad = torch.zeros(3, dtype=torch.uint8, device="cuda:0")
            got = gpufeed.load_into(path, {"pad": pad, **dst}, strict=False,
                                    staging_bytes=staging)
            assert got.missing_keys == [] and pad.tolist() == [1, 2, 3]
            for name, out in dst.items():
                want = src[name][2].cuda().to(dt)
                _same_bits(torch, out, want, f"{name} -> {target} (staging {staging})")


def test_row_plans_cast_only_their_rows(tmp_path):
    torch = _torch_on_gpu()
    path, src = _file(torch, tmp_path)
    whole = src["f32"][2].cuda()
    n = whole.shape[1]
    for rows in (slice(0, 1), slice(1, 2), slice(2, 2)):
        dst = torch.zeros(rows.stop - rows.start, n, dtype=torch.bfloat16, device="cuda:0")
        gpufeed.load_into(path, {"f32": dst}, strict=False, plan={"f32": rows})
        _same_bits(torch, dst, whole[rows].to(torch.bfloat16), f"rows {rows}")


def test_column_plans_cast_their_runs(tmp_path):
    """Columns of matrices of every source type cast into every target, with a 1 MiB staging
    cutting the spans inside runs, against torch's ``.to`` of the same columns."""
    torch = _torch_on_gpu()
    g = torch.Generator().manual_seed(23)
    base = torch.randn(1031, 517, generator=g) * 1000
    tensors = {"f32": base, "f16": base.half(), "bf16": base.bfloat16(),
               "e4m3": (base / 1000).to(torch.float8_e4m3fn), "e5m2": base.to(torch.float8_e5m2)}
    from safetensors.torch import save_file

    path = str(tmp_path / "columns.safetensors")
    save_file(tensors, path)
    for target in TARGETS:
        dt = getattr(torch, target)
        for a, b in ((0, 100), (100, 517), (3, 4)):
            plan, dst, whole = {}, {}, {}
            for name, t in tensors.items():
                if t.dtype == dt:
                    continue
                plan[name] = (slice(None), slice(a, b))
                # A view of a larger buffer: nothing may be written past the part.
                n = t.shape[0] * (b - a)
                whole[name] = torch.full((n + 4099,), 7, dtype=dt, device="cuda:0")
                dst[name] = whole[name][:n].view(t.shape[0], b - a)
            gpufeed.load_into(path, dst, strict=False, plan=plan, staging_bytes=1 << 20)
            for name, out in dst.items():
                want = tensors[name][:, a:b].cuda().to(dt)
                _same_bits(torch, out, want, f"{name}[:, {a}:{b}] -> {target}")
                assert bool((whole[name][out.numel():] == 7).all()), f"{name}: past its part"


def test_load_safetensors_with_a_dtype_casts_floats_only_and_in_bounded_memory(tmp_path):
    torch = _torch_on_gpu()
    path, src = _file(torch, tmp_path)
    for target in TARGETS:
        dt = getattr(torch, target)
        got = gpufeed.load_safetensors(path, device=0, dtype=dt)
        assert set(got) == set(src) | {"pad"}
        assert got["pad"].dtype == torch.uint8 and got["pad"].tolist() == [1, 2, 3]
        for name, (_, _, t) in src.items():
            _same_bits(torch, got[name], t.cuda().to(dt), f"load_safetensors {name} -> {target}")
        # Cast on the way into one buffer of the target type (not a load then torch's .to).
        storages = {got[n].untyped_storage().data_ptr() for n, (_, sdt, _) in src.items()
                    if sdt != dt}
        assert len(storages) == 1, storages
        # Each 256-byte aligned, as torch allocates (kernels choose by alignment).
        assert all(t.data_ptr() % 256 == 0 for t in got.values()), {
            n: t.data_ptr() % 256 for n, t in got.items()}
        # The name of the dtype works too.
        again = gpufeed.load_safetensors(path, device=0, dtype=target)
        _same_bits(torch, again["f32"], got["f32"], "by name")
    # Mixed: integers keep their type, F64 is cast by torch after its load, and a file with
    # nothing to cast loads as without dtype=.
    g = torch.Generator().manual_seed(5)
    mixed = {"w": torch.randn(33, 7, generator=g), "i": torch.arange(11),
             "d": torch.randn(5, generator=g, dtype=torch.float64)}
    from safetensors.torch import save_file

    mixed_path = str(tmp_path / "mixed.safetensors")
    save_file(mixed, mixed_path)
    got = gpufeed.load_safetensors(mixed_path, device=0, dtype=torch.float16)
    assert got["i"].dtype == torch.int64 and torch.equal(got["i"].cpu(), mixed["i"])
    _same_bits(torch, got["d"], mixed["d"].cuda().to(torch.float16), "F64 by torch")
    _same_bits(torch, got["w"], mixed["w"].cuda().to(torch.float16), "F32")
    if hasattr(torch, "float4_e2m1fn_x2"):
        # A packed type is loaded as it is beside the casts.
        packed_path = str(tmp_path / "packed.safetensors")
        _write_raw(packed_path, [("p", "F4", [3, 4], bytes(range(6))),
                                 ("w", "F32", [2], struct.pack("<2f", 1.5, -2.25))])
        got = gpufeed.load_safetensors(packed_path, device=0, dtype=torch.bfloat16)
        assert got["p"].view(torch.uint8).flatten().tolist() == list(range(6))
        assert got["w"].tolist() == [1.5, -2.25] and got["w"].dtype == torch.bfloat16
    bf = {"w": torch.randn(9, 3, generator=g).bfloat16()}
    bf_path = str(tmp_path / "bf.safetensors")
    save_file(bf, bf_path)
    got = gpufeed.load_safetensors(bf_path, device=0, dtype=torch.bfloat16)
    _same_bits(torch, got["w"], bf["w"].cuda(), "nothing to cast")


def test_get_tensor_casts_on_the_handles_device(tmp_path):
    torch = _torch_on_gpu()
    path, src = _file(torch, tmp_path)
    with gpufeed.safe_open(path, framework="pt", device="cuda:0") as f:
        for name, (_, _, t) in src.items():
            got = f.get_tensor(name, dtype=torch.float16)
            _same_bits(torch, got, t.cuda().to(torch.float16), f"get_tensor {name}")
        assert f.get_tensor("pad", dtype="float16").dtype == torch.uint8  # not floating


def test_casts_refused_without_a_gpu_or_outside_the_table(tmp_path):
    torch = _torch()
    path, _ = _file(torch, tmp_path)
    for bad in (torch.float8_e4m3fn, torch.int32, "float128", 3):
        with pytest.raises(gpufeed.SafetensorError, match="casts to torch.bfloat16"):
            gpufeed.load_safetensors(path, device=0, dtype=bad)
    with pytest.raises(gpufeed.SafetensorError, match="local files"):
        gpufeed.load_safetensors("s3://bucket/model.safetensors", device=0, dtype=torch.float16)
    with gpufeed.safe_open(path, framework="pt", device="cpu") as f:
        # On the CPU, by torch's CPU cast.
        got = f.get_tensor("bf16", dtype=torch.float32)
        assert got.dtype == torch.float32 and got.numel() == 1 << 16
        with pytest.raises(gpufeed.SafetensorError, match="not a torch dtype"):
            f.get_tensor("bf16", dtype="float128")
        with pytest.raises(gpufeed.SafetensorError, match="floating"):
            f.get_tensor("bf16", dtype=torch.int8)
    with pytest.raises(TypeError, match="ordinal"):
        gpufeed.load_safetensors(path, device="cuda:0", dtype=torch.float16)
    if not torch.cuda.is_available():
        with pytest.raises(gpufeed.NoGpuError):
            gpufeed.load_safetensors(path, device=0, dtype=torch.float16)
    else:
        # A destination of a type the kernels do not write: refused, naming the casts.
        dst = {"bf16": torch.zeros(1 << 16, dtype=torch.float8_e4m3fn, device="cuda:0")}
        with pytest.raises(gpufeed.SafetensorError, match="casts on the way"):
            gpufeed.load_into(path, dst, strict=False)
