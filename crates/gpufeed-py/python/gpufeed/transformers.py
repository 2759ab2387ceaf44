"""A transformers model ready in one call, its weights loaded by gpufeed:

    import torch
    import gpufeed.transformers
    model = gpufeed.transformers.from_pretrained("llama-dir", device="cuda:0", dtype=torch.bfloat16)

``from_pretrained`` builds the model's skeleton with its parameters on the meta device (no
memory, no random initialization; buffers are computed by the model's own constructor, as
transformers computes them), while gpufeed loads the checkpoint (``model.safetensors`` or the
shards of ``model.safetensors.index.json``) on a thread; then it puts the loaded tensors in
place (no copy where the dtype is the model's; cast on the GPU on the way where it is not:
``gpufeed.load_safetensors(dtype=)``),
ties the tied weights, moves the buffers to the device and returns the model in eval mode.
The parameters and the logits are those of transformers' own ``from_pretrained`` with the same
``dtype`` and ``device_map=device``, bit for bit.

transformers is imported by this module only: ``import gpufeed`` never imports it. A model whose
checkpoint names are not its parameter names (transformers renames or fuses some models'
weights on load) is refused with the names, rather than loaded differently.
"""

import contextlib
import fnmatch
import operator
import os
import re
import threading
import warnings
from os import PathLike
from typing import Any, Dict, Optional, Union

from ._safe_open import _dtype, device_ordinal, safe_open

