"""gpufeed's drop-in safetensors API on a GPU, against safetensors >= 0.9.0rc1 bit for bit:
``gpufeed.safe_open`` with ``device="cuda:0"``, ``0``, ``"cuda"`` and ``torch.device("cuda:0")``
(every dtype torch has, odd shapes, misaligned tensors, a sharded index), ``get_slice`` on the GPU,
``gpufeed.torch.load_file`` to the GPU, ``prefetch()`` (names, len, take once, iteration, row
plans against safetensors' ``get_slice(name)[rows]``, refused plans, close mid-stream), tensors
that outlive their handle and loader, and a file replaced or truncated during a sweep: loaded
from the original version or an error naming the file, never mixed bytes.

Skipped (with the reason) without torch or a GPU, unless ``GPUFEED_REQUIRE_GPU=1`` (the GPU
machine), where that is a failure; safetensors missing (or older than 0.9.0rc1) likewise. What
the module does without a GPU is in test_safe_open.py. Runs under pytest, or alone:
``python3 test_safe_open_gpu.py``."""

import collections
import gc
import hashlib
import importlib
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading

import gpufeed

REQUIRED = os.environ.get("GPUFEED_REQUIRE_GPU") == "1"


class Skip(Exception):
    pass


def skip(reason):
    """A skip with ``reason`` (a failure where the GPU is required)."""
    if REQUIRED:
        raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {reason}")
    try:
        import pytest

        pytest.skip(reason)
    except ImportError:
        raise Skip(reason)


def torch_on_gpu():
    """torch, or a skip (a failure where the GPU is required)."""
    try:
        import torch
    except ImportError as e:
        reason = f"torch is not installed ({e})"
    else:
        if torch.cuda.is_available():
            return torch
        reason = "torch sees no CUDA device"
    skip(reason)


def safetensors_own():
    """safetensors' own ``safe_open`` (>= 0.9.0rc1, unpatched), or a skip as for the GPU."""
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
        from safetensors import _safetensors_rust
    except ImportError as e:
        skip(f"safetensors is not installed ({e})")
    if not hasattr(_safetensors_rust.safe_open, "get_tensor_meta"):
        skip(f"safetensors {safetensors.__version__} is older than 0.9.0rc1")
    own = _OWN.setdefault("safe_open", _safetensors_rust.safe_open)
    if safetensors.safe_open is not own:
        gpufeed.unpatch_safetensors()  # GPUFEED_PATCH_SAFETENSORS=1: compare with the real one
    assert safetensors.safe_open is own, "safetensors stays patched"
    return own


# safetensors' own safe_open, kept where a patch that rewrites module attributes does not reach
_OWN = {}


def gtorch():
    return importlib.import_module("gpufeed.torch")


DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "float8_e4m3fn",
          "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
          "float4_e2m1fn_x2"]
SHAPES = [(), (0,), (3, 0, 5), (7, 13), (1, 1, 1, 1, 5), (257, 3)]
DEVICES = ["cuda:0", 0, "cuda", "torch.device('cuda:0')"]


def devices(torch):
    return [torch.device("cuda:0") if d == "torch.device('cuda:0')" else d for d in DEVICES]


def element_size(torch, dtype):
    return torch.empty(0, dtype=dtype).element_size()


def random_tensor(torch, dtype, shape, gen):
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included); a bool is 0 or 1."""
    nbytes = math.prod(shape) * element_size(torch, dtype)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def raw_bytes(torch, t):
    """``t``'s elements as bytes in order, on the CPU (strided views too)."""
    t = t.detach()
    if t.device.type != "cpu":
        torch.cuda.synchronize(t.device)
        t = t.cpu()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    same_size = t.view(ints[t.element_size()])
    flat = torch.empty(t.numel(), dtype=same_size.dtype)
    flat.copy_(same_size.reshape(-1))
    return flat.view(torch.uint8)


def assert_same(torch, got, want, what, device="cuda:0"):
    """``got``: a tensor on ``device`` with ``want``'s dtype, shape and bytes."""
    assert isinstance(got, torch.Tensor), f"{what}: a {type(got).__name__}, not a torch.Tensor"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, safetensors gives {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), \
        f"{what}: shape {tuple(got.shape)}, safetensors gives {tuple(want.shape)}"
    assert got.device == torch.device(device), f"{what}: on {got.device}, not {device}"
    a, b = raw_bytes(torch, got), raw_bytes(torch, want)
    if not torch.equal(a, b):
        first = int((a != b).nonzero()[0])
        raise AssertionError(f"{what}: bytes differ from safetensors' (first at byte {first} "
                             f"of {a.numel()})")


def assert_same_dict(torch, got, want, what, device="cuda:0"):
    assert isinstance(got, dict), f"{what}: a {type(got).__name__}, not a dict"
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_same(torch, got[name], want[name], f"{what}[{name!r}]", device)


