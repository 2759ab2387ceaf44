"""gpufeed: files, safetensors checkpoints and dataset batches on NVIDIA GPUs, fast.

The loads return ``torch.Tensor`` objects on ``cuda:<device>`` without a copy (DLPack); where
torch is not installed they return ``gpufeed.Array`` objects, which any DLPack consumer takes
(``numpy.from_dlpack`` for host batches). The package imports on machines without a GPU: the
GPU calls then raise ``gpufeed.NoGpuError`` with the reason, the CPU paths (host batches,
``doctor``, ``advise``) work.

    import gpufeed
    weights = gpufeed.load_safetensors("model.safetensors")      # dict of cuda tensors
    raw = gpufeed.load_file("data/shard-000.bin", device=0)     # uint8 cuda tensor
    copies = gpufeed.load_replicated("model.bin", devices=[0, 1])  # one per GPU, NVLink
    shards = gpufeed.load_tensor_parallel("model.safetensors", devices=[0, 1], split="rows")
    with gpufeed.safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
        w = f.get_tensor("lm_head.weight")                      # safetensors' API, drop-in
    gpufeed.patch_safetensors()   # safetensors.safe_open / torch.load_file -> gpufeed
    for batch in gpufeed.BatchLoader("data/images.bin", record_bytes=3 * 224 * 224,
                                     device=0).epoch(0):
        x = gpufeed.as_tensor(batch.data)                        # [records, record_bytes]
"""

import os
from os import PathLike
from typing import Dict, List, Sequence, Union

from . import _gpufeed
from ._gpufeed import (  # noqa: F401  (re-exported)
    Array,
    Batch,
    BatchLoader,
    EpochIter,
    GpufeedError,
    NoGpuError,
    RegisteredFile,
    __version__,
    advise,
    doctor,
    empty_cache,
)
from . import torch  # noqa: F401  (gpufeed.torch.load_file)
from ._images import ImageEpoch, ImageLoader, decode_batch, decode_jpegs
from ._into import IncompatibleKeys, _load_cast, load_into
from ._patch import is_patched, patch_safetensors, unpatch_safetensors
from ._safe_open import PrefetchLoader, SafetensorError, TensorMeta, device_ordinal, safe_open
from ._safe_open import _collector_paused

__all__ = [
    "Array",
    "Batch",
    "BatchLoader",
    "GpufeedError",
    "ImageEpoch",
    "ImageLoader",
    "IncompatibleKeys",
    "Loader",
    "NoGpuError",
    "OnDemand",
    "PrefetchLoader",
    "RegisteredFile",
    "SafetensorError",
    "TensorMeta",
    "advise",
    "as_tensor",
    "decode_batch",
    "decode_jpegs",
    "doctor",
    "empty_cache",
    "fetch_objects",
    "is_patched",
    "load_file",
    "load_into",
    "load_range",
    "load_replicated",
    "load_replicated_rank",
    "load_replicated_safetensors",
    "load_safetensors",
    "load_sharded",
    "load_tensor_parallel",
    "load_tensor_parallel_rank",
    "patch_safetensors",
    "read_object",
    "safe_open",
    "torch",
    "unpatch_safetensors",
]

Path = Union[str, "PathLike[str]"]


def as_tensor(array: Array):
    """``array`` as a ``torch.Tensor`` (zero-copy), or itself where torch is not installed."""
    try:
        import torch
    except ImportError:
        return array
    return torch.from_dlpack(array)


# safetensors dtype names -> torch dtype attribute names (those this torch lacks are skipped).
_TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _checkpoint(files):
    """A checkpoint's tensors from the native ``[(file array, dtype groups, odd tensors)]``:
    one ``torch.from_dlpack`` per file, one typed view of it per dtype, then each tensor one
    ``as_strided`` of that view (about 2 us per tensor; no Python loop body runs per tensor). A
    tensor at an offset its element size does not divide is exported alone through DLPack.
    Without torch: ``Array`` views."""
    try:
        import torch
    except ImportError:
        return _arrays(files)
    dtypes = _torch_dtypes(torch)
    out = {}
    for array, groups, odd in files:
        whole = torch.from_dlpack(array) if groups else None
        for dtype, size, names, shapes, strides, offsets in groups:
            # A view needs a length its element size divides; the group's offsets fit in it.
            typed = whole[: whole.numel() - whole.numel() % size].view(_torch_dtype(torch, dtypes, dtype))
            out.update(zip(names, map(typed.as_strided, shapes, strides, offsets)))
        for name, dtype, shape, start, end in odd:
            _torch_dtype(torch, dtypes, dtype)
            out[name] = torch.from_dlpack(array.view_of(start, end, dtype, list(shape)))
    return out


