"""gpufeed's drop-in safetensors API on the CPU, against safetensors >= 0.9.0rc1 bit for bit:
``gpufeed.safe_open`` (keys, offset_keys, metadata, get_tensor_meta, get_tensor, get_tensors,
get_slice), ``gpufeed.torch.load_file`` / ``load``, sharded ``*.index.json`` checkpoints,
misaligned tensors, the errors (unknown names, missing files, corrupt headers, frameworks other
than torch), copy-on-write CPU tensors that outlive their handle, a file replaced under an open
handle, ``gpufeed.patch_safetensors()`` / ``unpatch_safetensors()`` and
``GPUFEED_PATCH_SAFETENSORS=1``; without a GPU, how CUDA requests fail.

Tensors are compared as bytes (NaN patterns included): each test writes random bytes, viewed as
the dtype, with ``safetensors.torch.save_file`` (or by hand where save_file cannot write the
layout), reads them back with safetensors' own ``safe_open`` and with gpufeed's. Skipped, with
the reason, without torch or safetensors. Run: ``pytest crates/gpufeed-py/tests``."""

import gc
import hashlib
import importlib
import json
import math
import os
import pathlib
import struct
import subprocess
import sys
import threading
import uuid
import warnings

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors", minversion="0.9.0rc1")

import safetensors.torch  # noqa: E402
from safetensors import _safetensors_rust  # noqa: E402

import gpufeed  # noqa: E402

# safetensors' own safe_open, whatever a patch does to the names in ``safetensors``: kept in a
# dict, since a patch rewrites the module attributes bound to it (this module's too).
_OWN = {"safe_open": _safetensors_rust.safe_open}
ST_ERROR = _safetensors_rust.SafetensorError


def ST_OPEN(*args, **kwargs):
    """safetensors' own safe_open(...)."""
    return _OWN["safe_open"](*args, **kwargs)


def is_st_own(obj):
    return obj is _OWN["safe_open"]