def raises(call, *texts, what, types=None):
    """``call()`` raises a ``gpufeed.SafetensorError`` (or one of ``types``) whose message holds
    every one of ``texts``; returns the exception."""
    types = types or (gpufeed.SafetensorError,)
    try:
        call()
    except types as e:
        for t in texts:
            assert t in str(e), f"{what}: {type(e).__name__}({str(e)!r}) does not say {t!r}"
        return e
    except BaseException as e:
        if type(e).__name__ in ("Skipped", "Skip", "KeyboardInterrupt"):
            raise
        raise AssertionError(f"{what}: raised {type(e).__name__}({e}), not one of "
                             f"{[t.__name__ for t in types]}") from e
    raise AssertionError(f"{what}: no error")


def meta_of(meta):
    return meta.dtype, list(meta.shape), tuple(meta.data_offsets)


def reference(st_open, path):
    """What safetensors' own safe_open says about ``path``, on the CPU; full slices of all but
    packed F4 tensors (safetensors' own get_slice cannot cut those)."""
    with st_open(path, framework="pt", device="cpu") as f:
        ref = {"keys": f.keys(), "offset_keys": f.offset_keys(), "metadata": f.metadata(),
               "tensors": {n: f.get_tensor(n) for n in f.keys()},
               "metas": {n: meta_of(f.get_tensor_meta(n)) for n in f.keys()},
               "slice_info": {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype())
                              for n in f.keys()}}
        ref["full_slices"] = {n: f.get_slice(n)[...] for n in f.keys()
                              if f.get_tensor_meta(n).dtype != "F4"}
    return ref


def merge(refs):
    """One reference for the shards of an index."""
    out = {"keys": sorted(n for r in refs for n in r["keys"]), "tensors": {}, "metas": {},
           "slice_info": {}, "full_slices": {}}
    for r in refs:
        for k in ("tensors", "metas", "slice_info", "full_slices"):
            out[k].update(r.get(k, {}))
    return out


def check_handle(torch, f, ref, what, sharded=False):
    assert f.keys() == ref["keys"], f"{what}: keys() {f.keys()}"
    order = f.offset_keys()
    assert sorted(order) == ref["keys"], f"{what}: offset_keys() {order}"
    if not sharded:
        offsets = [ref["metas"][n][2] for n in order]
        assert offsets == sorted(offsets), f"{what}: offset_keys() not by offset: {order}"
        assert f.metadata() == ref["metadata"], f"{what}: metadata() {f.metadata()!r}"
    for name in ref["keys"]:
        assert meta_of(f.get_tensor_meta(name)) == ref["metas"][name], f"{what}: meta {name}"
        s = f.get_slice(name)
        assert (s.get_shape(), s.get_dtype()) == ref["slice_info"][name], f"{what}: {name}"
    for name in reversed(ref["keys"]):
        assert_same(torch, f.get_tensor(name), ref["tensors"][name],
                    f"{what}: get_tensor({name!r})")
    for name in ref["keys"][:2]:
        # Asked again: the same values, in memory of its own on a GPU (as safetensors gives).
        again = f.get_tensor(name)
        assert_same(torch, again, ref["tensors"][name], f"{what}: get_tensor({name!r}) again")
        if again.is_cuda and again.numel():
            assert again.data_ptr() != f.get_tensor(name).data_ptr(), f"{what}: {name} shared"
    for name, want in ref["full_slices"].items():
        assert_same(torch, f.get_slice(name)[...], want, f"{what}: get_slice({name!r})[...]")
    assert_same_dict(torch, f.get_tensors(), ref["tensors"], f"{what}: get_tensors()")


def write_raw(path, entries):
    """A safetensors file by hand: (name, dtype, shape, bytes) in order, unaligned, the header
    unpadded."""
    header, offset = {}, 0
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(e[3] for e in entries))


def misaligned_file(torch, path, gen):
    """F32 / F64 / BF16 / I64 / C64 / I16 tensors each at an odd offset (save_file aligns)."""
    wide = [("b_f32", "F32", torch.float32, (7, 13)), ("d_f64", "F64", torch.float64, (31,)),
            ("f_bf16", "BF16", torch.bfloat16, (5, 3)), ("g_i64", "I64", torch.int64, (3, 3)),
            ("i_c64", "C64", torch.complex64, (4,)), ("j_i16", "I16", torch.int16, (9,)),
            ("k_f32", "F32", torch.float32, (11, 37))]
    entries, offset = [], 0
    for name, st_dtype, dtype, shape in wide:
        pad = 1 if offset % 2 == 0 else 2
        entries.append((f"{name[0]}_pad", "U8", [pad], bytes(range(7, 7 + pad))))
        blob = bytes(random_tensor(torch, dtype, shape, gen).reshape(-1).view(torch.uint8).tolist())
        entries.append((name, st_dtype, list(shape), blob))
        offset += pad + len(blob)
    write_raw(path, entries)
    return [w[0] for w in wide]