def _arrays(files):
    """The checkpoint's tensors as ``Array`` views (no torch)."""
    out = {}
    for array, groups, odd in files:
        for dtype, size, names, shapes, _, offsets in groups:
            for name, shape, offset in zip(names, shapes, offsets):
                start = offset * size
                end = start + size * _numel(shape)
                out[name] = array.view_of(start, end, dtype, list(shape))
        for name, dtype, shape, start, end in odd:
            out[name] = array.view_of(start, end, dtype, list(shape))
    return out


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _torch_dtype(torch, dtypes, name):
    """The torch dtype of safetensors dtype ``name``, or a clear error where this torch lacks it."""
    try:
        return dtypes[name]
    except KeyError:
        raise GpufeedError(
            f"safetensors dtype {name} has no torch dtype in torch {torch.__version__}; load the "
            "file with gpufeed.load_file and reinterpret its bytes"
        ) from None


_DTYPE_CACHE = {}


def _torch_dtypes(torch):
    """safetensors dtype name -> torch dtype, for this torch (looked up once)."""
    if not _DTYPE_CACHE:
        _DTYPE_CACHE.update({k: getattr(torch, v) for k, v in _TORCH_DTYPES.items()
                             if hasattr(torch, v)})
    return _DTYPE_CACHE


class Loader:
    """A reusable loader of GPU ``device``: its pinned staging and threads serve every load.

    ``strategy`` is ``auto``, ``registered``, ``staged``, ``direct`` or ``gds`` (cuFile: GPUDirect Storage).
    """

    def __init__(self, device: int = 0, strategy: str = "auto"):
        self._native = _gpufeed.Loader(device, strategy)

    @property
    def device(self) -> int:
        return self._native.device

    def load_file(self, path: Path):
        """All of ``path`` on the GPU: a 1-D uint8 tensor."""
        return as_tensor(self._native.load_file(path))

    def load_range(self, path: Path, start: int, end: int):
        """Bytes ``start:end`` of ``path`` on the GPU: a 1-D uint8 tensor."""
        return as_tensor(self._native.load_range(path, start, end))

    def load_safetensors(self, path: Path) -> Dict[str, object]:
        """A safetensors file or ``*.index.json``: a dict of tensors with their dtypes and
        shapes, views into one device buffer per file (freed when the last tensor goes)."""
        with _collector_paused():
            return _checkpoint(self._native.load_safetensors_files(path))

    def register_file(self, path: Path) -> RegisteredFile:
        """``path`` registered for repeated loads: its cached pages stay page-locked (about
        40 ms per GiB to register, reading what is not cached) until ``close()``, the end of
        a ``with`` block, or the object goes; the file must not change meanwhile (a load of a
        changed file raises ``GpufeedError``: register it again)."""
        return self._native.register_file(path)

    def load_registered(self, file: RegisteredFile, start: int = 0, end=None):
        """Bytes ``start:end`` (to the end where ``end`` is None) of a registered file on this
        loader's GPU: a 1-D uint8 tensor, one copy by the GPU out of the page cache (1 MiB in
        about 35 us on an H200, no host copy)."""
        return as_tensor(self._native.load_registered(file, start, end))


def load_file(path: Path, device: int = 0):
    """All of ``path`` on GPU ``device``: a 1-D uint8 tensor (one loader per device is kept).
    ``path`` may be an object URL (``s3://bucket/key``, ``https://host/path``): read by
    parallel ranged GETs of the version its first request saw, credentials and endpoint from
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``,
    ``AWS_PROFILE``. Objects load through a second kept loader per device, with the settings
    for objects (fewer fill threads, larger pieces: 256 MiB of pinned staging on 16 cores,
    beside the file loader's 128 MiB)."""
    return as_tensor(_gpufeed.load_file(path, device))


def read_object(url: str, start: int = 0, end=None) -> bytes:
    """Bytes ``start:end`` (to the end where ``end`` is None) of the object at ``url``
    (``s3://bucket/key``, ``https://host/path``) into a new ``bytes``, by ranged GETs in
    parallel of the version the first request saw (an object replaced meanwhile raises
    ``GpufeedError``); credentials and endpoint as for ``load_file``."""
    return _gpufeed.read_object(url, start, end)