# Every dtype safetensors and torch share (torch name, safetensors name); a torch that lacks
# one skips its case.
DTYPES = [
    ("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("int16", "I16"), ("uint16", "U16"),
    ("int32", "I32"), ("uint32", "U32"), ("int64", "I64"), ("uint64", "U64"),
    ("float16", "F16"), ("bfloat16", "BF16"), ("float32", "F32"), ("float64", "F64"),
    ("complex64", "C64"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float4_e2m1fn_x2", "F4"),
]
# Odd shapes: 0-d, empty ones, a 2-d one and singleton dimensions; sizes in bytes that are not
# multiples of 4096 (257 x 3 and 1001 x 37 elements).
SHAPES = [(), (0,), (3, 0, 5), (7, 13), (1, 1, 1, 1, 5), (257, 3), (1001, 37)]
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# helpers


def gtorch():
    """``gpufeed.torch``, imported when a test needs it."""
    return importlib.import_module("gpufeed.torch")


def torch_dtype(name):
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch ({torch.__version__}) has no torch.{name}")
    return dtype


def element_size(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def random_tensor(dtype, shape, gen):
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included); a bool is 0 or 1."""
    nbytes = math.prod(shape) * element_size(dtype)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def raw_bytes(t):
    """``t``'s elements as bytes, in order (on the CPU): strided views too."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    same_size = t.view(INT_OF_SIZE[t.element_size()])
    flat = torch.empty(t.numel(), dtype=same_size.dtype)  # stride 1 (a size-1 view may not be)
    flat.copy_(same_size.reshape(-1))
    return flat.view(torch.uint8)


def assert_same(got, want, what, device="cpu"):
    """``got`` is a torch tensor on ``device`` of ``want``'s dtype, shape and bytes."""
    assert isinstance(got, torch.Tensor), f"{what}: a {type(got).__name__}, not a torch.Tensor"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, safetensors gives {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), \
        f"{what}: shape {tuple(got.shape)}, safetensors gives {tuple(want.shape)}"
    assert got.device == torch.device(device), f"{what}: on {got.device}, not {device}"
    a, b = raw_bytes(got), raw_bytes(want)
    if not torch.equal(a, b):
        first = int((a != b).nonzero()[0])
        raise AssertionError(f"{what}: bytes differ from safetensors' (first at byte {first} "
                             f"of {a.numel()}: {int(a[first])} against {int(b[first])})")


def assert_same_dict(got, want, what, device="cpu"):
    assert isinstance(got, dict), f"{what}: a {type(got).__name__}, not a dict"
    assert sorted(got) == sorted(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for name in want:
        assert_same(got[name], want[name], f"{what}[{name!r}]", device)


def meta_of(meta):
    """A TensorMeta as plain values, its types checked (dtype str, shape list, offsets tuple)."""
    assert isinstance(meta.dtype, str), f"TensorMeta.dtype is a {type(meta.dtype).__name__}"
    assert isinstance(meta.shape, list), f"TensorMeta.shape is a {type(meta.shape).__name__}"
    assert isinstance(meta.data_offsets, tuple), \
        f"TensorMeta.data_offsets is a {type(meta.data_offsets).__name__}"
    return meta.dtype, meta.shape, meta.data_offsets


def file_hash(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def reference(path, slices=True):
    """Everything safetensors' own safe_open says about ``path`` (on the CPU)."""
    with ST_OPEN(path, framework="pt", device="cpu") as f:
        ref = {
            "keys": f.keys(),
            "offset_keys": f.offset_keys(),
            "metadata": f.metadata(),
            "tensors": {n: f.get_tensor(n) for n in f.keys()},
            "metas": {n: meta_of(f.get_tensor_meta(n)) for n in f.keys()},
            "slice_info": {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype())
                           for n in f.keys()},
        }
        if slices:
            ref["full_slices"] = {n: f.get_slice(n)[...] for n in f.keys()}
    return ref


def assert_offset_order(order, ref, what):
    """``order`` is safetensors' offset_keys() but for the order among tensors at one offset
    (empty ones), which safetensors itself does not fix (its backends differ)."""
    assert sorted(order) == ref["keys"], f"{what}: offset_keys() {order} are not the keys"
    offsets = [ref["metas"][n][2] for n in order]
    assert offsets == sorted(offsets), f"{what}: offset_keys() {order} are not by offset"
    ties = {}
    for n in ref["offset_keys"]:
        ties.setdefault(ref["metas"][n][2], set()).add(n)
    if all(len(t) == 1 for t in ties.values()):
        assert order == ref["offset_keys"], f"{what}: offset_keys() {order}"


def check_handle(f, ref, what, device="cpu", slices=True):
    """A gpufeed handle answers as safetensors' did for the same file."""
    assert f.keys() == ref["keys"], f"{what}: keys() {f.keys()} != {ref['keys']}"
    assert_offset_order(f.offset_keys(), ref, what)
    assert f.metadata() == ref["metadata"], f"{what}: metadata() {f.metadata()!r}"
    for name in ref["keys"]:
        assert meta_of(f.get_tensor_meta(name)) == ref["metas"][name], \
            f"{what}: get_tensor_meta({name!r})"
        s = f.get_slice(name)
        assert (s.get_shape(), s.get_dtype()) == ref["slice_info"][name], \
            f"{what}: get_slice({name!r}).get_shape() / get_dtype()"
    for name in reversed(ref["offset_keys"]):  # not in file order
        t = f.get_tensor(name)
        assert_same(t, ref["tensors"][name], f"{what}: get_tensor({name!r})", device)
        assert t.is_contiguous(), f"{what}: get_tensor({name!r}) is not contiguous"
    if slices:
        for name in ref["keys"]:
            assert_same(f.get_slice(name)[...], ref["full_slices"][name],
                        f"{what}: get_slice({name!r})[...]", device)
    assert_same_dict(f.get_tensors(), ref["tensors"], f"{what}: get_tensors()", device)


def write_raw(path, entries, metadata=None):
    """A safetensors file written by hand, tensors in the order given with no alignment and no
    header padding: ``entries`` are (name, dtype string, shape, bytes)."""
    header = {"__metadata__": metadata} if metadata is not None else {}
    offset = 0
    for name, dtype, shape, blob in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(e[3] for e in entries))
    return 8 + len(text)  # where the data section starts


def raises_gpufeed_error(call, *texts, what, types=None):
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
        raise AssertionError(f"{what}: raised {type(e).__name__}({e}), not one of "
                             f"{[t.__name__ for t in types]}") from e
    raise AssertionError(f"{what}: no error")


def mixed_checkpoint(gen, count=12):
    """A few dtypes in odd shapes, names that do not sort as their file order."""
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16,
             torch.int8, torch.float64, torch.bool]
    shapes = [(33, 7), (1,), (), (0, 5), (13, 17, 3), (1001,), (2, 1, 9)]
    return {f"model.layers.{(i * 7) % count}.w{i}": random_tensor(kinds[i % len(kinds)],
                                                                  shapes[i % len(shapes)], gen)
            for i in range(count)}


def write_index(directory, tensors, shards=2):
    """``tensors`` as ``shards`` safetensors files and the ``model.safetensors.index.json``
    naming them."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    weight_map, files = {}, []
    for k in range(shards):
        file = f"model-{k + 1:05}-of-{shards:05}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
        files.append(os.path.join(directory, file))
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index, files, weight_map


def header_bytes(path):
    with open(path, "rb") as f:
        return f.read(struct.unpack("<Q", f.read(8))[0])


def is_gpufeed(obj):
    return type(obj).__module__.partition(".")[0] == "gpufeed"


@pytest.fixture(autouse=True)
def _safetensors_unpatched(monkeypatch):
    """Each test starts with safetensors' own names (the comparisons would otherwise compare
    gpufeed with itself) and without GPUFEED_PATCH_SAFETENSORS in its environment."""
    monkeypatch.delenv("GPUFEED_PATCH_SAFETENSORS", raising=False)
    if not is_st_own(safetensors.safe_open) and hasattr(gpufeed, "unpatch_safetensors"):
        gpufeed.unpatch_safetensors()
    assert is_st_own(safetensors.safe_open), "safetensors.safe_open is patched"
    assert is_st_own(safetensors.torch.safe_open), "safetensors.torch.safe_open is patched"
    assert safetensors.torch.load_file.__module__ == "safetensors.torch", \
        "safetensors.torch.load_file is patched"
    yield


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20240938)


@pytest.fixture
def small_file(tmp_path, gen):
    from safetensors.torch import save_file

    path = str(tmp_path / "small.safetensors")
    tensors = mixed_checkpoint(gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


# ---------------------------------------------------------------------------------------------
# the API against safetensors


def test_errors_are_safetensors_errors():
    assert issubclass(gpufeed.SafetensorError, gpufeed.GpufeedError)
    assert issubclass(gpufeed.SafetensorError, safetensors.SafetensorError)
    for name in ("safe_open", "patch_safetensors", "unpatch_safetensors"):
        assert callable(getattr(gpufeed, name, None)), f"gpufeed.{name}"
    assert callable(gtorch().load_file) and callable(gtorch().load)


@pytest.mark.parametrize("name,st_name", DTYPES, ids=[d[0] for d in DTYPES])
def test_every_dtype_and_odd_shape_equals_safetensors(tmp_path, gen, name, st_name):
    """One file per dtype, in every odd shape: header queries, get_tensor, get_tensors, the
    full get_slice, load_file and load(bytes) give safetensors' answers, with both backends."""
    from safetensors.torch import load as st_load, save_file

    dtype = torch_dtype(name)
    packed = name == "float4_e2m1fn_x2"  # two values a byte; safetensors cannot write it 0-d
    tensors = {f"t{j}_{'x'.join(map(str, shape)) or 'scalar'}": random_tensor(dtype, shape, gen)
               for j, shape in enumerate(SHAPES) if not (packed and shape == ())}
    path = str(tmp_path / f"{name}.safetensors")
    save_file(tensors, path, metadata={"dtype": name})
    # safetensors' own get_slice reshapes packed F4 rows wrongly: no reference for its slices
    ref = reference(path, slices=not packed)
    assert {m[0] for m in ref["metas"].values()} == {st_name}
    for name_, t in tensors.items():
        assert_same(ref["tensors"][name_], t, f"safetensors' own get_tensor({name_!r})")
    for backend in ("mmap", "pread"):
        with gpufeed.safe_open(path, framework="pt", device="cpu", backend=backend) as f:
            check_handle(f, ref, f"{name}, backend={backend}", slices=not packed)
    assert_same_dict(gtorch().load_file(path), safetensors.torch.load_file(path),
                     f"{name}: gpufeed.torch.load_file")
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        want = st_load(data)
    except KeyError:  # safetensors.torch.load lacks this dtype (F8_E8M0, F4): the tensors, or
        want = None  # a clear error
    if want is not None:
        assert_same_dict(gtorch().load(data), want, f"{name}: gpufeed.torch.load(bytes)")
    else:
        try:
            got = gtorch().load(data)
        except gpufeed.SafetensorError as e:
            assert st_name in str(e), f"{name}: load(bytes) refused without naming {st_name}: {e}"
        else:
            assert_same_dict(got, ref["tensors"], f"{name}: gpufeed.torch.load(bytes)")


def test_a_checkpoint_of_a_few_megabytes_equals_safetensors(tmp_path, gen):
    from safetensors.torch import load as st_load, save_file

    tensors = {
        "embed": random_tensor(torch.float32, (513, 1031), gen),     # 2,115,612 bytes
        "norm": random_tensor(torch.bfloat16, (999, 211), gen),
        "ids": random_tensor(torch.int64, (4097,), gen),
        "mask": random_tensor(torch.uint8, (70_001,), gen),
        "proj": random_tensor(torch.float16, (3, 77, 129), gen),
    }
    path = str(tmp_path / "big.safetensors")
    save_file(tensors, path)
    assert os.path.getsize(path) % 4096 != 0
    ref = reference(path)
    for backend in ("mmap", "pread"):
        with gpufeed.safe_open(path, "pt", backend=backend) as f:
            check_handle(f, ref, f"backend={backend}")
    assert_same_dict(gtorch().load_file(path), safetensors.torch.load_file(path), "load_file")
    with open(path, "rb") as fh:
        data = fh.read()
    assert_same_dict(gtorch().load(data), st_load(data), "load(bytes)")


def test_metadata_keys_and_offset_keys_equal_safetensors(tmp_path, gen):
    from safetensors.torch import save_file

    tensors = mixed_checkpoint(gen, count=20)
    for metadata in (None, {}, {"format": "pt", "note": "ünïcode \"quoted\"", "n": "3"}):
        path = str(tmp_path / f"m{len(metadata or ()) if metadata is not None else 'none'}.st")
        save_file(tensors, path, metadata=metadata)
        want = reference(path, slices=False)
        with ST_OPEN(path, framework="pt") as ref, gpufeed.safe_open(path, "pt") as f:
            assert f.metadata() == ref.metadata(), (metadata, f.metadata(), ref.metadata())
            assert f.keys() == ref.keys() == sorted(tensors)
            assert_offset_order(f.offset_keys(), want, f"metadata={metadata!r}")
            for n in ref.keys():
                assert meta_of(f.get_tensor_meta(n)) == meta_of(ref.get_tensor_meta(n)), n