def checkpoint(torch, directory, gen):
    """Every dtype this torch has, in odd shapes, as one file, a misaligned file, and two shards
    with an index."""
    from safetensors.torch import save_file

    tensors = {}
    for i, name in enumerate(DTYPES):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        for j, shape in enumerate(SHAPES):
            if name == "float4_e2m1fn_x2" and shape == ():
                continue  # safetensors cannot write a 0-d packed F4
            tensors[f"{name}.t{j}"] = random_tensor(torch, dtype, shape, gen)
    single = os.path.join(directory, "model.safetensors")
    save_file(tensors, single, metadata={"format": "pt"})
    names = sorted(tensors)
    weight_map = {}
    for k in range(2):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names[k::2]}, os.path.join(directory, file))
        weight_map.update({n: file for n in names[k::2]})
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    misaligned = os.path.join(directory, "misaligned.safetensors")
    misaligned_file(torch, misaligned, gen)
    shards = [os.path.join(directory, f) for f in sorted(set(weight_map.values()))]
    return single, index, shards, misaligned


def rows_file(torch, path, gen):
    """2-d, 1-d and 3-d tensors of several dtypes for row plans, and a 0-d one."""
    from safetensors.torch import save_file

    tensors = {"w_f32": random_tensor(torch, torch.float32, (11, 7), gen),
               "w_bf16": random_tensor(torch, torch.bfloat16, (11, 5), gen),
               "w_i8": random_tensor(torch, torch.int8, (11, 3), gen),
               "w_bool": random_tensor(torch, torch.bool, (11, 2), gen),
               "v_f64": random_tensor(torch, torch.float64, (13,), gen),
               "c_f16": random_tensor(torch, torch.float16, (6, 4, 3), gen),
               "empty": random_tensor(torch, torch.float32, (0, 4), gen),
               "scalar": random_tensor(torch, torch.float32, (), gen)}
    save_file(tensors, path)
    return tensors


def generator(torch, seed=938):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------


def test_every_device_spelling_equals_safetensors_bit_for_bit():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    import safetensors.torch

    with tempfile.TemporaryDirectory() as d:
        single, index, shards, misaligned = checkpoint(torch, d, generator(torch))
        ref = reference(st_open, single)
        ref_mis = reference(st_open, misaligned)
        ref_index = merge([reference(st_open, s) for s in shards])
        for device in devices(torch):
            for path, r, sharded in ((single, ref, False), (misaligned, ref_mis, False),
                                     (index, ref_index, True)):
                what = f"{os.path.basename(path)}, device={device!r}"
                with gpufeed.safe_open(path, framework="pt", device=device) as f:
                    check_handle(torch, f, r, what, sharded=sharded)
                assert_same_dict(torch, gtorch().load_file(path, device=device), r["tensors"],
                                 f"gpufeed.torch.load_file({what})")
            # safetensors' own load_file takes a str or an int, not a torch.device
            st_device = str(device) if isinstance(device, torch.device) else device
            assert_same_dict(torch, gtorch().load_file(single, device=device),
                             safetensors.torch.load_file(single, device=st_device),
                             f"load_file against safetensors' on the GPU, device={device!r}")
        with gpufeed.safe_open(single, device="cuda:0", backend="pread") as f:
            check_handle(torch, f, ref, "backend='pread'")


INDEXES = [
    0, 3, -1, -7, slice(None), slice(1, 3), slice(2, None), slice(None, 4), slice(-3, None),
    slice(None, -2), slice(None, None, 2), slice(1, 6, 3), slice(5, 100), slice(3, 1),
    Ellipsis, (), (0,), (2, 1), (-1, -1, -1), (slice(1, 5, 3), -2, slice(None, None, 2)),
    (Ellipsis, 1), (1, Ellipsis), (1, Ellipsis, 2), (Ellipsis, slice(1, 3)),
    (slice(None), slice(3, 1)), (slice(None), 0, slice(1, None, 4)), (slice(0, 0),),
]
BAD_INDEXES = [7, -8, (0, 0, 0, 0), slice(None, None, -1), slice(None, None, 0)]


def test_get_slice_on_the_gpu_equals_safetensors_moved_there():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    from safetensors.torch import save_file

    gen = generator(torch, 5)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "slices.safetensors")
        save_file({"x": random_tensor(torch, torch.float32, (7, 13, 5), gen),
                   "m": random_tensor(torch, torch.bfloat16, (4, 6), gen),
                   "v": random_tensor(torch, torch.int64, (11,), gen),
                   "b": random_tensor(torch, torch.bool, (5, 4, 3), gen),
                   "e": random_tensor(torch, torch.float16, (3, 0, 5), gen)}, path)
        misaligned = os.path.join(d, "misaligned.safetensors")
        odd = misaligned_file(torch, misaligned, gen)
        compared = 0
        for p, names in ((path, ["x", "m", "v", "b", "e"]), (misaligned, odd)):
            with st_open(p, framework="pt") as ref, gpufeed.safe_open(p, device="cuda:0") as f:
                for name in names:
                    r, s = ref.get_slice(name), f.get_slice(name)
                    for index in INDEXES + BAD_INDEXES:
                        what = f"get_slice({name!r})[{index!r}] on cuda:0"
                        try:
                            want = r[index]
                        except Exception:  # noqa: BLE001 (safetensors refuses: so must gpufeed)
                            try:
                                s[index]
                            except Exception:  # noqa: BLE001
                                continue
                            raise AssertionError(f"{what}: safetensors refuses it, gpufeed not")
                        assert_same(torch, s[index], want.to("cuda:0"), what)
                        compared += 1
        assert compared > 150, compared
        # Slices taken in a `with` block read after it, as safetensors' do.
        with st_open(path, framework="pt") as ref:
            want = {n: ref.get_slice(n) for n in ("x", "m")}
        with gpufeed.safe_open(path, device="cuda:0") as f:
            kept = {n: f.get_slice(n) for n in ("x", "m")}
        for name, index in (("x", (slice(1, 3), slice(None), 2)), ("m", (Ellipsis, slice(2, 5)))):
            assert_same(torch, kept[name][index], want[name][index].to("cuda:0"),
                        f"get_slice({name!r})[{index!r}] on cuda:0 after close")


