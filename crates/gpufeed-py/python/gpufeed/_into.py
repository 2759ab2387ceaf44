"""``gpufeed.load_into``: a checkpoint's tensors written into CUDA tensors the caller already
has (an inference engine's preallocated parameters, a module built on the GPU), through a
bounded staging on the device: no tensor of gpufeed's own, no second copy of the model."""

import operator
import os
from typing import Any, Dict, List, Optional

from . import _gpufeed
from ._gpufeed import GpufeedError
from ._safe_open import _DTYPES, SafetensorError, _is_url, _torch, _translated


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
              plan: Optional[Dict[str, Optional[slice]]] = None) -> IncompatibleKeys:
    """Writes the tensors of the safetensors file or sharded checkpoint (``*.index.json``)
    ``path`` into ``tensors`` (a dict of contiguous CUDA tensors of one device, by name), or
    into ``model``'s parameters and buffers (``model.state_dict(keep_vars=True)``).

    Every destination is checked against the headers before a byte moves: the same dtype,
    shape and size (a mismatch raises ``SafetensorError`` listing them; cast after loading),
    no two overlapping (the same tensor under two names, as tied weights are, is allowed).
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

    ``plan`` maps names to ``None`` (the whole tensor) or a step-1 ``slice`` of the tensor's
    rows (its first dimension, as ``prefetch`` plans): that name's destination then holds
    those rows only (shape ``[stop - start, *rest]``), and only their bytes are read, as a
    tensor-parallel rank's share of a row-split weight. Bounds out of range, other steps and
    0-d tensors are refused before a byte moves.

        model = MyModel(config).to_empty(device="cuda:0")   # or built under torch.device
        missing, unexpected = gpufeed.load_into("model.safetensors.index.json", model=model)
        # rank r of w: rows r * n // w to (r + 1) * n // w of a row-split weight
        gpufeed.load_into(path, {"w": shard}, plan={"w": slice(r * n // w, (r + 1) * n // w)})
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


def _plan_slices(plan, names):
    """``plan`` as the native side takes it: per name of ``names``, ``None`` or a slice's
    ``(start, stop, step)``; the rows themselves are checked against the headers there."""
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise SafetensorError("a load_into plan is a dict of tensor names to None or a slice")
    known = set(names)
    for name, value in plan.items():
        if name not in known:
            raise SafetensorError(
                f"load_into plan names {name!r}, which has no destination among the tensors given"
            )
        if value is not None and not isinstance(value, slice):
            raise SafetensorError(
                f"load_into plan values must be None or a slice, got {type(value).__name__} "
                f"for {name}"
            )
    out = []
    for name in names:
        value = plan.get(name)
        out.append(None if value is None else tuple(_bound(name, v) for v in
                                                    (value.start, value.stop, value.step)))
    return out


def _bound(name, v):
    """A slice bound as an int (numpy integers too) or None; within what the native side
    takes (a 64-bit integer; anything larger is out of range for every tensor anyway)."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise SafetensorError(f"load_into plan slice bounds for {name} must be integers or None")
    try:
        v = operator.index(v)
    except TypeError:
        raise SafetensorError(
            f"load_into plan slice bounds for {name} must be integers or None"
        ) from None
    return max(min(v, 2**62), -(2**62))