def test_defaults_and_the_accepted_spellings(small_file):
    """framework defaults to "pt" (and "torch", "pytorch" mean it), device to "cpu"; a path may
    be a pathlib.Path."""
    path, tensors = small_file
    ref = reference(path)
    for kwargs in ({}, {"framework": "pt"}, {"framework": "torch"}, {"framework": "pytorch"},
                   {"framework": "pt", "device": "cpu"},
                   {"framework": "pt", "device": torch.device("cpu")}):
        with gpufeed.safe_open(pathlib.Path(path), **kwargs) as f:
            check_handle(f, ref, f"safe_open(Path, **{kwargs})")
    assert_same_dict(gtorch().load_file(pathlib.Path(path)), ref["tensors"], "load_file(Path)")
    assert_same_dict(gtorch().load_file(path, device="cpu"), ref["tensors"], "load_file(cpu)")


def test_misaligned_offsets_equal_safetensors(tmp_path, gen):
    """save_file aligns every tensor (it sorts them by alignment), so the file is written by
    hand: 1- and 2-byte tensors before F32 / F64 / BF16 / I64 / C64 ones and a header of odd
    length, so they start at odd offsets in the data section and in the file."""
    from safetensors.torch import load as st_load

    def blob(dtype, shape):
        return bytes(random_tensor(dtype, shape, gen).reshape(-1).view(torch.uint8).tolist())

    wide = [("b_f32", "F32", torch.float32, (7, 13)), ("d_f64", "F64", torch.float64, (31,)),
            ("f_bf16", "BF16", torch.bfloat16, (5, 3)), ("g_i64", "I64", torch.int64, (3, 3)),
            ("i_c64", "C64", torch.complex64, (4,)), ("j_i16", "I16", torch.int16, (9,)),
            ("k_f32", "F32", torch.float32, (1001,))]
    entries, offset = [], 0
    for k, (name, st_dtype, dtype, shape) in enumerate(wide):
        pad = 1 if offset % 2 == 0 else 2  # 1- or 2-byte tensors: the next one starts odd
        pad_dtype, pad_torch = ("U8", torch.uint8) if k % 2 else ("I8", torch.int8)
        entries.append((f"{name[0]}_pad", pad_dtype, [pad], blob(pad_torch, (pad,))))
        entries.append((name, st_dtype, list(shape), blob(dtype, shape)))
        offset += pad + len(entries[-1][3])
        assert (offset - len(entries[-1][3])) % 2 == 1
    path = str(tmp_path / "misaligned.safetensors")
    start = write_raw(path, entries, metadata={"pad": "x"})
    if start % 2 == 0:
        start = write_raw(path, entries, metadata={"pad": "xy"})
    assert start % 2 == 1, "the data section starts at an odd offset in the file"
    ref = reference(path)
    sizes = {"F32": 4, "F64": 8, "BF16": 2, "I64": 8, "C64": 8, "I16": 2}
    with gpufeed.safe_open(path) as f:
        misaligned = []
        for name, dtype, _, _ in entries:
            begin = f.get_tensor_meta(name).data_offsets[0]
            if dtype in sizes:
                assert begin % sizes[dtype] != 0, f"{name} at {begin} is aligned"
                misaligned.append(name)
        assert len(misaligned) == 7
        check_handle(f, ref, "misaligned")
        for name in misaligned:
            s, r = f.get_slice(name), ST_OPEN(path, "pt").get_slice(name)
            for index in (0, -1, slice(1, None), slice(None, None, 2)):
                assert_same(s[index], r[index], f"get_slice({name!r})[{index!r}]")
    with gpufeed.safe_open(path, backend="pread") as f:
        check_handle(f, ref, "misaligned, pread")
    assert_same_dict(gtorch().load_file(path), ref["tensors"], "load_file")
    with open(path, "rb") as fh:
        data = fh.read()
    assert_same_dict(gtorch().load(data), st_load(data), "load(bytes)")


def test_a_sharded_index_is_one_handle(tmp_path, gen):
    tensors = mixed_checkpoint(gen, count=15)
    index, files, weight_map = write_index(str(tmp_path), tensors)
    refs = {file: reference(file) for file in files}
    want = {n: t for r in refs.values() for n, t in r["tensors"].items()}
    assert sorted(want) == sorted(tensors)
    for path in (index, pathlib.Path(index)):
        with gpufeed.safe_open(path, framework="pt") as f:
            assert f.keys() == sorted(tensors), f.keys()
            order = f.offset_keys()
            assert sorted(order) == sorted(tensors), order
            for file in files:  # each shard's tensors in its own offset order
                own = [n for n in order if n in refs[file]["tensors"]]
                assert_offset_order(own, refs[file], f"index: {os.path.basename(file)}")
            metadata = f.metadata()
            assert metadata is None or isinstance(metadata, dict), metadata
            for name, file in weight_map.items():
                file = os.path.join(str(tmp_path), file)
                assert meta_of(f.get_tensor_meta(name)) == refs[file]["metas"][name], name
                s = f.get_slice(name)
                assert (s.get_shape(), s.get_dtype()) == refs[file]["slice_info"][name], name
                assert_same(s[...], refs[file]["full_slices"][name], f"get_slice({name!r})")
            for name in reversed(f.keys()):
                assert_same(f.get_tensor(name), want[name], f"index get_tensor({name!r})")
            assert_same_dict(f.get_tensors(), want, "index get_tensors()")
            raises_gpufeed_error(lambda: f.get_tensor("nope"), "File does not contain tensor nope",
                                 what="an unknown name in an index")
    assert_same_dict(gtorch().load_file(index), want, "gpufeed.torch.load_file(index)")


def test_a_file_opened_again_shares_its_parse_and_a_changed_header_does_not(tmp_path, gen):
    """The drop-in keeps a file's parsed header and its view of the tensors for the next open
    of the same header bytes (a file opened again): handles of one file give the same
    tensors; a file rewritten with another header of the same length (other names, another
    dtype), or the first header again with other bytes, opens as what it now holds."""
    from safetensors.torch import save_file
    from gpufeed import _gpufeed

    path = str(tmp_path / "m.safetensors")
    first = {"alpha": random_tensor(torch.float32, (7, 13), gen),
             "beta": random_tensor(torch.int16, (257, 3), gen)}
    save_file(first, path)
    key = _gpufeed.open_safetensors(path)[0].header_key()
    assert key is not None and len(key) == 2
    assert key.id == _gpufeed.open_safetensors(path)[0].header_key().id, "one header, one parse"
    with gpufeed.safe_open(path) as f, gpufeed.safe_open(path) as g:
        assert f.keys() == g.keys() == ["alpha", "beta"]
        assert_same_dict(f.get_tensors(), first, "the first handle")
        assert_same_dict({n: g.get_tensor(n) for n in g.keys()}, first, "the second handle")
    # Other names of the same lengths and another dtype of the same size: a header of the
    # same length, the file as long as before.
    before = (len(header_bytes(path)), os.path.getsize(path))
    second = {"gamma": random_tensor(torch.float32, (7, 13), gen),
              "zeta": random_tensor(torch.uint16, (257, 3), gen)}
    save_file(second, path)
    assert (len(header_bytes(path)), os.path.getsize(path)) == before
    assert _gpufeed.open_safetensors(path)[0].header_key().id != key.id
    with gpufeed.safe_open(path) as f:
        assert f.keys() == ["gamma", "zeta"]
        assert f.get_slice("zeta").get_dtype() == "U16"
        assert_same_dict(f.get_tensors(), second, "the rewritten file")
        raises_gpufeed_error(lambda: f.get_tensor("alpha"), "File does not contain tensor alpha",
                             what="a name of the header before")
    # The first header again, other bytes: the first parse, the new bytes.
    third = {n: random_tensor(t.dtype, tuple(t.shape), gen) for n, t in first.items()}
    save_file(third, path)
    with gpufeed.safe_open(path) as f:
        assert_same_dict(f.get_tensors(), third, "the first header, other bytes")
        assert_same_dict({n: f.get_tensor(n) for n in f.keys()}, third, "get_tensor")