def test_prefetch_names_len_take_once_and_iteration():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    with tempfile.TemporaryDirectory() as d:
        single, _, _, misaligned = checkpoint(torch, d, generator(torch, 7))
        for path in (single, misaligned):
            ref = reference(st_open, path)
            want = ref["tensors"]
            for opened, kwargs in ((dict(device="cpu"), dict(device="cuda:0")),
                                   (dict(device=0), {}),
                                   (dict(device="cuda:0"), dict(device=0, threads=1)),
                                   (dict(), dict(device=torch.device("cuda:0"), threads=3))):
                what = f"{os.path.basename(path)}: safe_open({opened}).prefetch({kwargs})"
                with gpufeed.safe_open(path, **opened) as f:
                    loader = f.prefetch(**kwargs)
                    with loader:
                        assert sorted(loader.names()) == ref["keys"], f"{what}: names()"
                        assert len(loader) == len(want), f"{what}: len()"
                        first = ref["offset_keys"][-1]
                        taken = {first: loader.take(first)}
                        raises(lambda: loader.take(first), what=f"{what}: a second take")
                        raises(lambda: loader.take("nope"), "nope", what=f"{what}: take('nope')")
                        seen = collections.Counter()
                        # Inside the loop, a take of a tensor the iteration has not reached
                        # (it may have landed already): handed out once, by the take.
                        inner = ref["offset_keys"][len(want) // 2]
                        for name, t in loader:
                            seen[name] += 1
                            taken[name] = t
                            if inner not in taken:
                                taken[inner] = loader.take(inner)
                        assert all(c == 1 for c in seen.values()), f"{what}: {seen}"
                        assert first not in seen, f"{what}: iteration gave a taken tensor"
                        if inner != ref["offset_keys"][0]:
                            assert inner not in seen, f"{what}: iteration gave {inner}, taken"
                        assert sorted(taken) == ref["keys"], f"{what}: {sorted(taken)}"
                        assert list(loader) == [], f"{what}: a second pass found tensors"
                    assert_same_dict(torch, taken, want, what)
                    # the handle is unchanged next to its loaders
                    assert f.keys() == ref["keys"], what


def test_prefetch_plans_of_rows_equal_safetensors_get_slice():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.safetensors")
        tensors = rows_file(torch, path, generator(torch, 11))
        sliced = [n for n in tensors if n != "scalar"]
        with st_open(path, framework="pt") as ref, gpufeed.safe_open(path) as f:
            for rows in (None, slice(2, 5), slice(0, 0), slice(None, 3), slice(0, None),
                         slice(None, None), slice(1, 2)):
                names = [n for n in sliced if n != "empty" or rows in (None, slice(0, 0),
                                                                       slice(0, None),
                                                                       slice(None, None))]
                plan = {n: rows for n in names}
                if rows is None:
                    plan["scalar"] = None
                what = f"prefetch plan rows={rows!r}"
                with f.prefetch(plan, device="cuda:0") as loader:
                    assert sorted(loader.names()) == sorted(plan), f"{what}: names()"
                    assert len(loader) == len(plan), f"{what}: len()"
                    got = {n: loader.take(n) for n in plan}
                for n in plan:
                    want = ref.get_tensor(n) if rows is None else ref.get_slice(n)[rows]
                    assert_same(torch, got[n], want.to("cuda:0"), f"{what}: {n}")
            # a plan of some tensors: the others are not the loader's
            with f.prefetch({"w_f32": slice(2, 5)}, device=0) as loader:
                assert loader.names() == ["w_f32"]
                raises(lambda: loader.take("w_bf16"), what="take of a tensor not in the plan")
                assert_same(torch, loader.take("w_f32"), ref.get_slice("w_f32")[2:5].cuda(),
                            "a one-tensor plan")


def test_prefetch_refuses_bad_plans():
    torch = torch_on_gpu()
    safetensors_own()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.safetensors")
        tensors = rows_file(torch, path, generator(torch, 13))
        with gpufeed.safe_open(path) as f:
            for plan, why in (
                ({"w_f32": slice(0, 12)}, "rows past the end (slice(0, rows + 1))"),
                ({"v_f64": slice(0, 14)}, "rows past the end of a 1-d tensor"),
                ({"w_f32": slice(5, 13)}, "a stop past the end"),
                ({"w_f32": slice(0, 6, 2)}, "step 2"),
                ({"w_f32": slice(None, None, 2)}, "step 2, open bounds"),
                ({"w_f32": slice(0, 3, 0)}, "step 0"),
                ({"scalar": slice(0, 1)}, "a slice of a 0-d tensor"),
                ({"nope": None}, "an unknown name"),
            ):
                def start():
                    with f.prefetch(plan, device="cuda:0") as loader:
                        for name in plan:
                            loader.take(name)

                raises(start, what=f"prefetch of {why}: {plan}")
            # the handle still works after the refusals
            with f.prefetch({"w_f32": slice(0, 11)}, device="cuda:0") as loader:
                assert_same(torch, loader.take("w_f32"), tensors["w_f32"], "all rows")


def test_close_mid_stream_then_take_raises_and_taken_tensors_stay_valid():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    from safetensors.torch import save_file

    gen = generator(torch, 17)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "stream.safetensors")
        tensors = {f"layer.{i:02}": random_tensor(torch, torch.bfloat16, (257, 129 + i), gen)
                   for i in range(32)}
        save_file(tensors, path)
        want = reference(st_open, path)["tensors"]
        f = gpufeed.safe_open(path, device="cuda:0")
        loader = f.prefetch()
        stream = iter(loader)
        kept = dict([next(stream), next(stream)])
        extra = next(n for n in sorted(tensors, reverse=True) if n not in kept)
        kept[extra] = loader.take(extra)
        loader.close()
        left = [n for n in tensors if n not in kept]
        raises(lambda: loader.take(left[0]), what="take after close")
        try:
            after = [name for name, _ in stream]
        except gpufeed.SafetensorError:
            after = []
        assert after == [], f"the closed loader still gave {after}"
        loader.close()  # a second close is harmless
        del loader, stream
        f.close()
        del f
        gc.collect()
        # other loads reuse what the closed loader gave back
        with gpufeed.safe_open(path, device="cuda:0") as g, g.prefetch() as other:
            dict(other)
        filler = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        for name, t in kept.items():
            assert_same(torch, t, want[name], f"{name}, taken before close")
        del filler


