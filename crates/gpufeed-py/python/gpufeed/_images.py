"""``decode_jpegs``: JPEG files' bytes decoded into ``uint8`` ``[height, width, 3]`` torch
tensors (interleaved RGB), on a GPU by nvJPEG (its hardware decoder engines where the GPU has
them) or on the CPU."""

from typing import Any, List, Optional, Sequence

from . import _gpufeed
from ._safe_open import SafetensorError, device_ordinal

_POLICIES = ("raise", "skip")


def _as_bytes(blob) -> bytes:
    """``blob`` (bytes, bytearray, memoryview, a uint8 numpy array or CPU tensor) as bytes."""
    if isinstance(blob, bytes):
        return blob
    numpy = getattr(blob, "numpy", None)
    if callable(numpy) and getattr(blob, "device", None) is not None:  # a torch tensor
        if str(blob.device) != "cpu":
            raise TypeError("decode_jpegs takes JPEG bytes in host memory, not a CUDA tensor")
        blob = numpy()
    try:
        return bytes(memoryview(blob).cast("B"))
    except TypeError as e:
        raise TypeError(
            f"decode_jpegs takes each JPEG as bytes, bytearray, memoryview or a uint8 array, "
            f"not {type(blob).__name__} ({e})"
        ) from None


def decode_jpegs(images: Sequence[Any], device: Any = None,
                 on_error: str = "raise") -> List[Optional[Any]]:
    """Each of ``images`` (JPEG files' bytes: ``bytes``, ``bytearray``, ``memoryview``, a uint8
    numpy array or CPU tensor) decoded into a ``uint8`` tensor of ``[height, width, 3]``
    (interleaved RGB; gray JPEGs with R = G = B; no EXIF rotation, as PIL and torchvision).

    ``device``: ``None`` or ``"cpu"`` decodes on the CPU (zune-jpeg, the machine's threads);
    ``"cuda:N"``, ``N`` or a ``torch.device`` decodes on that GPU with nvJPEG: the images its
    hardware engines take in one batch, the other baseline ones by its CUDA decoder, and
    progressive ones (nvJPEG decoded one wrongly without an error), what nvJPEG refuses, or
    every image where nvJPEG is not installed, on the CPU and uploaded. The tensors of one GPU call are views of one allocation, freed when the last
    goes, ready on every stream when returned.

    ``on_error``: an image that is no decodable JPEG (truncated, corrupt, PNG, CMYK, 12-bit)
    raises ``gpufeed.GpufeedError`` naming it (``"image 3: truncated JPEG: ..."``) with
    ``"raise"`` (the default), or is ``None`` in the result with ``"skip"``.

    Example::

        data = [open(p, "rb").read() for p in paths]
        images = gpufeed.decode_jpegs(data, device="cuda:0")  # [H, W, 3] uint8 on cuda:0
        batch = torch.stack([img.permute(2, 0, 1) for img in images])  # same sizes only
    """
    if on_error not in _POLICIES:
        raise ValueError(f"on_error {on_error!r} is invalid: use 'raise' or 'skip'")
    import torch

    try:
        ordinal = device_ordinal(device)
    except SafetensorError:
        raise ValueError(
            f"device {device!r} is invalid: decode_jpegs decodes on 'cpu', 'cuda', 'cuda:N' or N"
        ) from None
    blobs = [_as_bytes(b) for b in images]
    arrays, _, _ = _gpufeed.decode_jpegs(blobs, ordinal, on_error == "skip")
    return [None if a is None else torch.from_dlpack(a) for a in arrays]