def test_views_of_parses_let_go_are_let_go(tmp_path, gen):
    """The drop-in keeps its view of a file only while the native side keeps the file's parse:
    after 300 other headers (the native side keeps 256) the first file's parse is let go, its
    view with it, and the file opens again as it is."""
    from safetensors.torch import save_file
    from gpufeed import _gpufeed, _safe_open

    first = str(tmp_path / "first.safetensors")
    want = {"w": random_tensor(torch.float32, (3, 5), gen)}
    save_file(want, first)
    with gpufeed.safe_open(first) as f:
        key = _gpufeed.open_safetensors(first)[0].header_key()
        assert key.kept, "a header just parsed is kept"
        assert (key.id, 0) in _safe_open._LAYOUTS
    for i in range(300):
        other = str(tmp_path / f"o{i}.safetensors")
        save_file({f"t{i}": random_tensor(torch.uint8, (i + 1,), gen)}, other)
        with gpufeed.safe_open(other) as g:
            assert g.keys() == [f"t{i}"]
    assert not key.kept, "300 headers later the first one's parse was let go"
    assert (key.id, 0) not in _safe_open._LAYOUTS, "its view went with it"
    assert len(_safe_open._LAYOUTS) <= _safe_open._LAYOUT_COUNT
    assert all(k.kept for k, _ in _safe_open._LAYOUTS.values())
    with gpufeed.safe_open(first) as f:
        assert_same_dict(f.get_tensors(), want, "the first file opened again")


def test_a_shard_opened_alone_and_in_its_index(tmp_path, gen):
    """A shard's view is kept by its place in the handle: the same file opened alone (file 0)
    and through its index (file 1), in either order, gives its tensors from the right file."""
    tensors = mixed_checkpoint(gen, count=9)
    index, files, _ = write_index(str(tmp_path), tensors)
    assert len(files) >= 2, files
    want = {n: t for file in files for n, t in reference(file)["tensors"].items()}
    for rounds in ("shard first", "index first"):
        opens = [files[1], index] if rounds == "shard first" else [index, files[1]]
        for path in opens:
            with gpufeed.safe_open(path) as f:
                got = {n: f.get_tensor(n) for n in f.keys()}
                got_all = f.get_tensors()
                for n in f.keys():
                    assert_same(f.get_slice(n)[...], want[n], f"{rounds}: get_slice({n!r})")
            expected = {n: want[n] for n in got}
            assert len(expected) == (len(want) if path == index else
                                     len(reference(files[1])["tensors"]))
            assert_same_dict(got, expected, f"{rounds}: {os.path.basename(path)} get_tensor")
            assert_same_dict(got_all, expected, f"{rounds}: {os.path.basename(path)} get_tensors")


def test_an_index_naming_a_missing_shard_or_tensor_is_an_error(tmp_path, gen):
    tensors = mixed_checkpoint(gen, count=6)
    index, files, weight_map = write_index(str(tmp_path), tensors)
    os.remove(files[1])
    missing = os.path.basename(files[1])

    def sweep():
        with gpufeed.safe_open(index) as f:
            f.get_tensors()

    e = raises_gpufeed_error(sweep, missing, what="a shard that is not there",
                             types=(gpufeed.GpufeedError, FileNotFoundError))
    assert isinstance(e, (gpufeed.SafetensorError, FileNotFoundError)), type(e)
    second = tmp_path / "second"
    second.mkdir()
    index2, files2, _ = write_index(str(second), tensors)
    with open(index2) as fh:
        doc = json.load(fh)
    doc["weight_map"]["ghost.weight"] = os.path.basename(files2[0])
    with open(index2, "w") as fh:
        json.dump(doc, fh)

    def ghost():
        with gpufeed.safe_open(index2) as f:
            f.get_tensor("ghost.weight")

    raises_gpufeed_error(ghost, "ghost.weight", what="an index naming a tensor its shard lacks")
    # A tensor the index maps to one shard, with a copy of other bytes in another: which copy
    # is meant cannot be told, so the index is refused naming both shards (never a silent
    # pick of either).
    from safetensors.torch import save_file

    third = tmp_path / "third"
    third.mkdir()
    index3, files3, weight_map3 = write_index(str(third), tensors)
    name = next(n for n, f in weight_map3.items() if f == os.path.basename(files3[0]))
    inside = safetensors.torch.load_file(files3[1])
    inside[name] = -tensors[name] if tensors[name].dtype.is_floating_point else tensors[name]
    save_file(inside, files3[1])

    def twice():
        with gpufeed.safe_open(index3) as f:
            f.get_tensor(name)

    e = raises_gpufeed_error(twice, f"tensor {name} is in two shards",
                             what="a tensor in two shards")
    for f in files3:
        assert os.path.basename(f) in str(e), f"the error does not name {f}: {e}"
    with pytest.raises(gpufeed.GpufeedError, match="in two shards"):
        gpufeed.torch.load_file(index3)


INDEXES = [
    0, 3, -1, -7, slice(None), slice(1, 3), slice(2, None), slice(None, 4), slice(-3, None),
    slice(None, -2), slice(None, None, 2), slice(1, 6, 3), slice(-5, -1, 2), slice(5, 100),
    slice(100, 200), slice(3, 1), Ellipsis, (), (0,), (2, 1), (-1, -1, -1),
    (slice(1, 5, 3), -2, slice(None, None, 2)), (Ellipsis, 1), (1, Ellipsis), (1, Ellipsis, 2),
    (Ellipsis, slice(1, 3)), (slice(None), slice(3, 1)), (slice(None), 0, slice(1, None, 4)),
    (slice(0, 0),), (slice(None, None, 3), slice(None, None, 5), slice(None, None, 2)),
    (-2, slice(-4, None), Ellipsis),
]
BAD_INDEXES = [7, -8, (0, 0, 0, 0), slice(None, None, -1), slice(None, None, 0),
               (Ellipsis, 5), (0, Ellipsis, 0, Ellipsis)]