def test_tensors_outlive_the_handle_and_the_loader():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    with tempfile.TemporaryDirectory() as d:
        single, index, _, misaligned = checkpoint(torch, d, generator(torch, 19))
        want = reference(st_open, single)["tensors"]
        with gpufeed.safe_open(single, device="cuda:0") as f:
            got = {n: f.get_tensor(n) for n in f.keys()}
            many = f.get_tensors()
            loader = f.prefetch()
            first = loader.names()[0]
            streamed = {first: loader.take(first)}
        del f
        gc.collect()
        streamed.update(dict(loader))  # the loader outlives its handle
        loader.close()
        del loader
        dropped = gpufeed.safe_open(single, device=0).prefetch()  # its handle dropped at once
        gc.collect()
        streamed_dropped = dict(dropped)
        del dropped
        loaded = gtorch().load_file(index, device="cuda:0")
        gc.collect()
        with gpufeed.safe_open(misaligned, device="cuda:0") as g, g.prefetch() as other:
            dict(other)
        torch.cuda.synchronize()
        for what, tensors in (("get_tensor", got), ("get_tensors", many),
                              ("prefetch", streamed), ("a prefetch of a dropped handle",
                                                       streamed_dropped),
                              ("load_file of the index", loaded)):
            assert_same_dict(torch, tensors, want, f"{what}, after the handle and loader went")
        os.remove(single)
        gc.collect()
        assert_same_dict(torch, got, want, "after the file was removed")


def test_handles_of_one_file_sweep_it_at_once_and_again():
    """Handles of one file share its parsed header and their view of its tensors: two handles
    sweeping it at once from two threads, a third opened after their sweeps started, a shard
    opened alone after its index, and each again, give safetensors' tensors bit for bit."""
    torch = torch_on_gpu()
    st_open = safetensors_own()
    with tempfile.TemporaryDirectory() as d:
        single, index, shards, _ = checkpoint(torch, d, generator(torch, 23))
        want = reference(st_open, single)["tensors"]
        for rounds in range(2):
            with gpufeed.safe_open(single, device="cuda:0") as f, \
                    gpufeed.safe_open(single, device="cuda:0") as g:
                got, errors = {}, []

                def sweep(h, tag):
                    try:
                        got[tag] = {n: h.get_tensor(n) for n in h.keys()}
                    except BaseException as e:  # noqa: BLE001 (reported below)
                        errors.append(e)

                threads = [threading.Thread(target=sweep, args=(h, tag))
                           for h, tag in ((f, "f"), (g, "g"))]
                for t in threads:
                    t.start()
                with gpufeed.safe_open(single, device="cuda:0") as h:
                    got["h"] = {n: h.get_tensor(n) for n in reversed(h.keys())}
                for t in threads:
                    t.join(timeout=120)
                assert not errors, errors
            torch.cuda.synchronize()
            for tag in ("f", "g", "h"):
                assert_same_dict(torch, got[tag], want, f"round {rounds}: handle {tag}")
        whole = {}
        for shard in shards:
            whole.update(reference(st_open, shard)["tensors"])
        with gpufeed.safe_open(index, device="cuda:0") as f:
            assert_same_dict(torch, {n: f.get_tensor(n) for n in f.keys()}, whole, "the index")
        for shard in shards:
            with gpufeed.safe_open(shard, device="cuda:0") as f:
                alone = {n: f.get_tensor(n) for n in f.keys()}
            assert_same_dict(torch, alone, {n: whole[n] for n in alone},
                             f"{os.path.basename(shard)} alone, after its index")


