"""``decode_jpegs``: JPEG files' bytes decoded into ``uint8`` ``[height, width, 3]`` torch
tensors (interleaved RGB), on a GPU by nvJPEG (its hardware decoder engines where the GPU has
them) or on the CPU; ``decode_batch``: a training or evaluation batch decoded, cropped,
resized (antialiased), mirrored and normalized on a GPU, as one tensor; ``ImageLoader``: such
batches of an image folder or WebDataset shards, epoch after epoch, with their labels."""

from typing import Any, List, Optional, Sequence, Tuple

from . import _gpufeed
from ._safe_open import SafetensorError, _as_int, device_ordinal

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
    height, width, floating = _settings(torch, size, mean, std, crop_fraction, dtype)
    blobs = [_as_bytes(b) for b in images]
    index = list(range(len(blobs))) if indices is None else [int(i) for i in indices]
    def empty():  # made only when returned: a machine without a GPU gets gpufeed's error
        shape = (0, 3, height, width) if floating else (0, height, width, 3)
        return torch.empty(shape, dtype=dtype or torch.uint8, device=f"cuda:{ordinal}")

    if not blobs:
        return empty(), []
    array, kept, _ = _gpufeed.decode_augmented(
        blobs, ordinal, on_error == "skip", bool(train), _seed(seed), int(epoch), index,
        width, height, floating, [float(v) for v in mean], [float(v) for v in std],
        (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1])),
        float(crop_fraction))
    if array is None:
        return empty(), kept
    out = torch.from_dlpack(array)
    if floating and dtype != torch.float32:
        out = out.to(dtype)
    return out, kept


def _seed(seed) -> int:
    """``seed`` as an int from 0 to 2**64 - 1 (ints, numpy's and torch's integers; not
    bools); a ValueError otherwise."""
    value = _as_int(seed)
    if value is None or not 0 <= value < 2**64:
        raise ValueError(f"seed {seed!r} is invalid: give an int from 0 to 2**64 - 1")
    return value


