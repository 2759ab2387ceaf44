"""The native module ``gpufeed._gpufeed`` (``crates/gpufeed-py/src``); the package ``gpufeed``
re-exports its classes and wraps its loads. ``tests/test_cpu.py`` checks that this stub names
every public function and class of the module, with their parameters."""

from os import PathLike
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, TypedDict, final

_Path = str | PathLike[str]

# One file of a checkpoint as `Loader.load_safetensors_files` hands it over: the file's bytes,
# its tensors grouped by dtype as `(dtype, element size, names, shapes, strides, element
# offsets)`, and those at an offset their element size does not divide as `(name, dtype, shape,
# start, end)` in bytes.
_DtypeGroup = tuple[str, int, list[str], list[tuple[int, ...]], list[tuple[int, ...]], list[int]]
_OddTensor = tuple[str, str, list[int], int, int]
_FileTensors = tuple[Array, list[_DtypeGroup], list[_OddTensor]]

# What the module registers (pyo3 keeps it in the module's `__all__`), in that order.
__all__ = [
    "__version__",
    "GpufeedError",
    "NoGpuError",
    "Array",
    "Loader",
    "Batch",
    "BatchLoader",
    "EpochIter",
    "ImageLoader",
    "ImageEpochIter",
    "OnDemand",
    "RegisteredFile",
    "SafeFile",
    "NativePrefetch",
    "PrefetchIter",
    "Entry",
    "HeaderKey",
    "open_safetensors",
    "parse_header",
    "load_file",
    "decode_jpegs",
    "resize_crop",
    "decode_augmented",
    "random_flip",
    "random_resized_crop",
    "load_range",
    "read_object",
    "fetch_objects",
    "load_replicated",
    "load_sharded",
    "load_replicated_rank",
    "load_tensor_parallel_files",
    "load_replicated_safetensors_files",
    "load_tensor_parallel_rank_files",
    "load_safetensors_files",
    "load_into",
    "_wait_for_frees",
    "empty_cache",
    "doctor",
    "advise",
]

__version__: str

class GpufeedError(Exception):
    """An error of gpufeed; the message says what went wrong and what to do."""

class NoGpuError(GpufeedError):
    """No usable GPU (no CUDA driver, no such device): the CPU paths still work."""