def _same_header_files(torch, directory, gen, count=24):
    """The original file and a replacement of the same header (names, dtypes, shapes) but other
    bytes; the original's copy to compare with."""
    from safetensors.torch import save_file

    names = [f"t{i:02}" for i in range(count)]
    old = {n: random_tensor(torch, torch.float32, (97, 131 + (i % 3)), gen)
           for i, n in enumerate(names)}
    new = {n: random_tensor(torch, torch.float32, tuple(t.shape), gen) for n, t in old.items()}
    path = os.path.join(directory, "model.safetensors")
    replacement = os.path.join(directory, "replacement.safetensors")
    save_file(old, path)
    save_file(new, replacement)
    with open(path, "rb") as a, open(replacement, "rb") as b:
        n = struct.unpack("<Q", a.read(8))[0]
        assert b.read(8) == struct.pack("<Q", n) and a.read(n) == b.read(n), "same header"
    return names, old, new, path, replacement


def _original_or_named_error(torch, got, error, old, what):
    for n, t in got.items():
        assert_same(torch, t, old[n], f"{what}: {n} (the original's bytes)")
    if error is not None:
        assert "model.safetensors" in str(error), f"{what}: the error does not name the file: " \
                                                  f"{error}"


def test_a_file_replaced_during_a_sweep_is_the_original_or_an_error():
    """os.replace of another file (same header, other bytes) onto the path during a get_tensor
    sweep, during a prefetch, and between opening the handle and starting its prefetch: every
    tensor given is the original's, or an error names the file; never the new bytes, nor a
    mix."""
    torch = torch_on_gpu()
    safetensors_own()
    gen = generator(torch, 23)
    for mode in ("get_tensor", "get_tensor, pread", "prefetch", "prefetch started after"):
        with tempfile.TemporaryDirectory() as d:
            names, old, new, path, replacement = _same_header_files(torch, d, gen)
            got, error = {}, None
            backend = "pread" if "pread" in mode else "mmap"
            with gpufeed.safe_open(path, device="cuda:0", backend=backend) as f:
                try:
                    if mode.startswith("get_tensor"):
                        got[names[0]] = f.get_tensor(names[0])
                        os.replace(replacement, path)
                        for n in names[1:]:
                            got[n] = f.get_tensor(n)
                        got.update(f.get_tensors())
                    elif mode == "prefetch":
                        with f.prefetch() as loader:
                            got[names[0]] = loader.take(names[0])
                            os.replace(replacement, path)
                            got.update(dict(loader))
                    else:
                        os.replace(replacement, path)
                        with f.prefetch() as loader:
                            got.update(dict(loader))
                except gpufeed.GpufeedError as e:
                    error = e
            _original_or_named_error(torch, got, error, old, f"replaced during {mode}")
            with gpufeed.safe_open(path, device="cuda:0") as f:
                assert_same_dict(torch, f.get_tensors(), new, f"{mode}: a handle opened after")


def test_a_handle_reads_on_after_its_file_was_renamed_over_or_chmoded():
    """Between the open and the first CUDA read, the file chmoded and another renamed over its
    path (ctime changes, the opened version's bytes do not): get_tensor, get_tensors and a
    prefetch give the original's bytes, with no error (each load checks its own window)."""
    torch = torch_on_gpu()
    safetensors_own()
    gen = generator(torch, 29)
    for mode in ("get_tensor", "get_tensors", "prefetch"):
        with tempfile.TemporaryDirectory() as d:
            names, old, new, path, replacement = _same_header_files(torch, d, gen)
            with gpufeed.safe_open(path, device="cuda:0") as f:
                os.chmod(path, 0o600)
                os.replace(replacement, path)
                if mode == "get_tensor":
                    got = {n: f.get_tensor(n) for n in names}
                elif mode == "get_tensors":
                    got = f.get_tensors()
                else:
                    with f.prefetch() as loader:
                        got = dict(loader)
            assert_same_dict(torch, got, old, f"{mode} after a rename over the path")