def fetch_objects(urls: Sequence[str], cache: Path) -> List[str]:
    """The objects at ``urls`` (``s3://bucket/key``, ``https://host/path``) fetched into the
    local directory ``cache`` (made, mode 0700, where missing; refused where another user owns
    it or may write in it), in order: each one's local path. A version already there (same
    URL, ETag and size) is not fetched again, so a second run reads local files from the page
    cache; a replaced object gets a file of its own. ``BatchLoader(urls, cache=...)`` fetches
    shards into such a directory as its epochs need them. Credentials and endpoint as for
    ``load_file``.

        paths = gpufeed.fetch_objects([f"s3://data/train-{i:04d}.tar" for i in range(8)],
                                      "/tmp/gpufeed-cache")
    """
    return [os.fspath(p) for p in _gpufeed.fetch_objects(list(urls), cache)]


def load_range(path: Path, start: int, end: int, device: int = 0):
    """Bytes ``start:end`` of ``path`` on GPU ``device``: a 1-D uint8 tensor."""
    return as_tensor(_gpufeed.load_range(path, start, end, device))


def load_safetensors(path: Path, device: int = 0, dtype=None) -> Dict[str, object]:
    """A safetensors file or a sharded checkpoint's ``*.index.json`` on GPU ``device``: a dict
    of tensors. Headers are checked first: a bad file is named even without a GPU. ``path``
    may be an object URL (``s3://bucket/prefix/model.safetensors.index.json``, its shards
    beside it), read as ``load_file`` reads objects.

    ``dtype`` (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``, or its name) casts
    every floating tensor on the way: BF16, F16, F32, F8_E4M3 and F8_E5M2 tensors are read into
    a bounded staging on the device (two buffers of up to 512 MiB) and a GPU kernel writes them
    in ``dtype``, bit for bit as torch's ``.to(dtype)`` on the GPU; device memory is what the
    result holds plus that staging. Other floating types (F64, other FP8 kinds) are cast by
    torch after their load; integers, bools and packed F4 keep their type; a file with nothing
    to cast loads as without ``dtype``. The kernels need compute capability 8.0: on an older
    GPU each tensor is loaded, then cast by torch. Local files only.

        weights = gpufeed.load_safetensors("model.safetensors", dtype=torch.float16)
    """
    if dtype is not None:
        return _load_cast(path, device, dtype)
    with _collector_paused():
        return _checkpoint(_gpufeed.load_safetensors_files(path, device))


def load_replicated(path: Path, devices: Sequence[int] = (0, 1)) -> List[object]:
    """All of ``path`` on every GPU of ``devices``: one 1-D uint8 tensor per device, in order.
    Each GPU reads its share of the file over its own PCIe link; the GPUs' peer links (NVLink)
    bring the rest while they read. One loader per list of devices is kept."""
    return [as_tensor(a) for a in _gpufeed.load_replicated(path, list(devices))]


def load_sharded(paths: Sequence[Path], devices: Sequence[int] = (0, 1)):
    """The files ``paths`` read as one stream and cut into one nearly equal share per device
    (boundaries on 4 KiB): ``(tensors, pieces)``, one 1-D uint8 tensor per device and, per
    device, the ``(file index, start, end)`` pieces its tensor holds back to back."""
    arrays, pieces = _gpufeed.load_sharded([p for p in paths], list(devices))
    return [as_tensor(a) for a in arrays], pieces


def load_replicated_rank(path: Path):
    """In a process ``torchrun`` started (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, and
    ``TORCHELASTIC_RUN_ID`` or ``GPUFEED_JOB``): all of ``path`` on this rank's GPU
    (``cuda:LOCAL_RANK`` of the GPUs the process sees, modulo their number: with one GPU per
    rank through ``CUDA_VISIBLE_DEVICES``, ``cuda:0``), each rank reading its share, which the
    others copy out of staging slots they all map (with ``GPUFEED_REPLICATE=nccl`` in every
    rank's environment: sent to the others by NCCL broadcasts instead, which needs
    ``libnccl.so.2`` and a GPU per rank; ``ipc``: written into the others' copies through CUDA
    IPC handles). Every rank of the machine must call it with the same file. Returns ``(tensor, rank,
    world)``; a rank that dies or fails is named in the others' ``GpufeedError``."""
    # torch first (its tensor is what is returned anyway): with GPUFEED_REPLICATE=nccl gpufeed
    # then uses the libnccl.so.2 torch loaded, instead of loading the system's under the same
    # name, to which torch's own library would then be bound.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    array, rank, world = _gpufeed.load_replicated_rank(path)
    return as_tensor(array), rank, world