def test_get_slice_indexing_equals_safetensors(tmp_path, gen):
    """ints, negative ints, slices with steps, Ellipsis and tuples on tensors of several
    ranks and dtypes: the same tensors as safetensors' get_slice; where safetensors refuses an
    index, so does gpufeed."""
    from safetensors.torch import save_file

    tensors = {
        "x": random_tensor(torch.float32, (7, 13, 5), gen),
        "v": random_tensor(torch.int64, (11,), gen),
        "m": random_tensor(torch.bfloat16, (4, 6), gen),
        "b": random_tensor(torch.bool, (5, 4, 3), gen),
        "h": random_tensor(torch.float16, (9, 1, 8), gen),
        "e": random_tensor(torch.float32, (3, 0, 5), gen),
    }
    path = str(tmp_path / "slices.safetensors")
    save_file(tensors, path)
    compared = refused = 0
    for backend in ("mmap", "pread"):
        with ST_OPEN(path, framework="pt") as ref, \
                gpufeed.safe_open(path, backend=backend) as f:
            for name in tensors:
                r, s = ref.get_slice(name), f.get_slice(name)
                for index in INDEXES + BAD_INDEXES:
                    what = f"{backend}: get_slice({name!r})[{index!r}]"
                    try:
                        want = r[index]
                    except Exception:  # noqa: BLE001 (safetensors refuses it: so must gpufeed)
                        with pytest.raises(Exception):
                            s[index]
                        refused += 1
                        continue
                    assert_same(s[index], want, what)
                    compared += 1
    assert compared > 200 and refused > 30, (compared, refused)


def test_a_slice_reads_after_its_handle_closed_as_safetensors(tmp_path, gen):
    """Slices taken inside a ``with`` block index after it, and after the handle was dropped
    and the file's name removed, as safetensors' do; the handle itself refuses."""
    from safetensors.torch import save_file

    tensors = {"x": random_tensor(torch.float32, (7, 13, 5), gen),
               "m": random_tensor(torch.bfloat16, (4, 6), gen)}
    path = str(tmp_path / "slices.safetensors")
    save_file(tensors, path)
    with ST_OPEN(path, framework="pt") as ref:
        want = {n: ref.get_slice(n) for n in tensors}
    with gpufeed.safe_open(path) as f:
        got = {n: f.get_slice(n) for n in tensors}
    raises_gpufeed_error(lambda: f.get_slice("x"), what="get_slice after close")
    del f
    gc.collect()
    os.remove(path)
    for name in tensors:
        assert got[name].get_shape() == want[name].get_shape()
        assert got[name].get_dtype() == want[name].get_dtype()
        for index in ((slice(1, 3),), (Ellipsis, slice(2, 5)), 0, ()):
            assert_same(got[name][index], want[name][index],
                        f"get_slice({name!r})[{index!r}] after close")


def test_get_slice_of_a_0d_tensor(tmp_path, gen):
    from safetensors.torch import save_file

    path = str(tmp_path / "scalar.safetensors")
    save_file({"s": random_tensor(torch.float64, (), gen)}, path)
    with ST_OPEN(path, "pt") as ref, gpufeed.safe_open(path) as f:
        for index in (Ellipsis, ()):
            assert_same(f.get_slice("s")[index], ref.get_slice("s")[index], f"0-d [{index!r}]")
        for index in (0, slice(None)):
            with pytest.raises(Exception):
                ref.get_slice("s")[index]
            with pytest.raises(Exception):
                f.get_slice("s")[index]


# ---------------------------------------------------------------------------------------------
# errors


def test_unknown_names_are_safetensor_errors(small_file):
    path, _ = small_file
    with gpufeed.safe_open(path) as f:
        for call in (f.get_tensor, f.get_slice, f.get_tensor_meta):
            e = raises_gpufeed_error(lambda: call("nope"), "File does not contain tensor nope",
                                     what=f"{call.__name__}('nope')")
            assert isinstance(e, safetensors.SafetensorError), type(e).__mro__
            assert isinstance(e, gpufeed.GpufeedError), type(e).__mro__
        with pytest.raises(safetensors.SafetensorError):  # as callers of safetensors catch it
            f.get_tensor("model.layers.0.w99")


def test_a_missing_file_raises_file_not_found(tmp_path):
    path = str(tmp_path / "absent.safetensors")
    for what, call in (("safe_open", lambda: gpufeed.safe_open(path).get_tensors()),
                       ("load_file", lambda: gtorch().load_file(path)),
                       ("an index", lambda: gpufeed.safe_open(
                           str(tmp_path / "absent.safetensors.index.json")).keys())):
        with pytest.raises(FileNotFoundError) as info:
            call()
        named = str(info.value) + str(getattr(info.value, "filename", ""))
        assert "absent.safetensors" in named, f"{what}: the error does not name the file: " \
                                              f"{info.value!r}"


def corrupt_files():
    def header(obj):
        text = json.dumps(obj).encode()
        return struct.pack("<Q", len(text)) + text

    return {
        "invalid_json": struct.pack("<Q", 20) + b"{not json at all!!!!" + b"x" * 10,
        "header_past_the_end": struct.pack("<Q", 10**6) + b"{}",
        "header_length_huge": b"\xff" * 8 + b"{}",
        "shorter_than_8_bytes": b"\x01\x02\x03",
        "empty_file": b"",
        "zero_length_header": struct.pack("<Q", 0),
        "not_an_object": header([1, 2, 3]),
        "data_past_the_end": header({"x": {"dtype": "F32", "shape": [1024],
                                           "data_offsets": [0, 4096]}}) + b"\0" * 100,
        "gap_between_tensors": header({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                       "y": {"dtype": "F32", "shape": [1],
                                             "data_offsets": [8, 12]}}) + b"\0" * 12,
        "unknown_dtype": header({"x": {"dtype": "X99", "shape": [1],
                                       "data_offsets": [0, 4]}}) + b"\0" * 4,
        "shape_against_offsets": header({"x": {"dtype": "F32", "shape": [4],
                                               "data_offsets": [0, 12]}}) + b"\0" * 12,
    }


@pytest.mark.parametrize("case", sorted(corrupt_files()))
def test_a_corrupt_file_is_a_safetensor_error_naming_it(tmp_path, case):
    blob = corrupt_files()[case]
    path = str(tmp_path / f"corrupt_{case}.safetensors")
    with open(path, "wb") as fh:
        fh.write(blob)
    with pytest.raises(ST_ERROR):  # safetensors refuses it too
        with ST_OPEN(path, framework="pt") as f:
            f.get_tensors()

    def sweep():
        with gpufeed.safe_open(path) as f:
            f.get_tensors()

    name = os.path.basename(path)
    raises_gpufeed_error(sweep, name, what=f"safe_open of {case}")
    raises_gpufeed_error(lambda: gtorch().load_file(path), name, what=f"load_file of {case}")
    raises_gpufeed_error(lambda: gtorch().load(blob), what=f"load(bytes) of {case}")


@pytest.mark.parametrize("framework", ["np", "numpy", "tf", "flax", "jax", "mlx", "paddle", "PT"])
def test_frameworks_other_than_torch_are_refused(small_file, framework):
    path, _ = small_file
    e = raises_gpufeed_error(lambda: gpufeed.safe_open(path, framework=framework).get_tensors(),
                             framework, what=f"framework={framework!r}")
    assert "pt" in str(e), f"the refusal does not say what is accepted: {e}"


def test_an_unknown_backend_is_refused(small_file):
    path, _ = small_file
    with pytest.raises((gpufeed.GpufeedError, ValueError, TypeError)):
        gpufeed.safe_open(path, backend="not_a_backend").get_tensors()


@pytest.mark.parametrize("device", ["mps", "tpu", "cuda:x", "cuda:-1", "cpu:", -1, True, 1.5,
                                    "cuda:0:1"], ids=repr)
def test_unknown_devices_are_refused(small_file, device):
    path, _ = small_file
    with pytest.raises((gpufeed.GpufeedError, ValueError, TypeError)):
        with gpufeed.safe_open(path, device=device) as f:
            f.get_tensor(f.keys()[0])