TRUNCATION_CHILD = r"""
import hashlib, json, os, sys
import torch
import gpufeed

path, mode, expected = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
names = sorted(expected)

def digest(t):
    torch.cuda.synchronize()
    flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

out = {"tensors": {}, "error": None}
try:
    with gpufeed.safe_open(path, device="cuda:0") as f:
        if mode == "get_tensor":
            out["tensors"][names[0]] = digest(f.get_tensor(names[0]))
            os.truncate(path, os.path.getsize(path) // 2)
            for n in names[1:]:
                out["tensors"][n] = digest(f.get_tensor(n))
        else:
            with f.prefetch() as loader:
                out["tensors"][names[0]] = digest(loader.take(names[0]))
                os.truncate(path, os.path.getsize(path) // 2)
                for n, t in loader:
                    out["tensors"][n] = digest(t)
except gpufeed.GpufeedError as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_file_truncated_during_a_sweep_is_the_original_or_an_error():
    """The file cut to half its length during a get_tensor sweep and during a prefetch, in a
    child process (a crash, e.g. SIGBUS from a mapping, fails here instead of ending pytest):
    every tensor given is the original's, or an error names the file."""
    torch = torch_on_gpu()
    safetensors_own()
    gen = generator(torch, 29)
    for mode in ("get_tensor", "prefetch"):
        with tempfile.TemporaryDirectory() as d:
            names, old, _, path, _ = _same_header_files(torch, d, gen, count=48)
            expected = {n: hashlib.sha256(raw_bytes(torch, t).numpy().tobytes()).hexdigest()
                        for n, t in old.items()}
            result = subprocess.run(
                [sys.executable, "-c", TRUNCATION_CHILD, path, mode, json.dumps(expected)],
                capture_output=True, text=True, timeout=300)
            lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
            code = result.returncode
            died = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
            assert code == 0 and lines, (
                f"truncated during {mode}: the child exited with {code}{died}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
            out = json.loads(lines[-1][len("RESULT "):])
            for n, h in out["tensors"].items():
                assert h == expected[n], f"truncated during {mode}: {n} is not the original's"
            if out["error"] is not None:
                assert "model.safetensors" in out["error"], \
                    f"truncated during {mode}: the error does not name the file: {out['error']}"
            else:
                assert sorted(out["tensors"]) == sorted(expected), \
                    f"truncated during {mode}: no error, yet tensors are missing"


def test_patched_safetensors_loads_to_the_gpu():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    import safetensors
    import safetensors.torch

    with tempfile.TemporaryDirectory() as d:
        single, _, _, _ = checkpoint(torch, d, generator(torch, 31))
        want = reference(st_open, single)["tensors"]
        try:
            gpufeed.patch_safetensors()
            with safetensors.safe_open(single, framework="pt", device="cuda:0") as f:
                assert type(f).__module__.startswith("gpufeed"), type(f)
                got = {n: f.get_tensor(n) for n in f.keys()}
            loaded = safetensors.torch.load_file(single, device="cuda:0")
        finally:
            gpufeed.unpatch_safetensors()
        assert_same_dict(torch, got, want, "patched safe_open on cuda:0")
        assert_same_dict(torch, loaded, want, "patched load_file on cuda:0")


def test_a_device_other_than_torchs_current_one():
    torch = torch_on_gpu()
    st_open = safetensors_own()
    if torch.cuda.device_count() < 2:
        reason = "one GPU: no other device to load onto"
        try:
            import pytest

            pytest.skip(reason)
        except ImportError:
            raise Skip(reason)
    with tempfile.TemporaryDirectory() as d:
        single, _, _, _ = checkpoint(torch, d, generator(torch, 37))
        want = reference(st_open, single)["tensors"]
        torch.cuda.set_device(0)
        for device in ("cuda:1", 1, torch.device("cuda:1")):
            with gpufeed.safe_open(single, device=device) as f:
                assert_same_dict(torch, f.get_tensors(), want, f"device={device!r}", "cuda:1")
                with f.prefetch() as loader:
                    assert_same_dict(torch, dict(loader), want, "prefetch to cuda:1", "cuda:1")
        with gpufeed.safe_open(single) as f, f.prefetch(device=1) as loader:
            assert_same_dict(torch, dict(loader), want, "prefetch(device=1)", "cuda:1")
        assert torch.cuda.current_device() == 0


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except BaseException as e:  # noqa: BLE001 (report each, then the exit code)
                if isinstance(e, Skip) or type(e).__name__ == "Skipped":  # pytest's skip
                    print(f"SKIP {name}: {e}")
                    continue
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)


