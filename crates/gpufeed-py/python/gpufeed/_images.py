"""``decode_jpegs``: JPEG files' bytes decoded into ``uint8`` ``[height, width, 3]`` torch
tensors (interleaved RGB), on a GPU by nvJPEG (its hardware decoder engines where the GPU has
them) or on the CPU; ``decode_batch``: a training or evaluation batch decoded, cropped,
resized (antialiased), mirrored and normalized on a GPU, as one tensor."""

from typing import Any, List, Optional, Sequence, Tuple

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


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_batch(images: Sequence[Any], size: Any = 224, *, device: Any = 0, train: bool = True,
                 seed: int = 0, epoch: int = 0, indices: Optional[Sequence[int]] = None,
                 dtype: Any = None, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, scale: Tuple[float, float] = (0.08, 1.0),
                 ratio: Tuple[float, float] = (3 / 4, 4 / 3), crop_fraction: float = 0.875,
                 on_error: str = "raise"):
    """A training (or evaluation) batch from JPEG files' bytes, decoded and augmented on a GPU:
    ``(images, kept)``.

    Each image is decoded (as ``decode_jpegs``), cropped — with ``train``, torchvision's
    ``RandomResizedCrop(size, scale, ratio)`` and ``RandomHorizontalFlip()``, drawn from
    ``seed``, ``epoch`` and the image's record index (``indices``, default ``0..n``) alone, so
    the same record gets the same crop and flip in an epoch whatever the worker count or world
    size; else the central square of ``crop_fraction`` of the shorter side (``Resize(256)`` +
    ``CenterCrop(224)``'s region) — then resized to ``size`` (an int, or ``(height, width)``)
    by bilinear interpolation with antialiasing (as ``torchvision.transforms.v2.functional.
    resize(antialias=True)``; within one unit of it on uint8).

    ``images`` is ``uint8`` ``[n, H, W, 3]`` where ``dtype`` is ``None`` or ``torch.uint8``;
    ``float32`` ``[n, 3, H, W]`` normalized with ``mean`` and ``std`` where ``dtype`` is a
    floating dtype (``float16``/``bfloat16`` are cast from float32 by torch). ``kept`` is the
    position in ``images`` of each image returned: all of them, but with ``on_error="skip"``
    the undecodable ones are left out.

    Example::

        data = [open(p, "rb").read() for p in paths]
        x, kept = gpufeed.decode_batch(data, 224, device=0, seed=1, epoch=3,
                                       indices=record_ids, dtype=torch.float32)
        # x: [len(data), 3, 224, 224] on cuda:0, normalized with ImageNet's mean and std
    """
    if on_error not in _POLICIES:
        raise ValueError(f"on_error {on_error!r} is invalid: use 'raise' or 'skip'")
    import torch

    try:
        ordinal = device_ordinal(device)
    except SafetensorError:
        ordinal = None
    if ordinal is None:
        raise ValueError(f"device {device!r} is invalid: decode_batch runs on a GPU "
                         "('cuda', 'cuda:N' or N); decode_jpegs decodes on the CPU")
    if isinstance(size, int):
        height = width = size
    else:
        height, width = (int(v) for v in size)
    if not (0 < height <= 16384 and 0 < width <= 16384):
        raise ValueError(f"size {size!r} is invalid: give a positive int or (height, width), "
                         "at most 16384")
    if len(mean) != 3 or len(std) != 3 or any(not float(v) for v in std):
        raise ValueError(f"mean {tuple(mean)!r} and std {tuple(std)!r}: give three values "
                         "each, std not 0")
    if not 0.0 < float(crop_fraction) <= 1.0:
        raise ValueError(f"crop_fraction {crop_fraction!r} is invalid: give a value in (0, 1]")
    floating = dtype is not None and dtype != torch.uint8
    if floating and not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is invalid: torch.uint8 (NHWC) or a floating dtype")
    blobs = [_as_bytes(b) for b in images]
    index = list(range(len(blobs))) if indices is None else [int(i) for i in indices]
    def empty():  # made only when returned: a machine without a GPU gets gpufeed's error
        shape = (0, 3, height, width) if floating else (0, height, width, 3)
        return torch.empty(shape, dtype=dtype or torch.uint8, device=f"cuda:{ordinal}")

    if not blobs:
        return empty(), []
    array, kept, _ = _gpufeed.decode_augmented(
        blobs, ordinal, on_error == "skip", bool(train), int(seed), int(epoch), index,
        width, height, floating, [float(v) for v in mean], [float(v) for v in std],
        (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1])),
        float(crop_fraction))
    if array is None:
        return empty(), kept
    out = torch.from_dlpack(array)
    if floating and dtype != torch.float32:
        out = out.to(dtype)
    return out, kept