__all__ = ["from_pretrained"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _checkpoint_of(path: str) -> str:
    """The checkpoint file of a model directory (the index where there are shards), or
    ``path`` itself where it is a file."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for name in (_INDEX, _SINGLE):
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                return candidate
        raise FileNotFoundError(
            f"{path}: no {_INDEX} or {_SINGLE} in it (gpufeed loads the safetensors "
            "checkpoints that save_pretrained writes)"
        )
    raise FileNotFoundError(
        f"{path}: no such directory (gpufeed.transformers loads a model saved on this machine; "
        "fetch a Hub model first, e.g. with huggingface_hub.snapshot_download)"
    )


@contextlib.contextmanager
def _parameters_on_meta(torch):
    """Modules built meanwhile keep their parameters on the meta device (as accelerate's
    ``init_empty_weights(include_buffers=False)``): no memory and no initialization for them,
    while buffers are made where and as the model's constructor makes them."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            made = module._parameters[name]
            kwargs = dict(made.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(made)(made.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _rank_and_world(rank, world_size):
    """The rank and world size of a tensor-parallel load: as given, else torchrun's."""
    if rank is None:
        rank = os.environ.get("RANK")
    if world_size is None:
        world_size = os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        raise ValueError("tp_plan needs rank and world_size (or torchrun's RANK and WORLD_SIZE)")
    def whole(v):
        if isinstance(v, str):
            return int(v)
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)

    try:
        rank, world_size = whole(rank), whole(world_size)
    except (TypeError, ValueError):
        raise ValueError(f"rank {rank!r} and world_size {world_size!r} must be integers") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: want 0 <= rank < world_size")
    return rank, world_size


_SPLITS = {"rows": 0, "columns": 1}


def _tp_parts(tp_plan, params, rank: int, world: int):
    """name -> (dim, start, stop) of each parameter (of ``params``, by name, tied ones under
    each of their names) ``tp_plan`` splits, rank ``rank``'s share. A pattern that matches no
    parameter is refused (a typo would load every weight whole)."""
    if not isinstance(tp_plan, dict):
        raise ValueError("tp_plan is a dict of parameter names (or patterns) to 'rows' or 'columns'")
    for pattern, split in tp_plan.items():
        if split not in _SPLITS:
            raise ValueError(f"tp_plan[{pattern!r}] is {split!r}: give 'rows' or 'columns'")
    parts, used = {}, set()
    for name, t in params.items():
        pattern = next((p for p in tp_plan if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        used.add(pattern)
        split = tp_plan[pattern]
        dim = _SPLITS[split]
        if t.dim() <= dim:
            raise ValueError(
                f"tp_plan splits {name} by {split}, but it has shape {tuple(t.shape)}"
            )
        n = t.shape[dim]
        parts[name] = (dim, rank * n // world, (rank + 1) * n // world)
    unused = [p for p in tp_plan if p not in used]
    if unused:
        raise ValueError(f"tp_plan: {unused} match no parameter of the model")
    return parts


def _share_shape(shape, part):
    """``shape`` narrowed as ``part`` ((dim, start, stop), or None for the whole)."""
    if part is None:
        return shape
    dim, start, stop = part
    out = list(shape)
    out[dim] = stop - start
    return type(shape)(out) if not isinstance(shape, list) else out


def _load_shares(torch, checkpoint, model, parts, ordinal, target, load_file):
    """The checkpoint's tensors (the model's, planned ones as their shares) and the names of
    those left unloaded: on a GPU by ``load_into`` into new tensors of each parameter's dtype
    (only the shares' bytes read, cast on the way where the kernels cast the pair, by torch
    after where they do not; tensors the model lacks not read), on the CPU by the files' views,
    planned ones narrowed and copied. A planned tensor of another shape than the model's is
    refused before its share is taken."""
    from . import load_into
    from ._into import _CAST_FROM, _CAST_TO, _safetensors_dtypes

    wanted = model.state_dict(keep_vars=True)

    def whole_shape(name, shape):
        # A planned tensor's share is taken of the checkpoint's: it must be the model's.
        have = wanted[name]
        if tuple(shape) != tuple(have.shape):
            raise ValueError(
                f"{checkpoint}: tensor {name} has shape {tuple(shape)}, the model's "
                f"{tuple(have.shape)}"
            )

    if ordinal is None:
        full = load_file(checkpoint, device="cpu")
        out = {}
        for name, t in full.items():
            if name in parts:
                whole_shape(name, t.shape)
                dim, start, stop = parts[name]
                t = t.narrow(dim, start, stop - start).contiguous()
            out[name] = t
        return out, []
    with safe_open(checkpoint, framework="pt", device="cpu") as f:
        metas = {k: f.get_tensor_meta(k) for k in f.keys()}
    names = _safetensors_dtypes(torch)
    dests, plan, later, extra = {}, {}, {}, []
    for name, meta in metas.items():
        have = wanted.get(name)
        if have is None:
            extra.append(name)
            continue
        if name in parts:
            whole_shape(name, meta.shape)
        shape = _share_shape(list(have.shape), parts.get(name))
        to = names.get(have.dtype)
        stored = _dtype(torch, meta.dtype)[0]
        if not (have.is_floating_point() and stored.is_floating_point):
            dtype = stored  # no cast, as a load without a plan
        elif meta.dtype == to or (meta.dtype in _CAST_FROM and to in _CAST_TO):
            dtype = have.dtype  # as it is, or cast on the way
        else:
            # A pair the kernels do not cast (F64 into BF16...): torch casts after.
            dtype = stored
            later[name] = have.dtype
        dests[name] = torch.empty(shape, dtype=dtype, device=target)
        if name in parts:
            dim, start, stop = parts[name]
            plan[name] = slice(start, stop) if dim == 0 else (slice(None), slice(start, stop))
    load_into(checkpoint, dests, strict=False, plan=plan)
    for name, dtype in later.items():
        dests[name] = dests[name].to(dtype)
    return dests, extra


def _put(torch, model, name, t):
    """``t`` in place of the parameter or buffer ``name`` of ``model``, whatever its shape."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = torch.nn.Parameter(t, requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = t


def _dtype_of(torch, dtype, config, checkpoint: str):
    """The dtype to build the model in: ``dtype`` (a ``torch.dtype`` or its name), else the
    config's, else that of the checkpoint's first floating tensor (``"auto"``, as transformers
    5 chooses)."""
    if isinstance(dtype, str) and dtype != "auto":
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype")
        return named
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        raise ValueError(f"dtype {dtype!r}: give a torch.dtype, its name, or 'auto'")
    for attr in ("dtype", "torch_dtype"):
        found = getattr(config, attr, None)
        if isinstance(found, str):
            found = getattr(torch, found, None)
        if isinstance(found, torch.dtype):
            return found
    from . import safe_open

    first = checkpoint
    if checkpoint.endswith(".json"):
        import json

        with open(checkpoint) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
        if not files:
            return torch.float32
        first = os.path.join(os.path.dirname(checkpoint), files[0])
    with safe_open(first, framework="pt", device="cpu") as f:
        for name in f.offset_keys():
            t = f.get_slice(name)
            got = getattr(torch, _TORCH_NAMES.get(t.get_dtype(), ""), None)
            if isinstance(got, torch.dtype) and got.is_floating_point:
                return got
    return torch.float32


_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def from_pretrained(
    path: Union[str, "PathLike[str]"],
    *,
    device: Union[str, int, Any] = "cuda:0",
    dtype: Any = None,
    model_class: Any = None,
    tp_plan: Optional[Dict[str, str]] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    **config_kwargs: Any,
):
    """The transformers model saved in directory ``path`` (by ``save_pretrained``: a
    ``config.json`` and ``model.safetensors`` or its shards with
    ``model.safetensors.index.json``), on ``device`` (``"cuda:N"``, ``N``, a ``torch.device``
    or ``"cpu"``), in ``dtype`` (a ``torch.dtype`` or its name; ``None``/``"auto"``: the
    config's, else the checkpoint's), in eval mode. ``model_class`` is the class to build
    (default ``transformers.AutoModelForCausalLM``; any ``Auto*`` class, built by its
    ``from_config``, or model class, built by its ``_from_config``); ``config_kwargs`` go to
    ``AutoConfig.from_pretrained``.

    Tensor parallelism: ``tp_plan`` maps parameter names (or ``fnmatch`` patterns of them,
    ``"model.layers.*.self_attn.q_proj.weight"``; the first that matches wins; a pattern that
    matches no parameter is refused) to ``"rows"`` or ``"columns"``; rank ``rank`` of
    ``world_size`` then gets rows (columns) ``rank * n // world_size`` to ``(rank + 1) * n //
    world_size`` of each planned parameter, as its own tensor of that shape, and the other
    tensors whole. ``rank`` and ``world_size`` default to torchrun's ``RANK`` and
    ``WORLD_SIZE``, the whole job's: where tensor parallelism spans a group of it (beside data
    or pipeline parallelism), give the rank within the group and the group's size. Tied
    parameters must be planned alike under each name. On a GPU only those bytes move: rows
    read only theirs; columns read the span from their first run to their last (``gpufeed.load_into`` with ``plan=``), cast on the way
    to each parameter's dtype. The model's modules keep their shapes' other attributes: the
    caller wraps them in its parallel layers (the forward of the returned model is a rank's
    share, not the model's). The skeleton is built before the load starts.

    Raises ``FileNotFoundError`` for a missing directory or checkpoint, ``ValueError`` where
    the checkpoint lacks parameters the model has (naming them) or the model keeps modules in
    float32 under another dtype (``_keep_in_fp32_modules``), and gpufeed's load errors.
    Checkpoint tensors the model does not have are left out with a warning, as transformers
    does.

    Memory: tensors in the model's dtype are views of one device buffer per checkpoint file
    (a file's buffer lives while any of its tensors does); on a GPU a view whose address is not
    a multiple of 256 bytes (after a tensor of an odd size in the file) is copied into an
    allocation of its own, as cuBLAS picks kernels by alignment and transformers' parameters
    are allocations of their own (its bytes in the file's buffer stay held: a checkpoint whose
    first tensor has an odd size can hold up to twice the model's memory). On a GPU, a checkpoint in another
    floating dtype (BF16, F16, F32, FP8) is cast on the way into one buffer per dtype through a
    bounded staging (``gpufeed.load_safetensors(dtype=)``): the model's memory and that staging,
    never both copies. On the CPU a cast makes a tensor of its own, so a load that casts holds
    both for a moment. Under ``tp_plan`` each tensor is an allocation of its own on a GPU; on
    the CPU planned shares are copies and the rest views of the files. While the skeleton is
    built, ``torch.nn.Module.register_parameter`` is patched process-wide: modules built on other
    threads meanwhile get their parameters on the meta device too.
    """
    import torch
    import transformers

    from . import load_safetensors
    from .torch import load_file

    root = os.fspath(path)
    checkpoint = _checkpoint_of(root)
    directory = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    ordinal = device_ordinal(device)
    target = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
    config = transformers.AutoConfig.from_pretrained(directory, **config_kwargs)
    dtype = _dtype_of(torch, dtype, config, checkpoint)

    if tp_plan is not None:
        rank, world_size = _rank_and_world(rank, world_size)
    elif rank is not None or world_size is not None:
        raise ValueError("rank and world_size go with tp_plan (a tensor-parallel load)")

    # The checkpoint loads on a thread (gpufeed gives up the GIL while bytes move) while this
    # one builds the skeleton; a tensor-parallel load needs the skeleton first (its shares
    # are of the model's parameters).
    loaded: Dict[str, Any] = {}

    def load():
        try:
            if ordinal is None:
                loaded["tensors"] = load_file(checkpoint, device="cpu")
            else:
                cast = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else None
                loaded["tensors"] = load_safetensors(checkpoint, device=ordinal, dtype=cast)
        except BaseException as e:  # noqa: BLE001 (raised on the caller's thread)
            loaded["error"] = e

    worker = threading.Thread(target=load, name="gpufeed-from-pretrained", daemon=True)
    if tp_plan is None:
        worker.start()
    try:
        cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
        # Auto* classes build by `from_config`, model classes by `_from_config` (which sets
        # the default dtype while the model is built, as `from_pretrained` does).
        build = getattr(cls, "from_config", None) or cls._from_config
        with _parameters_on_meta(torch):
            try:
                model = build(config, dtype=dtype)
            except TypeError as e:
                if "dtype" not in str(e):
                    raise
                model = build(config, torch_dtype=dtype)  # transformers 4's name
    finally:
        if tp_plan is None:
            worker.join()
    fp32 = [m for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
            for m in (getattr(model, attr, None) or [])]
    if fp32 and dtype != torch.float32:
        raise ValueError(
            f"{type(model).__name__} keeps {sorted(set(fp32))} in float32 when loaded in "
            f"{dtype}, which gpufeed.transformers does not reproduce: use transformers' own "
            "from_pretrained for it, or dtype=torch.float32"
        )
    parts: Dict[str, Any] = {}
    extra: list = []
    if tp_plan is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        parts = _tp_parts(tp_plan, params, rank, world_size)
        loaded["tensors"], extra = _load_shares(torch, checkpoint, model, parts, ordinal,
                                                target, load_file)
    if "error" in loaded:
        raise loaded["error"]
    tensors = loaded.pop("tensors")  # this frame's `del tensors` below then lets them go

    wanted = model.state_dict(keep_vars=True)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                      or [])]
    unexpected = [k for k in list(tensors) + extra
                  if k not in wanted and not any(p.search(k) for p in ignore)]
    state = {}
    raw = None  # the checkpoint opened again, for tensors cast on the way to the wrong dtype
    try:
        for name, t in tensors.items():
            have = wanted.get(name)
            if have is None:
                continue
            shape = _share_shape(have.shape, parts.get(name))
            if t.shape != shape:
                raise ValueError(
                    f"{checkpoint}: tensor {name} has shape {tuple(t.shape)}, the model's "
                    f"{tuple(shape)}" + (" (its planned share)" if name in parts else "")
                )
            if t.dtype != have.dtype and t.is_floating_point() and have.is_floating_point():
                if ordinal is not None and t.dtype == dtype:
                    # Cast on the way to the model's dtype, but the model keeps this one in
                    # another (its own code made it so): cast from the checkpoint's bytes, as
                    # transformers does, not from the cast.
                    if raw is None:
                        raw = safe_open(checkpoint, framework="pt", device=target)
                    t = raw.get_tensor(name)
                if t.dtype != have.dtype:
                    t = t.to(device=target, dtype=have.dtype)
            if ordinal is not None and t.numel() and t.data_ptr() % 256:
                # A view at its file offset, off the 256-byte alignment that torch reports to
                # cuBLAS (which picks kernels by it): copied into an allocation of its own, as
                # transformers' own parameters are, or the logits could differ in their last
                # bits (GPU run 160). Checkpoints whose tensors are all multiples of 256 bytes
                # (the usual model dimensions) copy nothing.
                t = t.clone()
            if name in parts:
                _put(torch, model, name, t)  # a share: not the shape load_state_dict checks
            else:
                state[name] = t
    finally:
        if raw is not None:
            raw.close()
    placed = set(parts) & set(tensors)  # planned shares put in place, not missing
    del tensors
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    try:
        # transformers 5 ties only what the checkpoint lacks (as its from_pretrained does).
        model.tie_weights(missing_keys=set(result.missing_keys) - placed)
    except TypeError:
        model.tie_weights()  # transformers 4
    if parts:
        now = dict(model.named_parameters(remove_duplicate=False))
        for name, part in parts.items():
            have = now.get(name)
            want = _share_shape(list(params[name].shape), part)
            if have is not None and have.device.type != "meta" and list(have.shape) != want:
                raise ValueError(
                    f"{name} is tied to a tensor the plan does not split alike (it has shape "
                    f"{tuple(have.shape)}, its share {tuple(want)}): plan every tied name the "
                    "same way"
                )
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta"]
    if left:
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise ValueError(
            f"{checkpoint} lacks {len(left)} of the model's tensors ({shown}); where the model "
            "renames or fuses its weights on load, use transformers' own from_pretrained"
        )
    if unexpected:
        warnings.warn(
            f"{checkpoint}: {len(unexpected)} tensors the model does not have were left out: "
            + ", ".join(unexpected[:8]),
            stacklevel=2,
        )
    model.to(target)
    generation = os.path.join(directory, "generation_config.json")
    if getattr(model, "can_generate", lambda: False)() and os.path.isfile(generation):
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.eval()
    return model