@final
class Array:
    """A block of memory with a dtype and shape, on the GPU or the host, that any DLPack
    consumer takes without a copy: ``torch.from_dlpack(a)``, ``numpy.from_dlpack(a)``."""

    def __dlpack__(
        self,
        *,
        stream: Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def dtype(self) -> str:
        """The element type's safetensors name (``U8``, ``BF16``, ...)."""
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str:
        """``cuda:N`` or ``cpu``."""
    def view_of(self, start: int, end: int, dtype: str, shape: Sequence[int]) -> Array:
        """Bytes ``start:end`` of this array as an array of ``dtype`` (a safetensors name) and
        ``shape``, sharing its memory."""
    def __repr__(self) -> str: ...

@final
class Loader:
    """A reusable loader of one GPU: its pinned staging and threads serve every load."""

    def __new__(
        cls, device: int = 0, strategy: Literal["auto", "registered", "staged", "direct", "gds"] = "auto"
    ) -> Loader: ...
    @property
    def device(self) -> int: ...
    def load_file(self, path: _Path) -> Array: ...
    def load_range(self, path: _Path, start: int, end: int) -> Array: ...
    def load_safetensors_files(self, path: _Path) -> list[_FileTensors]: ...
    def register_file(self, path: _Path) -> RegisteredFile: ...
    def load_registered(
        self, file: RegisteredFile, start: int = 0, end: int | None = None
    ) -> Array: ...

@final
class RegisteredFile:
    """A file registered once for repeated loads (``Loader.register_file``): its cached pages
    stay page-locked until ``close`` (or until the object goes)."""

    def __len__(self) -> int: ...
    @property
    def path(self) -> Path | None:
        """The file's path (``None`` once closed)."""
    def __enter__(self) -> RegisteredFile: ...
    def __exit__(self, *_exc: object) -> Literal[False]: ...
    def close(self) -> None:
        """Undoes the registration; arrays already loaded stay valid."""

@final
class OnDemand:
    """A safetensors file or index whose tensors load one at a time, when asked (what
    ``gpufeed.OnDemand`` wraps)."""

    def __new__(cls, path: _Path, device: int = 0) -> OnDemand: ...
    def keys(self) -> list[str]: ...
    def __contains__(self, key: str, /) -> bool: ...
    def __len__(self) -> int: ...
    def get(self, name: str) -> Array: ...
    def close(self) -> None: ...

@final
class Batch:
    """One batch: ``data`` (the records' bytes back to back; ``[records, record_bytes]`` for
    fixed-size records, ``[records, *row shape]`` of its dtype for ``.npy`` rows), the record
    ``indices``, the byte ``offsets`` of each record and the end, an image folder's ``labels``,
    the ``epoch`` and the batch's ``number``."""

    @property
    def data(self) -> Array: ...
    @property
    def indices(self) -> list[int]: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def labels(self) -> list[int]: ...
    @property
    def epoch(self) -> int: ...
    @property
    def number(self) -> int: ...

@final
class BatchLoader:
    """Batches of a data set (a record file, shards, an ``.npy`` array, a WebDataset ``.tar``
    or an image folder), shuffled with a seed and sharded by ``RANK``/``WORLD_SIZE``, on GPU
    ``device`` (host batches with ``device=None``). Iterate ``loader.epoch(n)``.
    ``gpu_gather=True`` (one file of fixed-size records, an ``.npy`` array or an image folder,
    on a GPU): the GPU gathers each batch out of the file's mapping (a folder's files mapped
    side by side), registered with CUDA (page-locked) while the loader lives."""

    def __new__(
        cls,
        path: _Path | Sequence[_Path],
        record_bytes: int | None = None,
        batch_size: int = 256,
        shuffle: bool | Literal["shards"] = True,
        seed: int = 0,
        device: int | None = None,
        workers: int | None = None,
        drop_last: bool = False,
        index: _Path | None = None,
        skip_bad: bool = False,
        global_batch: int | None = None,
        prefetch: int | None = None,
        block: int | None = None,
        direct: bool = False,
        direct_depth: int | None = None,
        cache: _Path | None = None,
        spool_bytes: int | None = None,
        gpu_gather: bool = False,
    ) -> BatchLoader: ...
    @property
    def classes(self) -> list[str]:
        """An image folder's class names, in label order; empty for record files."""
    @property
    def skipped(self) -> int:
        """Entries an image folder left out (``skip_bad=True``)."""
    def __len__(self) -> int: ...
    def epoch(self, epoch: int) -> EpochIter:
        """The batches of epoch ``epoch``; one epoch at a time (the next once this one has
        ended or its iterator is dropped)."""
    def resume(self, position: dict[str, Any]) -> EpochIter:
        """The rest of an epoch from ``position`` (from ``EpochIter.position()``; needs
        ``global_batch=``); a position that does not fit raises here."""

@final
class EpochIter:
    """The batches of one epoch (see ``BatchLoader.epoch``), straight from the loader's
    epoch; at its end, or when dropped, the loader is free for the next."""

    def __iter__(self) -> EpochIter: ...
    def __next__(self) -> Batch: ...
    def position(self) -> dict[str, Any]:
        """Where the run is after the batches handed out so far (a JSON-ready dict for
        ``BatchLoader.resume``); only for an elastic loader (``global_batch=``)."""

@final
class ImageLoader:
    """Batches of decoded, cropped, resized (mirrored, normalized) images of an image folder,
    a WebDataset tar or shards of them, on GPU ``device`` (nvJPEG) or, with ``device=None``, on
    the CPU (``gpufeed.ImageLoader`` makes torch tensors of what it yields)."""

    def __new__(
        cls,
        path: _Path | Sequence[_Path],
        batch_size: int = 256,
        height: int = 224,
        width: int = 224,
        train: bool = True,
        seed: int = 0,
        shuffle: bool | Literal["shards"] = True,
        device: int | None = None,
        workers: int = 4,
        decoders: int = 3,
        normalize: bool = False,
        mean: Sequence[float] = ...,
        std: Sequence[float] = ...,
        scale: tuple[float, float] = ...,
        ratio: tuple[float, float] = ...,
        crop_fraction: float = 0.875,
        skip: bool = False,
        drop_last: bool = False,
        global_batch: int | None = None,
        prefetch: int | None = None,
        cache: _Path | None = None,
        block: int | None = None,
        spool_bytes: int | None = None,
        cuda_decoders: int = 0,
    ) -> ImageLoader: ...
    @property
    def classes(self) -> list[str]:
        """An image folder's class names, in label order; empty for shards."""
    @property
    def cpu_only(self) -> str | None:
        """Why images decode on the CPU (``None`` where nvJPEG decodes them)."""
    @property
    def size(self) -> tuple[int, int]:
        """Output ``(height, width)``."""
    @property
    def normalize(self) -> bool:
        """Whether batches are normalized ``f32`` ``[n, 3, h, w]`` (else ``uint8`` NHWC)."""
    def __len__(self) -> int: ...
    def epoch(self, epoch: int) -> ImageEpochIter:
        """The batches of epoch ``epoch``; one epoch at a time."""
    def resume(self, position: dict[str, Any]) -> ImageEpochIter:
        """The rest of an epoch from ``position`` (needs ``global_batch=``)."""

@final
class ImageEpochIter:
    """The batches of one epoch of an ``ImageLoader``: ``(images or None, record indices,
    labels (``0xFFFFFFFF``: none), skipped as (name, reason))``."""

    def __iter__(self) -> ImageEpochIter: ...
    def __next__(
        self,
    ) -> tuple[Array | None, list[int], list[int], list[tuple[str, str]]]: ...
    def position(self) -> dict[str, Any]:
        """Where the run is after the batches handed out so far (an elastic loader's)."""

def load_file(path: _Path, device: int = 0) -> Array: ...
def decode_jpegs(
    blobs: list[bytes], device: int | None = None, skip: bool = False
) -> tuple[list[Array | None], list[tuple[str, str]], list[str | None]]: ...
def decode_augmented(
    blobs: list[bytes],
    device: int,
    skip: bool,
    train: bool,
    seed: int,
    epoch: int,
    indices: list[int],
    width: int,
    height: int,
    normalize: bool,
    mean: list[float],
    std: list[float],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    fraction: float,
) -> tuple[Array | None, list[int], list[tuple[str, str]]]: ...
def random_flip(seed: int, epoch: int, index: int) -> bool: ...
def resize_crop(
    pixels: bytes,
    width: int,
    height: int,
    crop: tuple[int, int, int, int],
    out_width: int,
    out_height: int,
    flip: bool = False,
) -> bytes: ...
def random_resized_crop(
    width: int,
    height: int,
    seed: int,
    epoch: int,
    index: int,
    scale: tuple[float, float] = ...,
    ratio: tuple[float, float] = ...,
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop crop for (seed, epoch, index); scale defaults to
    (0.08, 1.0), ratio to (3/4, 4/3)."""
def load_range(path: _Path, start: int, end: int, device: int = 0) -> Array: ...
def read_object(url: str, start: int = 0, end: int | None = None) -> bytes: ...
def fetch_objects(urls: Sequence[str], cache: _Path) -> list[str]: ...
def load_safetensors_files(path: _Path, device: int = 0) -> list[_FileTensors]: ...
def load_into(
    path: _Path,
    device: int,
    names: list[str],
    ptrs: list[int],
    nbytes: list[int],
    dtypes: list[str],
    shapes: Sequence[Sequence[int]],
    strict: bool = True,
    staging_bytes: int | None = None,
    plan: Sequence[tuple[int, tuple[int | None, int | None, int | None]] | None] | None = None,
) -> tuple[list[str], list[str], int, float, int]:
    """Writes the checkpoint's tensors `names` (or the part `plan` gives per name: a dimension
    and a slice of it) into the device memory at `ptrs` (checked against the headers first;
    destinations of another floating dtype cast into on the way); `(missing, unexpected,
    bytes, seconds, staging_bytes)`."""
def load_replicated(path: _Path, devices: Sequence[int]) -> list[Array]: ...
def load_sharded(
    paths: Sequence[_Path], devices: Sequence[int]
) -> tuple[list[Array], list[list[tuple[int, int, int]]]]: ...
def load_replicated_rank(path: _Path) -> tuple[Array, int, int]: ...
def load_tensor_parallel_files(
    path: _Path, devices: Sequence[int], dim: int
) -> list[list[_FileTensors]]: ...
def load_replicated_safetensors_files(
    path: _Path, devices: Sequence[int]
) -> list[list[_FileTensors]]: ...
def load_tensor_parallel_rank_files(
    path: _Path, dim: int
) -> tuple[list[_FileTensors], int, int]: ...
def _wait_for_frees() -> None: ...
def empty_cache() -> int:
    """Gives the device memory gpufeed keeps for reuse back to the devices now and returns
    its bytes (what ``torch.cuda.empty_cache()`` does for torch's). Prefetch chunks (of
    ``safe_open``'s ``get_tensor`` and ``prefetch``) let go whole are kept for the next chunk
    of the same length, and given back one second after the last was kept
    (``GPUFEED_KEEP_FREED_MS``; 0: never kept) or when a gpufeed allocation finds the device
    full (torch's allocator does not know of it: call this before a large torch allocation
    made right after a load)."""
    ...

class _Check(TypedDict):
    name: str
    status: Literal["ok", "warn", "fail"]
    observed: str
    fix: str | None

class _Workload(TypedDict):
    persistent: bool
    processes: int
    size_bytes: int
    resident: float | None

class _Advice(TypedDict):
    workload: _Workload
    recommendation: dict[str, Any]
    trials: dict[str, Any] | None

def doctor(path: _Path | None = None) -> list[_Check]:
    """The machine's checks (``gpufeed doctor``): ``{name, status, observed, fix}`` each."""

def advise(
    size: int | None = None,
    path: _Path | None = None,
    persistent: bool = False,
    processes: int = 1,
    measure: bool = False,
) -> _Advice:
    """Where data should live and how it should reach the GPU (``gpufeed advise``);
    ``measure=True`` runs short trials on ``path``."""

_Listed = list[tuple[str, str, tuple[int, ...], int, int]]

def open_safetensors(path: _Path) -> list[SafeFile]:
    """Opens a safetensors file or index and checks every header: one ``SafeFile`` per file."""

def parse_header(data: bytes) -> tuple[int, dict[str, str] | None, _Listed]:
    """The header of a whole safetensors file held in ``data``, checked."""

@final
class SafeFile:
    """One safetensors file opened once (what ``gpufeed.safe_open`` stands on)."""

    @property
    def path(self) -> str: ...
    @property
    def data_start(self) -> int: ...
    @property
    def len(self) -> int: ...
    def metadata(self) -> dict[str, str] | None: ...
    def tensors(self) -> _Listed: ...
    def host_tensors(self, indices: list[int]) -> list[Array]: ...
    def load_tensors(
        self, device: int, importer: Callable[[Any], Any] | None = None
    ) -> list[Any]: ...
    def load_spans(self, device: int, spans: list[tuple[int, int]]) -> Array: ...
    def prefetch(
        self,
        device: int,
        items: list[tuple[int, int, int, int, list[int]]],
        chunk_bytes: int,
        ahead_bytes: int | None = None,
        follow_from: int | None = None,
        run_bytes: int = 0,
    ) -> NativePrefetch: ...
    def prefetch_tensors(
        self,
        device: int,
        tensors: list[int],
        chunk_bytes: int,
        ahead_bytes: int | None = None,
        follow_from: int | None = None,
        run_bytes: int = 0,
    ) -> NativePrefetch: ...
    def entries(self, file: int) -> tuple[list[str], list[Entry], list[int]]: ...
    def header_key(self) -> HeaderKey | None: ...

@final
class HeaderKey:
    """The parse of a header (``SafeFile.header_key()``): keys of one ``id`` for files whose
    headers were the same bytes in files of the same length (parsed once in this process);
    while a key lives, no other parse has its ``id``; ``kept``: whether the parse is still
    the one a file of this header, opened again, gets."""

    @property
    def id(self) -> int: ...
    @property
    def kept(self) -> bool: ...
    def __len__(self) -> int: ...

@final
class Entry:
    """One tensor of a ``SafeFile`` as the drop-in keeps it (``SafeFile.entries``)."""

    @property
    def file(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def rel(self) -> tuple[int, int]: ...

@final
class NativePrefetch:
    """Ranges of one file loading to a GPU in the background (``SafeFile.prefetch``). With
    ``importer``, items DLPack carries come back as ``importer(capsule)`` (torch tensors)."""

    def __len__(self) -> int: ...
    def take(self, i: int, importer: Callable[[Any], Any] | None = None) -> Any: ...
    def take_once(
        self, i: int, importer: Callable[[Any], Any] | None = None
    ) -> Any | None: ...
    def iterate(
        self,
        names: list[str],
        importer: Callable[[Any], Any] | None = None,
        convert: Callable[[str, Any], Any] | None = None,
    ) -> PrefetchIter: ...
    def close(self) -> None: ...

@final
class PrefetchIter:
    """``NativePrefetch.iterate``: ``(names[i], item i)`` as the items land, each handed out
    once; ``convert(name, array)`` makes what is yielded of an item DLPack does not carry."""

    def __iter__(self) -> PrefetchIter: ...
    def __next__(self) -> tuple[str, Any]: ...

