"""Routes ``safetensors.safe_open`` (framework ``"pt"``, CPU and CUDA devices) and
``safetensors.torch.load_file`` (CPU and CUDA devices) to gpufeed, process-wide:
``gpufeed.patch_safetensors()``; ``gpufeed.unpatch_safetensors()`` puts safetensors' own back.
Other frameworks and devices (numpy, mps, npu, ...) go to safetensors as before.

Modules that did ``from safetensors import safe_open`` before the patch (transformers does, at
import) are routed too: every module attribute that is safetensors' function is replaced. A
``safetensors`` imported after the patch is patched as it is imported, so the patch can be
applied at start-up without importing torch: ``GPUFEED_PATCH_SAFETENSORS=1`` in the
environment does it in every Python process (through ``gpufeed-patch.pth``, installed with the
package: it then imports gpufeed, its native module and safetensors at start-up, ~20 ms), or at
``import gpufeed``. Where the variable is unset the ``.pth`` line costs one environment lookup.
A copy of a routed function that outlives ``unpatch_safetensors`` calls safetensors' own.
"""

import importlib.abc
import os
import sys
import threading
import types

ENV_VAR = "GPUFEED_PATCH_SAFETENSORS"

_lock = threading.RLock()
_UNSET = object()
_originals = {}  # ("safetensors" | "safetensors.torch", attribute) -> safetensors' object
_replaced = []  # (module dict, name, original) for modules routed by attribute
_finder = None


def _gpufeed_device(device) -> bool:
    """Whether gpufeed serves ``device`` (the CPU and CUDA devices)."""
    from ._safe_open import SafetensorError, device_ordinal

    try:
        device_ordinal(device)
    except SafetensorError:
        return False
    return True


class _RoutingMeta(type):
    """The class of a routed ``safe_open``: calling it opens through gpufeed or safetensors
    (see ``_routed_safe_open``), and ``isinstance(x, safetensors.safe_open)`` holds for the
    handles of both."""

    def __call__(cls, filename, framework, device="cpu", *, backend=_UNSET):
        original = cls.__dict__["__wrapped__"]
        # A copy of this class may outlive the patch in a module that imported it while it
        # was on: once unpatched it is safetensors' own again.
        if _finder is not None and framework in ("pt", "torch", "pytorch") \
                and _gpufeed_device(device):
            from ._safe_open import safe_open as gpufeed_safe_open

            return gpufeed_safe_open(filename, framework, device,
                                     backend="mmap" if backend is _UNSET else backend)
        # `backend` only where the caller gave it: safetensors before 0.9 has none.
        if backend is _UNSET:
            return original(filename, framework, device)
        return original(filename, framework, device, backend=backend)

    def __instancecheck__(cls, obj) -> bool:
        from ._safe_open import safe_open as gpufeed_safe_open

        return isinstance(obj, (cls.__dict__["__wrapped__"], gpufeed_safe_open))


def _routed_safe_open(original):
    return _RoutingMeta("safe_open", (), {
        "__doc__": original.__doc__,
        "__module__": getattr(original, "__module__", "safetensors"),
        "__gpufeed__": True,
        "__wrapped__": original,
    })


def _routed_load_file(original):
    def load_file(filename, device="cpu", **kwargs):
        if _finder is not None and _gpufeed_device(device) and set(kwargs) <= {"backend"}:
            from .torch import load_file as gpufeed_load_file

            return gpufeed_load_file(filename, device=device, **kwargs)
        return original(filename, device=device, **kwargs)

    load_file.__doc__ = original.__doc__
    load_file.__gpufeed__ = True
    load_file.__wrapped__ = original
    return load_file


_ROUTES = {
    ("safetensors", "safe_open"): _routed_safe_open,
    ("safetensors.torch", "safe_open"): _routed_safe_open,
    ("safetensors.torch", "load_file"): _routed_load_file,
}


def _apply(module_name):
    """Patches ``module_name`` (imported) and every module holding its originals."""
    module = sys.modules.get(module_name)
    if module is None:
        return
    for (mod, attr), route in _ROUTES.items():
        if mod != module_name:
            continue
        current = getattr(module, attr, None)
        if current is None or getattr(current, "__gpufeed__", False):
            continue
        _originals[(mod, attr)] = current
        setattr(module, attr, route(current))
    originals = {id(o): (k, o) for k, o in _originals.items()}
    for name, other in list(sys.modules.items()):
        if other is None or name in ("safetensors", "safetensors.torch"):
            continue
        d = getattr(other, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for attr, value in list(d.items()):
            hit = originals.get(id(value))
            if hit is not None and hit[1] is value:
                (mod, orig_attr), original = hit
                routed = getattr(sys.modules[mod], orig_attr)
                d[attr] = routed
                _replaced.append((d, attr, original))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``safetensors`` and ``safetensors.torch`` right after they are imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in ("safetensors", "safetensors.torch") or _finder is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def patched_exec(module, _exec=exec_module, _name=fullname):
            _exec(module)
            with _lock:
                if _finder is not None:
                    _apply(_name)

        try:
            loader.exec_module = patched_exec  # type: ignore[method-assign]
        except (AttributeError, TypeError):
            return spec
        return spec


def patch_safetensors() -> None:
    """Routes safetensors' ``safe_open`` and ``torch.load_file`` to gpufeed in this process
    (see the module); calling it again does nothing."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
        for name in ("safetensors", "safetensors.torch"):
            _apply(name)


def unpatch_safetensors() -> None:
    """Puts safetensors' own functions back everywhere the patch replaced them."""
    global _finder
    with _lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        for (mod, attr), original in _originals.items():
            module = sys.modules.get(mod)
            if module is not None:
                setattr(module, attr, original)
        for d, attr, original in _replaced:
            if getattr(d.get(attr), "__gpufeed__", False):
                d[attr] = original
        # Modules that imported a routed function while the patch was on (safetensors.torch
        # imported after it, transformers under GPUFEED_PATCH_SAFETENSORS): safetensors' own.
        for other in list(sys.modules.values()):
            d = getattr(other, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for attr, value in list(d.items()):
                # Only plain functions are looked into: an attribute lookup on any other
                # object may run its code (torch's lazy modules do).
                if type(value) in (types.FunctionType, _RoutingMeta) and \
                        value.__dict__.get("__gpufeed__") is True:
                    d[attr] = value.__dict__["__wrapped__"]
        _originals.clear()
        _replaced.clear()


def is_patched() -> bool:
    """Whether the patch is on."""
    return _finder is not None


def _at_startup() -> None:
    """What ``gpufeed-patch.pth`` runs in every Python process where ``GPUFEED_PATCH_SAFETENSORS``
    is set (and not ``0``)."""
    if os.environ.get(ENV_VAR, "") not in ("", "0"):
        patch_safetensors()