def test_without_a_gpu_cuda_requests_are_clear_errors_and_cpu_handles_work(small_file):
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device: test_safe_open_gpu.py covers CUDA")
    path, _ = small_file
    ref = reference(path)
    for device in ("cuda:0", 0, "cuda", torch.device("cuda:0")):
        def load():
            with gpufeed.safe_open(path, device=device) as f:
                f.get_tensor(f.keys()[0])

        e = raises_gpufeed_error(load, what=f"device={device!r} without a GPU",
                                 types=(gpufeed.SafetensorError, gpufeed.NoGpuError))
        text = str(e).lower()
        assert "gpu" in text or "cuda" in text, f"device={device!r}: unclear: {e}"
        raises_gpufeed_error(lambda: gtorch().load_file(path, device=device),
                             what=f"load_file(device={device!r}) without a GPU",
                             types=(gpufeed.SafetensorError, gpufeed.NoGpuError))
    with gpufeed.safe_open(path) as f:
        for call in (lambda: f.prefetch(), lambda: f.prefetch(device="cuda:0"),
                     lambda: f.prefetch(device=0)):
            e = raises_gpufeed_error(call, what="prefetch without a GPU",
                                     types=(gpufeed.SafetensorError, gpufeed.NoGpuError))
            assert "cuda" in str(e).lower() or "gpu" in str(e).lower(), e
        check_handle(f, ref, "a CPU handle after the CUDA refusals")


def test_packed_f4_slices_on_the_cpu_keep_the_last_dimension_whole(tmp_path, gen):
    """F4 (two values a byte) on the CPU, as on a GPU: slices that take the last dimension
    whole are the same index of the tensor; one that cuts it is refused (before: the index
    was applied to the packed bytes, so ``[..., 0]`` gave a byte of two values)."""
    from safetensors.torch import save_file

    t = random_tensor(torch_dtype("float4_e2m1fn_x2"), (4, 3, 6), gen)
    path = str(tmp_path / "f4.safetensors")
    save_file({"t": t}, path)
    with gpufeed.safe_open(path) as f:
        whole = f.get_tensor("t")
        s = f.get_slice("t")
        assert s.get_shape() == [4, 3, 12] and s.get_dtype() == "F4"
        for index in (Ellipsis, 1, -1, slice(1, 3), (slice(None), 2), (0, slice(None, None, 2)),
                      (slice(None), slice(None), slice(None))):
            assert_same(s[index], whole[index], f"F4 slice {index!r}")
        for index in ((Ellipsis, 0), (slice(None), slice(None), 5),
                      (0, 0, slice(0, 6)), (Ellipsis, slice(None, None, 2))):
            with pytest.raises(gpufeed.SafetensorError, match="slicing its last dimension"):
                s[index]


def test_a_shape_past_torch_is_a_safetensor_error(tmp_path):
    """An empty tensor whose other dimensions overflow 64-bit strides (no tensor library can
    hold its shape): every reading call raises the handle's error class, naming the shape."""
    path = str(tmp_path / "huge.safetensors")
    header = json.dumps({"a": {"dtype": "U8", "shape": [0, 2**32, 2**32],
                               "data_offsets": [0, 0]}}).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
    calls = {
        "get_tensor": lambda f: f.get_tensor("a"),
        "get_tensors": lambda f: f.get_tensors(),
        "get_slice": lambda f: f.get_slice("a")[...],
    }
    for what, call in calls.items():
        with gpufeed.safe_open(path) as f:
            raises_gpufeed_error(lambda: call(f), "[0, 4294967296, 4294967296]", what=what)
    raises_gpufeed_error(lambda: gtorch().load_file(path), "[0, 4294967296, 4294967296]",
                         what="load_file")


def test_prefetch_plan_bounds_take_numpy_and_torch_integers(tmp_path, gen):
    """A plan's row bounds may be numpy's or torch's integers, as safetensors takes them (the
    plan is checked before the device, so no GPU is needed); floats and bools are refused."""
    np = pytest.importorskip("numpy")
    from safetensors.torch import save_file

    path = str(tmp_path / "rows.safetensors")
    save_file({"w": random_tensor(torch.float32, (9, 5), gen)}, path)
    with gpufeed.safe_open(path) as f:
        want = f._plan({"w": slice(1, -2)})
        assert want == {"w": (1, 7)}, want
        for lo, hi in ((np.int64(1), np.int32(-2)), (torch.tensor(1), torch.tensor(-2)),
                       (np.uint8(1), -2)):
            assert f._plan({"w": slice(lo, hi)}) == want, (type(lo), type(hi))
        for bad in (slice(1.0, 3), slice(True, 3), slice(1, "3")):
            with pytest.raises(gpufeed.SafetensorError, match="integers or None"):
                f._plan({"w": bad})


def test_prefetch_to_the_cpu_is_refused(small_file):
    """prefetch loads to a CUDA device: a CPU handle asked without a device, or any handle
    asked for "cpu", refuses (with or without a GPU)."""
    path, _ = small_file
    with gpufeed.safe_open(path) as f:
        for call in (lambda: f.prefetch(), lambda: f.prefetch(device="cpu")):
            e = raises_gpufeed_error(call, what="prefetch to the CPU",
                                     types=(gpufeed.SafetensorError, gpufeed.NoGpuError))
            assert "cuda" in str(e).lower(), e


# ---------------------------------------------------------------------------------------------
# CPU tensors: copy-on-write views that outlive their handle


