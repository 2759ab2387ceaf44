"""``safetensors.torch``'s loading functions with gpufeed underneath: ``load_file(filename,
device="cpu")`` and ``load(data)``, same signatures, same results.

    import gpufeed.torch
    weights = gpufeed.torch.load_file("model.safetensors", device="cuda:0")
"""

from os import PathLike
from typing import Any, Dict, Union

from ._safe_open import load_bytes, safe_open

__all__ = ["load", "load_file"]


def load_file(
    filename: Union[str, "PathLike[str]"],
    device: Union[str, int] = "cpu",
    *,
    backend: str = "mmap",
) -> Dict[str, Any]:
    """Every tensor of a safetensors file (or of a sharded checkpoint's ``*.index.json``) on
    ``device`` (``"cpu"``: views of a copy-on-write mapping of the file; ``"cuda[:N]"``, ``N``:
    loaded by gpufeed's engine in chunks): a dict, in the order of the file. ``backend``
    (``"mmap"``, ``"pread"``) is accepted as safetensors takes it."""
    with safe_open(filename, framework="pt", device=device, backend=backend) as f:
        return f.get_tensors()


def load(data: bytes) -> Dict[str, Any]:
    """Every tensor of a safetensors file held in ``data``, as CPU tensors (a copy)."""
    return load_bytes(data)