def _split_dim(split) -> int:
    """``"rows"`` (0), ``"columns"`` (1) or a dimension number."""
    names = {"rows": 0, "columns": 1}
    if isinstance(split, str):
        if split not in names:
            raise GpufeedError(
                f"invalid setting: split {split!r}; use 'rows', 'columns' or a dimension number"
            )
        return names[split]
    if isinstance(split, bool) or not isinstance(split, int) or split < 0:
        raise GpufeedError(
            f"invalid setting: split {split!r}; use 'rows', 'columns' or a dimension number"
        )
    return split


def load_tensor_parallel(path: Path, devices: Sequence[int] = (0, 1),
                         split="rows") -> List[Dict[str, object]]:
    """A safetensors file or ``*.index.json`` cut for tensor parallelism: one dict of tensors
    per device of ``devices``, in order. Each tensor with the dimension ``split`` (``"rows"``,
    ``"columns"`` or a number) is cut along it as ``torch.tensor_split`` cuts it, device ``i``
    holding part ``i``; a tensor without that dimension is whole on every device. Each device
    reads only the bytes of its parts. Headers are checked before any GPU is opened."""
    dim = _split_dim(split)
    with _collector_paused():
        return [_checkpoint(files) for files in
                _gpufeed.load_tensor_parallel_files(path, list(devices), dim)]


def load_replicated_safetensors(path: Path,
                                devices: Sequence[int] = (0, 1)) -> List[Dict[str, object]]:
    """A whole safetensors checkpoint on every GPU of ``devices``: one dict of tensors per
    device, in order. Each GPU reads its share of every file over its own PCIe link and the
    peer links (NVLink) bring the rest."""
    with _collector_paused():
        return [_checkpoint(files) for files in
                _gpufeed.load_replicated_safetensors_files(path, list(devices))]


def load_tensor_parallel_rank(path: Path, split="rows"):
    """In a process ``torchrun`` started (see ``load_replicated_rank``): this rank's
    tensor-parallel share of a safetensors checkpoint on this rank's GPU (as there), cut as
    ``load_tensor_parallel`` cuts it for ``LOCAL_WORLD_SIZE`` devices. Returns ``(tensors,
    rank, world)``. Every rank of the machine must call it with the same checkpoint and split;
    a rank given another plan, or one that dies, is named in the others' ``GpufeedError``."""
    dim = _split_dim(split)
    with _collector_paused():
        files, rank, world = _gpufeed.load_tensor_parallel_rank_files(path, dim)
        return _checkpoint(files), rank, world


def _device_ordinal(device) -> int:
    """A CUDA ordinal from ``0``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device`` (the drop-in's
    parsing, the CPU refused)."""
    try:
        ordinal = device_ordinal(device)
    except SafetensorError:
        ordinal = None
    if ordinal is None:
        raise GpufeedError(
            f"invalid setting: device {device!r}; gpufeed loads to GPUs: use a CUDA ordinal or "
            "'cuda:N'"
        )
    return ordinal


class OnDemand:
    """A safetensors file or ``*.index.json`` whose tensors load one at a time, when asked:
    every file is registered once (its cached pages kept page-locked until ``close``, about 40 ms per GiB,
    reading what is not cached), then each ``get_tensor`` is one copy by the GPU out of the
    page cache into memory of its own, at the speed of the link from the smallest tensors up:
    for weights streamed in on demand in any order (experts of a mixture of experts,
    offloaded layers). Headers are checked first: a bad file is named even without a GPU. To
    load a whole checkpoint once, ``load_safetensors`` or ``safe_open`` are faster (no
    registration to pay for).

        with gpufeed.OnDemand("model.safetensors.index.json", device="cuda:0") as f:
            for name in f.keys():
                t = f.get_tensor(name)   # torch.Tensor on cuda:0
    """

    def __init__(self, path: Path, device=0):
        self._native = _gpufeed.OnDemand(path, _device_ordinal(device))

    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        return self._native.keys()

    def get_tensor(self, name: str):
        """The tensor ``name`` on the GPU (a ``torch.Tensor``; a ``gpufeed.Array`` without
        torch); unknown names raise ``GpufeedError``."""
        return as_tensor(self._native.get(name))

    def __contains__(self, name: str) -> bool:
        return name in self._native

    def __len__(self) -> int:
        return len(self._native)

    def close(self) -> None:
        """Undoes the registrations; tensors already loaded stay valid."""
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


if os.environ.get("GPUFEED_PATCH_SAFETENSORS", "") not in ("", "0"):
    patch_safetensors()