def test_taking_a_landed_tensor_mid_iteration_loses_nothing():
    """Iterate, then ``take`` tensors the iteration has received but not yet yielded (and
    others), then iterate on: every tensor exactly once, bit for bit; ``get_tensor`` from
    several threads at once likewise."""
    import threading

    torch = torch_on_gpu()
    st_open = safetensors_own()
    from safetensors.torch import save_file

    gen = generator(torch, 23)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mix.safetensors")
        tensors = {f"t.{i:03}": random_tensor(torch, torch.float16, (97, 61 + i), gen)
                   for i in range(96)}
        save_file(tensors, path)
        want = reference(st_open, path)["tensors"]
        with gpufeed.safe_open(path, device="cuda:0") as f, f.prefetch() as loader:
            stream = iter(loader)
            got = dict([next(stream)])
            names = loader.names()
            for name in (names[1], names[-1], names[len(names) // 2]):
                if name not in got:
                    got[name] = loader.take(name)
            for name, t in stream:
                assert name not in got, f"{name} handed out twice"
                got[name] = t
            assert sorted(got) == sorted(tensors), "every tensor once"
            for name, t in got.items():
                assert_same(torch, t, want[name], f"{name}, taken or iterated")
        with gpufeed.safe_open(path, device="cuda:0") as f:
            out, errors = {}, []

            def work(part):
                try:
                    for n in part:
                        out[n] = f.get_tensor(n)
                except Exception as e:  # noqa: BLE001 (reported below)
                    errors.append(repr(e))

            keys = f.keys()
            threads = [threading.Thread(target=work, args=(keys[k::4],)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not errors, errors
            assert sorted(out) == sorted(tensors)
            for name, t in out.items():
                assert_same(torch, t, want[name], f"{name}, from a thread")


_KEEP_CHILD = r"""
import json, sys, time
import torch, gpufeed
from safetensors.torch import save_file

path, sleep = sys.argv[1], float(sys.argv[2])
g = torch.Generator().manual_seed(5)
tensors = {f"t{i:02}": torch.randn(1000 + 37 * i, 1031, generator=g) for i in range(24)}
save_file(tensors, path)
want = {k: v.cuda() for k, v in tensors.items()}
size = sum(v.numel() * 4 for v in tensors.values())
wait = gpufeed._gpufeed._wait_for_frees


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch's own cache (the comparisons' temporaries) aside
    return torch.cuda.mem_get_info(0)[0]


def load(method):
    with gpufeed.safe_open(path, framework="pt", device="cuda:0") as f:
        if method == "prefetch":
            return dict(f.prefetch())
        return {k: f.get_tensor(k) for k in f.keys()}


def same(got, names=None):
    names = sorted(want) if names is None else names
    return sorted(got) == names and all(
        torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in names)


# What the first load and comparison make for good (the loader's resources, the code of
# torch's kernels, loaded on first use) is not what is measured.
first = load("prefetch")
assert same(first)
del first
wait()
gpufeed.empty_cache()
start = free()
out = {"size": size}
for method in ("prefetch", "get_tensor"):
    a = load(method)
    r = {"first": same(a), "ptrs_a": sorted(t.data_ptr() for t in a.values())}
    del a
    wait()
    r["kept"] = start - free()
    b = load(method)
    r["again"] = same(b)
    r["ptrs_b"] = sorted(t.data_ptr() for t in b.values())
    held = b.pop("t03")
    del b
    wait()
    c = load(method)
    # the held tensor's chunk is never handed out again while it lives
    r["held_intact"] = same({"t03": held}, ["t03"])
    r["third"] = same(c)
    r["held_shared"] = held.data_ptr() in {t.data_ptr() for t in c.values()}
    del c, held
    wait()
    out[method] = r
time.sleep(sleep)
out["released"] = gpufeed.empty_cache()
out["left"] = start - free()
print(json.dumps(out))
"""


def _keep_child(path, keep_ms, sleep=0.0):
    env = dict(os.environ)
    env.pop("GPUFEED_KEEP_FREED_MS", None)
    if keep_ms is not None:
        env["GPUFEED_KEEP_FREED_MS"] = str(keep_ms)
    env.pop("GPUFEED_PATCH_SAFETENSORS", None)
    run = subprocess.run([sys.executable, "-c", _KEEP_CHILD, path, str(sleep)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"child failed ({keep_ms} ms):\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_chunks_let_go_are_kept_for_the_next_load_and_given_back():
    """A reload in one process reuses the chunks the last load let go (the same addresses,
    the bytes filled anew and equal), a chunk still held by a tensor is never handed out
    again, and what is kept goes back to the device by ``gpufeed.empty_cache()``, after
    ``GPUFEED_KEEP_FREED_MS`` on its own, or at once where that is 0."""
    torch_on_gpu()
    safetensors_own()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "keep.safetensors")
        for keep_ms, sleep in ((None, 0.0), (0, 0.0), (300, 1.5)):
            got = _keep_child(path, keep_ms, sleep)
            size = got["size"]
            for method in ("prefetch", "get_tensor"):
                r, what = got[method], f"{method}, GPUFEED_KEEP_FREED_MS={keep_ms}"
                assert r["first"] and r["again"] and r["third"], f"{what}: other bytes: {r}"
                assert r["held_intact"], f"{what}: a held tensor was overwritten by a reload"
                assert not r["held_shared"], f"{what}: a held tensor's memory handed out again"
                if keep_ms == 0:
                    assert r["kept"] < 64 * mib, f"{what}: {r['kept'] // mib} MiB kept"
                else:
                    assert r["kept"] >= size * 9 // 10, (
                        f"{what}: {r['kept'] // mib} MiB of {size // mib} kept")
                    assert r["ptrs_b"] == r["ptrs_a"], f"{what}: the reload took new memory"
            if keep_ms is None:
                assert got["released"] >= size, f"empty_cache gave back {got['released']}"
            else:
                # 0: nothing kept; 300 ms: given back on its own during the 1.5 s sleep
                assert got["released"] == 0, f"{keep_ms} ms: {got['released']} still kept"
            assert got["left"] < 64 * mib, f"{keep_ms} ms: {got['left'] // mib} MiB not back"