def test_cpu_tensors_are_writable_and_writes_stay_off_the_file(small_file):
    path, tensors = small_file
    before = file_hash(path)
    ref = reference(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpufeed.safe_open(path) as f:
            got = [f.get_tensor(n) for n in f.keys()]
            got += list(f.get_tensors().values())
            got += [f.get_slice(n)[...] for n in f.keys()]
            got += [f.get_slice(n)[:1] for n in f.keys() if f.get_tensor_meta(n).shape]
            got += list(gtorch().load_file(path).values())
            for t in got:
                if t.numel():
                    same_size = t.view(INT_OF_SIZE[t.element_size()])
                    same_size.reshape(-1)[0] = 0x55
                    assert int(raw_bytes(t)[0]) == 0x55, "a write did not take"
                    same_size.zero_()
                    assert not torch.any(raw_bytes(t)), "a write did not take"
            # A second handle maps the file anew: it sees the file, not the first's writes.
            with gpufeed.safe_open(path) as g:
                check_handle(g, ref, "a second handle after writes through the first")
    unwritable = [str(w.message) for w in caught if "writable" in str(w.message)]
    assert not unwritable, unwritable
    assert file_hash(path) == before, "writes to CPU tensors reached the file"
    check_handle(ST_OPEN(path, framework="pt"), ref, "safetensors after the writes")


def test_load_of_bytes_does_not_write_into_the_bytes(small_file):
    path, _ = small_file
    with open(path, "rb") as fh:
        data = fh.read()
    digest = hashlib.sha256(data).hexdigest()
    got = gtorch().load(data)
    for t in got.values():
        assert t.device.type == "cpu"
        if t.numel():
            t.view(INT_OF_SIZE[t.element_size()]).reshape(-1)[0] = 0x5A
    assert hashlib.sha256(data).hexdigest() == digest, "a write reached the (immutable) bytes"


def test_tensors_outlive_their_handle(tmp_path, small_file, gen):
    from safetensors.torch import save_file

    path, _ = small_file
    ref = reference(path)
    f = gpufeed.safe_open(path)
    with f:
        got = {n: f.get_tensor(n) for n in f.keys()}
        many = f.get_tensors()
        sliced = {n: f.get_slice(n)[...] for n in f.keys()}
    raises_gpufeed_error(lambda: f.get_tensor(ref["keys"][0]), what="get_tensor after close")
    raises_gpufeed_error(f.keys, what="keys() after close (as safetensors)")
    del f
    # handles never closed, only dropped
    alone = {n: gpufeed.safe_open(path).get_tensor(n) for n in ref["keys"]}
    loaded = gtorch().load_file(path)
    gc.collect()
    # other files opened and closed in between (a reused mapping would show here)
    for k in range(3):
        other = str(tmp_path / f"other{k}.safetensors")
        save_file(mixed_checkpoint(gen), other)
        with gpufeed.safe_open(other) as g:
            g.get_tensors()
        os.remove(other)
    gc.collect()
    for what, d in (("get_tensor", got), ("get_tensors", many), ("get_slice", sliced),
                    ("a dropped handle", alone), ("load_file", loaded)):
        assert_same_dict(d, ref["tensors"], f"{what} after the handle went")
    os.remove(path)  # the mapping outlives the name too
    gc.collect()
    assert_same_dict(got, ref["tensors"], "after the file was removed")


def test_a_file_replaced_under_an_open_handle(tmp_path, gen):
    """os.replace of another file (same header, other bytes) onto the path while a handle sweeps
    it: every tensor it gives is the original's, or it raises an error naming the file; never
    the new file's bytes, nor a mix. A handle opened afterwards reads the new file."""
    from safetensors.torch import save_file

    names = [f"t{i:02}" for i in range(24)]
    old = {n: random_tensor(torch.float32, (97, 131), gen) for n in names}
    new = {n: random_tensor(torch.float32, (97, 131), gen) for n in names}
    path = str(tmp_path / "model.safetensors")
    other = str(tmp_path / "replacement.safetensors")
    for backend in ("mmap", "pread"):
        save_file(old, path)
        save_file(new, other)
        assert header_bytes(path) == header_bytes(other), "the same header, other bytes"
        with gpufeed.safe_open(path, backend=backend) as f:
            first = f.get_tensor(names[0])
            os.replace(other, path)
            try:
                got = {n: f.get_tensor(n) for n in names[1:]}
                got.update(f.get_tensors())
            except gpufeed.GpufeedError as e:
                assert "model.safetensors" in str(e), f"the error does not name the file: {e}"
                got = {}
        assert_same(first, old[names[0]], f"{backend}: before the replacement")
        for n, t in got.items():
            assert_same(t, old[n], f"{backend}: {n} after the file was replaced")
        with gpufeed.safe_open(path, backend=backend) as f:
            assert_same_dict(f.get_tensors(), new, f"{backend}: a handle opened afterwards")


def test_metadata_changes_after_the_open_leave_the_handle_whole(tmp_path, gen):
    """A chmod, a hard link, a rename, the file's last link removed or another file renamed
    over its path, after the open and before any tensor is read: the handle reads the
    version it opened, as safetensors' does (no "changed" error). A change of its size is
    refused, naming the file."""
    from safetensors.torch import save_file

    tensors = {f"t{i}": random_tensor(torch.float32, (33, 7 + i), gen) for i in range(3)}
    other = {n: random_tensor(torch.float32, tuple(t.shape), gen) for n, t in tensors.items()}
    for change in ("chmod", "link", "rename", "unlink", "replaced"):
        path = tmp_path / f"{change}.safetensors"
        save_file(tensors, str(path))
        with gpufeed.safe_open(path) as f, ST_OPEN(str(path), framework="pt") as st:
            if change == "chmod":
                os.chmod(path, 0o600)
            elif change == "link":
                os.link(path, tmp_path / f"{change}-link.safetensors")
            elif change == "rename":
                os.rename(path, tmp_path / f"{change}-moved.safetensors")
            elif change == "unlink":
                os.unlink(path)
            else:
                save_file(other, str(tmp_path / "other.safetensors"))
                os.replace(tmp_path / "other.safetensors", path)
            assert_same_dict(f.get_tensors(), tensors, f"after {change}")
            assert_same_dict({n: st.get_tensor(n) for n in st.keys()}, tensors,
                             f"safetensors after {change}")
    path = tmp_path / "appended.safetensors"
    save_file(tensors, str(path))
    with gpufeed.safe_open(path) as f:
        with open(path, "ab") as w:
            w.write(b"\0" * 8)
        with pytest.raises(gpufeed.GpufeedError, match="appended.safetensors.*changed since it"):
            f.get_tensor("t0")


def test_threads_share_a_handle(small_file):
    path, _ = small_file
    ref = reference(path)
    errors = []
    with gpufeed.safe_open(path) as f:
        def sweep():
            try:
                for _ in range(5):
                    for n in ref["keys"]:
                        assert_same(f.get_tensor(n), ref["tensors"][n], n)
                        assert_same(f.get_slice(n)[...], ref["full_slices"][n], n)
            except BaseException as e:  # noqa: BLE001 (reported by the main thread)
                errors.append(e)

        threads = [threading.Thread(target=sweep) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# routing safetensors to gpufeed


EARLY_USER = """\
from safetensors import safe_open
from safetensors.torch import load_file


def open_pt(path):
    return safe_open(path, framework="pt")
"""


def early_user_module(tmp_path, monkeypatch):
    """A module that did ``from safetensors import safe_open`` before any patch."""
    name = f"early_user_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(EARLY_USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    assert is_st_own(module.safe_open)
    return module


def test_patch_safetensors_routes_safe_open_and_load_file(tmp_path, monkeypatch, gen):
    tensors = mixed_checkpoint(gen, count=8)
    index, files, _ = write_index(str(tmp_path), tensors)
    path = files[0]
    ref = reference(path)
    module = early_user_module(tmp_path, monkeypatch)
    original_load_file = safetensors.torch.load_file
    try:
        gpufeed.patch_safetensors()
        for what, opened in (
            ("safetensors.safe_open(p, framework='pt')",
             lambda: safetensors.safe_open(path, framework="pt")),
            ("safetensors.safe_open(p, 'pt', device='cpu')",
             lambda: safetensors.safe_open(path, "pt", device="cpu")),
            ("safetensors.safe_open(p, 'pt', backend='pread')",
             lambda: safetensors.safe_open(path, "pt", backend="pread")),
            ("safetensors.torch.safe_open", lambda: safetensors.torch.safe_open(path, "pt")),
            ("an early `from safetensors import safe_open`", lambda: module.open_pt(path)),
            ("the early module's safe_open", lambda: module.safe_open(path, framework="pt")),
        ):
            with opened() as f:
                assert is_gpufeed(f), f"{what} gave {type(f)!r}, not gpufeed's"
                check_handle(f, ref, what)
                with pytest.raises(safetensors.SafetensorError):
                    f.get_tensor("nope")
        # load_file reaches gpufeed: an index loads (safetensors' own refuses it); it keeps
        # safetensors' signature (device, keyword backend)
        assert_same_dict(safetensors.torch.load_file(path), ref["tensors"], "patched load_file")
        for kwargs in ({"device": "cpu"}, {"backend": "pread"},
                       {"device": "cpu", "backend": "mmap"}):
            assert_same_dict(safetensors.torch.load_file(path, **kwargs), ref["tensors"],
                             f"patched load_file(**{kwargs})")
        got = safetensors.torch.load_file(index)
        assert sorted(got) == sorted(tensors), "the patched load_file is not gpufeed's"
        # other frameworks stay safetensors' own
        with safetensors.safe_open(path, framework="np") as f:
            assert not is_gpufeed(f), type(f)
            import numpy as np

            assert isinstance(f.get_tensor(ref["keys"][0]), np.ndarray)
        with module.safe_open(path, framework="numpy") as f:
            assert not is_gpufeed(f), type(f)
    finally:
        gpufeed.unpatch_safetensors()
    assert is_st_own(safetensors.safe_open), "unpatch left safetensors.safe_open"
    assert is_st_own(safetensors.torch.safe_open), "unpatch left safetensors.torch.safe_open"
    assert safetensors.torch.load_file is original_load_file, "unpatch left load_file"
    assert is_st_own(module.safe_open), "unpatch left the early module's safe_open"
    with safetensors.safe_open(path, framework="pt") as f:
        assert not is_gpufeed(f), type(f)
    with pytest.raises(Exception):
        safetensors.torch.load_file(index)  # safetensors' own again


def test_patching_twice_then_unpatching_restores_safetensors(small_file):
    path, _ = small_file
    original_load_file = safetensors.torch.load_file
    try:
        gpufeed.patch_safetensors()
        gpufeed.patch_safetensors()
        with safetensors.safe_open(path, framework="pt") as f:
            assert is_gpufeed(f), type(f)
    finally:
        gpufeed.unpatch_safetensors()
    assert is_st_own(safetensors.safe_open)
    assert is_st_own(safetensors.torch.safe_open)
    assert safetensors.torch.load_file is original_load_file
    gpufeed.unpatch_safetensors()  # unpatching what is not patched changes nothing
    assert is_st_own(safetensors.safe_open)


PATCH_PROBE = """\
import json, sys
{prelude}
import safetensors, safetensors.torch
from safetensors import safe_open
path, index = sys.argv[1], sys.argv[2]
out = {{"imported_safe_open": type(safe_open(path, framework="pt")).__module__,
        "safetensors_safe_open": type(safetensors.safe_open(path, framework="pt")).__module__}}
try:
    out["load_file_of_index"] = sorted(safetensors.torch.load_file(index))
except Exception as e:
    out["load_file_of_index"] = type(e).__name__ + ": " + str(e)
print("PROBE " + json.dumps(out))
"""


def probe(prelude, path, index):
    result = subprocess.run(
        [sys.executable, "-c", PATCH_PROBE.format(prelude=prelude), path, index],
        capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert result.returncode == 0 and lines, \
        f"the probe failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return json.loads(lines[-1][len("PROBE "):])


@pytest.mark.parametrize("prelude", ["", "import gpufeed"],
                         ids=["at_start_up", "at_import_gpufeed"])
def test_the_environment_variable_patches_without_a_code_change(tmp_path, monkeypatch, gen,
                                                                 prelude):
    import site

    installed = os.path.dirname(os.path.dirname(os.path.abspath(gpufeed.__file__)))
    site_dirs = [os.path.abspath(d) for d in site.getsitepackages() + [site.getusersitepackages()]]
    if not prelude and installed not in site_dirs:
        pytest.skip(f"gpufeed is installed in {installed}, not a site directory (pip --target): "
                    "Python runs the .pth start-up hook only from site directories")
    tensors = mixed_checkpoint(gen, count=6)
    index, files, _ = write_index(str(tmp_path), tensors)
    monkeypatch.setenv("GPUFEED_PATCH_SAFETENSORS", "1")
    out = probe(prelude, files[0], index)
    assert out["imported_safe_open"].startswith("gpufeed"), out
    assert out["safetensors_safe_open"].startswith("gpufeed"), out
    assert out["load_file_of_index"] == sorted(tensors), out
    monkeypatch.delenv("GPUFEED_PATCH_SAFETENSORS")
    out = probe(prelude, files[0], index)
    assert not out["imported_safe_open"].startswith("gpufeed"), out
    assert not out["safetensors_safe_open"].startswith("gpufeed"), out
    assert not isinstance(out["load_file_of_index"], list), out


def test_every_tensor_is_a_storage_of_its_own_so_safetensors_saves_them(tmp_path, gen):
    """As safetensors' own: each tensor of a handle (and of ``gpufeed.torch.load_file``) has a
    storage of exactly its bytes, so ``torch.save`` of one writes only it and
    ``safetensors.torch.save_file`` of a loaded dict does not refuse shared memory."""
    from safetensors.torch import load_file, save_file

    tensors = mixed_checkpoint(gen, count=8)
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    got = gpufeed.torch.load_file(path)
    ptrs = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    assert len(ptrs) == sum(1 for t in got.values() if t.numel()), "tensors share a storage"
    for name, t in got.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    again = str(tmp_path / "again.safetensors")
    save_file(got, again)
    assert_same_dict(load_file(again), tensors, "saved back by safetensors")
    with gpufeed.safe_open(path) as f:
        name = max(f.keys(), key=lambda n: tensors[n].numel())
        one = f.get_tensor(name)
    import io

    buf = io.BytesIO()
    torch.save(one, buf)
    assert buf.tell() < one.numel() * one.element_size() + 4096, \
        f"torch.save of one tensor wrote {buf.tell()} bytes"


def test_unpatch_restores_modules_that_imported_while_patched(tmp_path):
    """``safetensors.torch`` (and any module) imported while the patch was on binds the routed
    function; after ``unpatch_safetensors`` every such binding is safetensors' own, and a copy
    kept elsewhere calls safetensors'."""
    code = r"""
import sys, gpufeed
gpufeed.patch_safetensors()
import safetensors.torch
from safetensors import safe_open as kept
assert getattr(safetensors.torch.safe_open, "__gpufeed__", False), "routed while on"
gpufeed.unpatch_safetensors()
assert not getattr(safetensors.torch.safe_open, "__gpufeed__", False), "left in safetensors.torch"
assert not getattr(safetensors.torch.load_file, "__gpufeed__", False), "left load_file"
print(type(kept(sys.argv[1], framework="pt")).__module__)
"""
    path = str(tmp_path / "m.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, path)
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_PATCH_SAFETENSORS"}
    run = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not run.stdout.strip().startswith("gpufeed"), run.stdout


def test_the_public_dlpack_import_serves_where_torch_has_no_private_one(tmp_path, gen,
                                                                        monkeypatch):
    """Tensors come through ``torch._C._from_dlpack`` of each array's capsule where that works
    (probed once), else through ``torch.from_dlpack``: both give the same tensors."""
    import types

    import gpufeed._safe_open as so
    from safetensors.torch import save_file

    def fake(private):
        return types.SimpleNamespace(_C=types.SimpleNamespace(**private), uint8=torch.uint8,
                                     zeros=torch.zeros, from_dlpack=torch.from_dlpack)

    assert so._importer(fake({})) is torch.from_dlpack, "no private import: the public one"

    def refuses(_capsule, *_more):
        raise TypeError("another signature")

    assert so._importer(fake({"_from_dlpack": refuses})) is torch.from_dlpack
    tensors = mixed_checkpoint(gen, count=6)
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    private = gpufeed.torch.load_file(path)
    monkeypatch.setitem(so._IMPORTERS, id(torch), torch.from_dlpack)
    public = gpufeed.torch.load_file(path)
    assert_same_dict(private, tensors, "through the private import")
    assert_same_dict(public, tensors, "through torch.from_dlpack")