def _side(v) -> int:
    """One side of ``size``: an int (numpy's and torch's too) or a float with no fraction."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    side = _as_int(v)
    if side is None:
        raise TypeError
    return side


def _settings(torch, size, mean, std, crop_fraction, dtype) -> Tuple[int, int, bool]:
    """The augmentation's settings checked: ``(height, width, floating)`` of ``size`` (an int,
    or ``(height, width)``) and ``dtype``; a ValueError saying what is wrong otherwise."""
    try:
        if hasattr(size, "__len__"):
            height, width = (_side(v) for v in size)
        else:
            height = width = _side(size)
    except (TypeError, ValueError):
        raise ValueError(f"size {size!r} is invalid: give a positive int or (height, width), "
                         "at most 16384") from None
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
    return height, width, floating


class ImageLoader:
    """Training (or evaluation) batches of JPEGs, decoded, cropped, resized (antialiased),
    mirrored and normalized on a GPU: iterate ``loader.epoch(n)`` for ``(images, labels)``.

    ``path``: an image folder in torchvision ``ImageFolder``'s layout (``root/<class>/...``: the
    class folders sorted by name give the labels), a WebDataset ``.tar`` shard, a glob pattern or
    a list of shards (each sample's ``.jpg``/``.jpeg`` member; its label from ``.cls``, ``-1``
    where it has none; each found by its last suffix in a key with dots); shards in object
    storage (``s3://``, ``https://``; an ``s3://`` pattern is listed; a ``.json`` shard index
    in webdataset's wids format lists them with their sample counts, so nothing is read
    before the first epoch) are streamed as ``BatchLoader`` streams
    them: each fetched when the epoch first needs it, into ``cache`` where given, else into
    memory, at most ``spool_bytes`` at once (a quarter of the available memory, at most 16 GiB,
    by default). ``shuffle="shards"`` visits the shards in a shuffled order, each one's samples
    shuffled, which streams; a plain shuffle needs every shard at once.

    Each batch: ``batch_size`` records in the sampler's order (``shuffle`` with ``seed``, sharded
    by ``RANK``/``WORLD_SIZE``; ``block=K``: shuffled blocks of K consecutive records, each
    block's records shuffled; ``global_batch=G`` makes it elastic: ``position()`` and
    ``resume()`` as ``BatchLoader``'s), read by ``workers`` threads ahead of use and decoded by
    ``decoders`` threads, each with its own nvJPEG handle and CUDA stream (its hardware engines
    where the GPU has them; what nvJPEG refuses, on the CPU; with ``device=None`` or without
    nvJPEG, on the CPU, each thread on its share of the cores), plus ``cuda_decoders`` threads
    on nvJPEG's CUDA decoder (Huffman decoding on the GPU's cores, whole batches each, so
    they pay only where that decoder keeps up with the engines: on the H200 one such thread decoded ImageNet-sized files at about 700-800
    images/s and, batches being handed out in order, held the loader to a fifth of its rate).
    With ``train``, torchvision's
    ``RandomResizedCrop(size, scale, ratio)`` and ``RandomHorizontalFlip()``, drawn from
    ``seed``, the epoch and the record's index alone — the same image gets the same crop
    whatever the worker count or world size; else the central crop of ``crop_fraction`` of the
    shorter side. ``images``: ``uint8`` ``[n, H, W, 3]`` (``dtype`` ``None`` or
    ``torch.uint8``), or a floating ``dtype`` ``[n, 3, H, W]`` normalized with ``mean`` and
    ``std``; ``labels``: ``int64`` ``[n]``, on the same device. The tensors are ready on every
    stream when yielded.

    ``device``: a GPU (``N``, ``"cuda:N"``, a ``torch.device``), or ``None``/``"cpu"`` to decode
    on the CPU (zune-jpeg; the decode threads share the cores) into host tensors. ``on_error``: a file that is no
    decodable JPEG (corrupt, truncated, PNG, CMYK) raises ``gpufeed.GpufeedError`` naming it
    (``"raise"``), or is left out of its batch (``"skip"``: the batch is smaller; ``skipped``
    lists ``(name, reason)``).

    Example::

        loader = gpufeed.ImageLoader("imagenet/train", batch_size=256, size=224, seed=1,
                                     device=0, dtype=torch.float32)
        for epoch in range(90):
            for images, labels in loader.epoch(epoch):  # [256, 3, 224, 224] on cuda:0
                loss = criterion(model(images), labels)
    """

    def __init__(self, path: Any, batch_size: int = 256, size: Any = 224, *,
                 train: bool = True, seed: int = 0, shuffle: Any = True, device: Any = 0,
                 workers: int = 4, decoders: int = 3, dtype: Any = None,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 scale: Tuple[float, float] = (0.08, 1.0),
                 ratio: Tuple[float, float] = (3 / 4, 4 / 3), crop_fraction: float = 0.875,
                 on_error: str = "raise", drop_last: bool = False,
                 global_batch: Optional[int] = None, prefetch: Optional[int] = None,
                 cache: Any = None, block: Optional[int] = None,
                 spool_bytes: Optional[int] = None, cuda_decoders: int = 0):
        import torch

        if on_error not in _POLICIES:
            raise ValueError(f"on_error {on_error!r} is invalid: use 'raise' or 'skip'")
        try:
            ordinal = device_ordinal(device)
        except SafetensorError:
            raise ValueError(f"device {device!r} is invalid: 'cuda', 'cuda:N', N, or None/'cpu' "
                             "to decode on the CPU") from None
        height, width, floating = _settings(torch, size, mean, std, crop_fraction, dtype)
        if batch_size < 1 or workers < 1 or decoders < 1:
            raise ValueError("batch_size, workers and decoders must be at least 1")
        if cuda_decoders < 0:
            raise ValueError("cuda_decoders must be 0 or more")
        seed = _seed(seed)
        if shuffle is None:
            shuffle = False
        if shuffle not in (True, False, "shards"):
            raise ValueError(f"shuffle {shuffle!r} is invalid: True, False or 'shards'")
        self._dtype = dtype if floating else torch.uint8
        self._device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
        if isinstance(path, (list, tuple)):
            path = [str(p) for p in path]
        else:
            path = str(path)
        self._native = _gpufeed.ImageLoader(
            path, batch_size, height, width, bool(train), int(seed),
            shuffle if shuffle == "shards" else bool(shuffle), ordinal,
            int(workers), int(decoders), floating, [float(v) for v in mean],
            [float(v) for v in std], (float(scale[0]), float(scale[1])),
            (float(ratio[0]), float(ratio[1])), float(crop_fraction), on_error == "skip",
            bool(drop_last), global_batch, prefetch, None if cache is None else str(cache),
            block, spool_bytes, int(cuda_decoders))
        self._skipped: List[Tuple[str, str]] = []

    @property
    def skipped(self) -> List[Tuple[str, str]]:
        """The images left out of the epoch begun last (``on_error="skip"``), as ``(name,
        reason)``: each bad file once per epoch."""
        return self._skipped

    @property
    def classes(self) -> List[str]:
        """An image folder's class names, in label order (empty for shards)."""
        return self._native.classes

    @property
    def cpu_only(self) -> Optional[str]:
        """Why images decode on the CPU here (no GPU asked for, nvJPEG not installed), or
        ``None`` where nvJPEG decodes them."""
        return self._native.cpu_only

    def __len__(self) -> int:
        """Batches in an epoch (this rank's)."""
        return len(self._native)

    def epoch(self, epoch: int) -> "ImageEpoch":
        """The batches of epoch ``epoch``; one epoch at a time (the next once this one has
        ended or its iterator is dropped)."""
        native = self._native.epoch(int(epoch))
        self._skipped = []
        return ImageEpoch(self, native)

    def resume(self, position: Any) -> "ImageEpoch":
        """The rest of an epoch from ``position`` (from ``ImageEpoch.position()``, maybe saved
        by a run with another ``WORLD_SIZE``; needs ``global_batch=``)."""
        native = self._native.resume(position)
        self._skipped = []
        return ImageEpoch(self, native)


