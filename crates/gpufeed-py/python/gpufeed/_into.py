"""``gpufeed.load_into``: a checkpoint's tensors written into CUDA tensors the caller already
has (an inference engine's preallocated parameters, a module built on the GPU), through a
bounded staging on the device: no tensor of gpufeed's own, no second copy of the model."""

import os
from typing import Any, Dict, List, Optional

from . import _gpufeed
from ._gpufeed import GpufeedError
from ._safe_open import (_DTYPES, SafetensorError, _NoGpu, _as_int, _is_url, _numel, _strides,
                         _torch, _translated)


class IncompatibleKeys:
    """What ``load_into`` did not write, as ``torch.nn.Module.load_state_dict`` reports it:
    ``missing_keys`` (names given that the checkpoint lacks) and ``unexpected_keys``
    (checkpoint tensors nobody asked for); unpacks as ``missing, unexpected = ...``."""

    def __init__(self, missing_keys: List[str], unexpected_keys: List[str]):
        self.missing_keys = missing_keys
        self.unexpected_keys = unexpected_keys

    def __iter__(self):
        return iter((self.missing_keys, self.unexpected_keys))

    def __repr__(self) -> str:
        return (f"IncompatibleKeys(missing_keys={self.missing_keys}, "
                f"unexpected_keys={self.unexpected_keys})")


def _safetensors_dtypes(torch) -> Dict[Any, str]:
    """torch dtype -> its safetensors name (packed types left out)."""
    return {
        getattr(torch, attr): name
        for name, (attr, _, packed) in _DTYPES.items()
        if not packed and hasattr(torch, attr)
    }


def load_into(path, tensors: Optional[Dict[str, Any]] = None, *, model=None, strict: bool = True,
              staging_bytes: Optional[int] = None,
              plan: Optional[Dict[str, Any]] = None) -> IncompatibleKeys:
    """Writes the tensors of the safetensors file or sharded checkpoint (``*.index.json``)
    ``path`` into ``tensors`` (a dict of contiguous CUDA tensors of one device, by name), or
    into ``model``'s parameters and buffers (``model.state_dict(keep_vars=True)``).

    Every destination is checked against the headers before a byte moves: the same shape
    and size, no two overlapping (the same tensor under two names, as tied weights are, is
    allowed), and the same dtype, or another floating dtype the GPU casts into on the way
    (BF16, F16 and F32 to one another, F8_E4M3 and F8_E5M2 to each of those; bit for bit as
    torch's ``.to`` on the GPU); a mismatch raises ``SafetensorError`` listing them.
    With ``strict`` (the default), a name the checkpoint lacks or a checkpoint tensor not
    asked for raises, as ``load_state_dict`` does; otherwise the tensors both have are written
    and the others returned. The bytes go through two device staging buffers of
    ``staging_bytes`` each (default 512 MiB): device memory beyond yours is that and the
    driver's share with it (10 MiB beside two of 512 MiB on an H200), and each file's reads
    overlap the device copies out of the chunk before. Work queued on the
    tensors' device is waited for first; the tensors are ready on every stream when this
    returns. A read that fails midway leaves the tensors written so far (as a failed
    ``load_state_dict`` does), and no copy runs after the error is raised. A module's extra
    state (``get_extra_state``) is left out of ``model=``.

    ``plan`` maps names to ``None`` (the whole tensor), a step-1 ``slice`` of the tensor's
    rows (its first dimension, as ``prefetch`` plans), or a tuple of slices that narrows one
    dimension (``(slice(None), slice(a, b))``: columns ``a:b``, as ``tensor[:, a:b]``): that
    name's destination then holds that part only, contiguous (shape ``[stop - start, *rest]``
    for rows), as a tensor-parallel rank's share of a split weight. For rows only their bytes
    are read; for another dimension, the span from the part's first run to its last (the
    other ranks' columns between them included), and each run lands in place by one pitched
    device copy (or pitched cast) per staging chunk. Bounds out of range, other steps, two
    narrowed dimensions, Ellipsis and 0-d tensors are refused before a byte moves.

        model = MyModel(config).to_empty(device="cuda:0")   # or built under torch.device
        missing, unexpected = gpufeed.load_into("model.safetensors.index.json", model=model)
        # rank r of w: rows r * n // w to (r + 1) * n // w of a row-split weight
        gpufeed.load_into(path, {"w": shard}, plan={"w": slice(r * n // w, (r + 1) * n // w)})
        # and columns of a column-split one (a row-parallel layer's weight)
        gpufeed.load_into(path, {"o": part}, plan={"o": (slice(None), slice(r * k, (r + 1) * k))})
    """
    if (tensors is None) == (model is None):
        raise TypeError("load_into takes tensors (a dict of CUDA tensors) or model=, one of them")
    if _is_url(path):
        raise SafetensorError(
            f"{path}: load_into reads local files; load an object with gpufeed.load_safetensors"
        )
    torch = _torch()
    if model is not None:
        # A module's extra state (`get_extra_state`) is no tensor of a checkpoint.
        tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()
                   if isinstance(v, torch.Tensor)}
    by_dtype = _safetensors_dtypes(torch)
    names, ptrs, nbytes, dtypes, shapes = [], [], [], [], []
    # The tensors written into, held here for the call (another thread may change `tensors`
    # while the copies run).
    held = []
    ordinal = None
    for name, t in tensors.items():
        # Cheap accessors only: this loop runs once per tensor (4,096 of them in a 4 GiB model
        # of 1 MiB tensors), inside the load's time.
        if not isinstance(t, torch.Tensor):
            raise SafetensorError(f"{name}: a {type(t).__name__}, not a torch.Tensor")
        if not t.is_cuda:
            raise SafetensorError(
                f"{name} is on {t.device}: load_into writes into CUDA tensors (allocate them "
                "on the GPU first, e.g. model.to_empty(device='cuda:0'))"
            )
        index = t.get_device()
        if ordinal is None:
            ordinal = index
        elif index != ordinal:
            raise SafetensorError(
                f"{name} is on cuda:{index}, earlier tensors on cuda:{ordinal}: one device per call"
            )
        if not t.is_contiguous():
            raise SafetensorError(
                f"{name} is not contiguous: load_into writes each tensor's bytes in one piece"
            )
        dtype = by_dtype.get(t.dtype)
        if dtype is None:
            raise SafetensorError(
                f"{name}: load_into does not write {t.dtype} tensors (packed types such as "
                "float4_e2m1fn_x2 included): load them with safe_open(...).get_tensor"
            )
        held.append(t)
        names.append(name)
        ptrs.append(t.data_ptr())
        nbytes.append(t.nbytes)
        dtypes.append(dtype)
        shapes.append(t.shape)
    slices = _plan_slices(plan, names)
    path = os.fspath(path)
    if ordinal is None:
        # Nothing to write into: every checkpoint tensor is unexpected (no GPU needed).
        try:
            keys = [n for f in _gpufeed.open_safetensors(path) for n in f.entries(0)[0]]
        except GpufeedError as e:
            raise _translated(e, path) from None
        if strict and keys:
            raise SafetensorError(
                f"{path}: nothing was written (strict): no destinations for the checkpoint's "
                f"{len(keys)} tensors"
            )
        return IncompatibleKeys([], keys)
    # Work queued on the device into the destinations (on any stream) ends before the copies.
    torch.cuda.synchronize(ordinal)
    try:
        missing, unexpected, _, _, _ = _gpufeed.load_into(
            path, ordinal, names, ptrs, nbytes, dtypes, shapes, strict, staging_bytes, slices
        )
    except GpufeedError as e:
        raise _translated(e, path) from None
    finally:
        del held
    return IncompatibleKeys(missing, unexpected)