class ImageEpoch:
    """The batches of one epoch of an ``ImageLoader``: ``(images, labels)`` tensors.
    ``indices`` holds the record indices of the last batch yielded."""

    def __init__(self, loader: ImageLoader, native):
        self._loader = loader
        self._native = native
        self._indices: List[int] = []

    @property
    def indices(self) -> List[int]:
        """The record index of each image of the last batch yielded."""
        return self._indices

    def __iter__(self) -> "ImageEpoch":
        return self

    def __next__(self):
        import torch

        self._indices = []
        array, indices, labels, skipped = next(self._native)
        loader = self._loader
        self._indices = indices
        loader._skipped.extend(skipped)
        if array is None:
            h, w = loader._native.size
            shape = (0, 3, h, w) if loader._native.normalize else (0, h, w, 3)
            images = torch.empty(shape, dtype=loader._dtype, device=loader._device)
        else:
            images = torch.from_dlpack(array)
            if images.dtype != loader._dtype:
                images = images.to(loader._dtype)
        # u32::MAX (no label) as -1. Copied synchronously: ready on every stream, as the images.
        label = torch.tensor([-1 if v == 0xFFFFFFFF else v for v in labels], dtype=torch.int64)
        if loader._device.type == "cuda":
            label = label.to(loader._device)
        return images, label

    def position(self) -> dict:
        """Where the run is after the batches yielded so far (a JSON-ready dict for
        ``ImageLoader.resume``); only for an elastic loader (``global_batch=``)."""
        return self._native.position()