# The casts the kernels do on the way: from these safetensors types to these.
_CAST_FROM = ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_CAST_TO = ("F32", "F16", "BF16")


def _load_cast(path, device: int, dtype) -> Dict[str, Any]:
    """``load_safetensors(path, device, dtype=dtype)``: every floating tensor of the checkpoint
    in ``dtype``, cast on the GPU on the way (see ``load_safetensors``)."""
    torch = _torch()
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        dtype = named if isinstance(named, torch.dtype) else dtype
    by_dtype = _safetensors_dtypes(torch)
    to = by_dtype.get(dtype) if isinstance(dtype, torch.dtype) else None
    if to not in _CAST_TO:
        raise SafetensorError(
            f"dtype={dtype!r}: load_safetensors casts to torch.bfloat16, torch.float16 or "
            "torch.float32 (load without dtype= and cast for others)"
        )
    if _is_url(path):
        raise SafetensorError(
            f"{path}: dtype= loads local files; load the object without it and cast after"
        )
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be a GPU's ordinal (an int), got {device!r}")
    path = os.fspath(path)
    from . import load_safetensors  # noqa: PLC0415 (the package imports this module)
    from ._safe_open import _dtype, safe_open  # noqa: PLC0415 (it imports this module)

    with safe_open(path, framework="pt", device="cpu") as f:
        metas = [(k, f.get_tensor_meta(k)) for k in f.keys()]
    names, dtypes, haves, shapes, later, apart = [], [], [], [], [], []
    # Per destination type: its tensors' element offsets in one buffer, and the total.
    offsets, totals = [], {}
    for name, meta in metas:
        have = meta.dtype
        td, _, packed = _dtype(torch, have)
        if packed:
            apart.append(name)  # loaded as it is (no destination of its type): F4
            continue
        out = to if have in _CAST_FROM else have
        if out == have and have != to and td.is_floating_point:
            later.append(name)  # a floating type the kernels do not read (F64...): torch casts
        # Each tensor 256-byte aligned in its buffer, as torch's allocator places tensors:
        # kernels (cuBLAS's) choose by alignment, and a tensor at an odd address multiplies
        # slower and to other bits than the same tensor allocated alone.
        step = max(1, 256 // _DTYPES[out][1])
        at = -(-totals.get(out, 0) // step) * step
        offsets.append(at)
        totals[out] = at + _numel(meta.shape)
        names.append(name)
        dtypes.append(out)
        haves.append(have)
        shapes.append(list(meta.shape))
    casting = [n for n, k, have in zip(names, dtypes, haves) if k != have]
    if not casting and not later:
        return load_safetensors(path, device)  # nothing to cast: the file's own load
    if not torch.cuda.is_available():
        raise _NoGpu(
            f"{path}: dtype= casts on a GPU and torch sees none (torch.cuda.is_available() is "
            "False); load on the CPU with gpufeed.torch.load_file and cast there"
        )
    if torch.cuda.get_device_capability(device) < (8, 0):
        # No cast kernels before compute capability 8.0: torch casts each tensor after the
        # file's own load (both copies of a tensor held for a moment).
        loaded = load_safetensors(path, device)
        for name in casting + later:
            loaded[name] = loaded[name].to(dtype)
        return loaded
    where = f"cuda:{device}"
    bufs = {k: torch.empty(n, dtype=getattr(torch, _DTYPES[k][0]), device=where)
            for k, n in totals.items()}
    ptrs = [bufs[k].data_ptr() + o * _DTYPES[k][1] for k, o in zip(dtypes, offsets)]
    nbytes = [_numel(sh) * _DTYPES[k][1] for k, sh in zip(dtypes, shapes)]
    # Work queued before into the memory these buffers reuse ends before the writes.
    torch.cuda.synchronize(device)
    try:
        _gpufeed.load_into(path, device, names, ptrs, nbytes, dtypes, shapes, not apart, None,
                           None)
    except GpufeedError as e:
        raise _translated(e, path) from None
    out = {}
    for name, k, shape, o in zip(names, dtypes, shapes, offsets):
        out[name] = bufs[k].as_strided(shape, _strides(shape), o)
    for name in later:
        out[name] = out[name].to(dtype)
    if apart:
        with safe_open(path, framework="pt", device=where) as f:
            for name in apart:
                out[name] = f.get_tensor(name)
    return out


def _plan_slices(plan, names):
    """``plan`` as the native side takes it: per name of ``names``, ``None`` or ``(dim,
    (start, stop, step))``: a slice is of the rows (dimension 0), a tuple of slices narrows the
    one dimension whose slice is not ``slice(None)`` (``(slice(None), slice(a, b))``: columns
    ``a:b``); the bounds themselves are checked against the headers there."""
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise SafetensorError("a load_into plan is a dict of tensor names to None, a slice or "
                              "a tuple of slices")
    known = set(names)
    parts = {}
    for name, value in plan.items():
        if name not in known:
            raise SafetensorError(
                f"load_into plan names {name!r}, which has no destination among the tensors given"
            )
        parts[name] = _part(name, value)
    out = []
    for name in names:
        part = parts.get(name)
        out.append(None if part is None else (part[0], tuple(_bound(name, v) for v in
                                                             (part[1].start, part[1].stop,
                                                              part[1].step))))
    return out


def _part(name, value):
    """A plan's value as ``(dim, slice)``, or None for the whole tensor."""
    if value is None:
        return None
    if isinstance(value, slice):
        return (0, value)
    if isinstance(value, tuple) and any(v is Ellipsis for v in value):
        raise SafetensorError(
            f"load_into plan for {name}: give each dimension up to the narrowed one as "
            "slice(None) (no Ellipsis)"
        )
    if isinstance(value, tuple) and all(isinstance(v, slice) for v in value):
        narrowed = [(d, v) for d, v in enumerate(value) if not _whole(v)]
        if len(narrowed) > 1:
            raise SafetensorError(
                f"load_into plan for {name} narrows {len(narrowed)} dimensions; a part is a "
                "slice of one dimension (the others slice(None))"
            )
        return narrowed[0] if narrowed else None
    raise SafetensorError(
        f"load_into plan values must be None, a slice or a tuple of slices, got "
        f"{type(value).__name__} for {name}"
    )


def _whole(v: slice) -> bool:
    """Whether the slice ``v`` takes a whole dimension whatever its length."""
    return v.start in (None, 0) and v.stop is None and v.step in (None, 1)


def _bound(name, v):
    """A slice bound as an int (numpy integers too) or None; within what the native side
    takes (a 64-bit integer; anything larger is out of range for every tensor anyway)."""
    if v is None:
        return None
    i = _as_int(v)
    if i is None:
        raise SafetensorError(f"load_into plan slice bounds for {name} must be integers or None")
    return max(min(i, 2**62), -(2**62))
