"""The drop-in for safetensors' ``safe_open`` (framework ``"pt"``): the API of safetensors 0.9
with gpufeed's loads underneath.

- CPU handles give zero-copy views of a private (copy-on-write) mapping of the file, as
  safetensors' own do: writes to a tensor stay in the process.
- CUDA handles load through gpufeed's engine. ``get_tensor`` of one tensor after another in
  the file's order is a sweep: the tensors after the one asked for load in the background in
  chunks growing from 8 MiB to 1 GiB (at most 4 GiB loaded and not asked for yet; chunks
  that follow one another load as one transfer of up to 4 GiB, each handed out as it
  lands); a tensor asked for out of order starts a new sweep there (a first chunk of 8 MiB,
  or the tensor alone where it is larger). ``get_tensors`` (and ``gpufeed.torch.load_file``)
  load each file in one transfer; ``prefetch`` loads the tensors of its plan in chunks of 1 GiB and
  hands each one out once. Every tensor is a storage of its own (as safetensors' are) on one
  allocation per chunk (or file), which is freed when the last tensor of it goes (those never
  handed out go when the handle or loader closes).
- An object's URL (``s3://``, ``https://``) opens as a file does: headers by ranged GETs, CPU
  tensors read into host memory, CUDA tensors by ranged GETs into pinned staging.
- ``get_slice(name)[...]`` on a GPU reads only the slice's bytes (its runs of contiguous bytes;
  more than 65,536 runs: the rows that hold them).

Every error is ``gpufeed.SafetensorError``, a ``gpufeed.GpufeedError`` that is also a
``safetensors.SafetensorError`` where safetensors is installed; a missing file is also a
``FileNotFoundError``, no usable GPU also a ``gpufeed.NoGpuError``.
"""

import gc
import itertools
import operator
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _gpufeed
from ._gpufeed import GpufeedError, NoGpuError

try:  # safetensors' own error class, so that `except SafetensorError` keeps working
    from safetensors import SafetensorError as _Theirs

    class _SafetensorsError(_Theirs):
        """safetensors' ``SafetensorError`` (where safetensors is installed)."""

except Exception:  # noqa: BLE001 (not installed, or broken: gpufeed's class stands alone)

    class _SafetensorsError(Exception):  # type: ignore[no-redef]
        """Stands in for safetensors' ``SafetensorError`` where safetensors is not installed."""


class SafetensorError(GpufeedError, _SafetensorsError):
    """An error of gpufeed's drop-in safetensors API; also a ``safetensors.SafetensorError``
    where safetensors is installed."""


SafetensorError.__module__ = "gpufeed"


class _FileNotFound(SafetensorError, FileNotFoundError):
    """A missing file: both a ``SafetensorError`` and a ``FileNotFoundError``."""


class _NoGpu(SafetensorError, NoGpuError):
    """No usable GPU: both a ``SafetensorError`` and a ``gpufeed.NoGpuError``."""


_FileNotFound.__module__ = "gpufeed"
_NoGpu.__module__ = "gpufeed"

# Bytes per allocation of get_tensors / prefetch; the most that loads as one transfer
# (chunks that follow one another, each handed out as it lands: one start and end of a
# transfer for them all; 0: a transfer per chunk); the most a get_tensor sweep holds loaded
# or loading ahead of its caller. Runs of 4 GiB with 4 GiB ahead against none and 2 GiB (GPU
# run 236, an H100, 4 GiB in 4,096 tensors, two rounds of three fresh processes): get_tensor
# of each fresh 31.0-31.4 GB/s against 27.5-30.2 (medians), again 37.5-38.7 against
# 34.1-37.9; prefetch fresh 32.4-32.5 against 30.3, again 39.7-40.7 against 38.4-38.5.
_CHUNK = int(os.environ.get("GPUFEED_PREFETCH_CHUNK_MIB", "1024")) << 20
_RUN = int(os.environ.get("GPUFEED_PREFETCH_RUN_MIB", "4096")) << 20
_SWEEP_AHEAD = int(os.environ.get("GPUFEED_SWEEP_AHEAD_MIB", "4096")) << 20
_SWEEP_FROM = 8 << 20
# More runs than this in a GPU slice: its rows are read whole and cut on the GPU.
_MAX_RUNS = 65536

# safetensors dtype -> (torch dtype attribute, bytes per storage element, packed two per byte).
_DTYPES = {
    "BOOL": ("bool", 1, False), "U8": ("uint8", 1, False), "I8": ("int8", 1, False),
    "F8_E5M2": ("float8_e5m2", 1, False), "F8_E4M3": ("float8_e4m3fn", 1, False),
    "F8_E8M0": ("float8_e8m0fnu", 1, False), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1, False),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1, False), "I16": ("int16", 2, False),
    "U16": ("uint16", 2, False), "F16": ("float16", 2, False), "BF16": ("bfloat16", 2, False),
    "I32": ("int32", 4, False), "U32": ("uint32", 4, False), "F32": ("float32", 4, False),
    "C64": ("complex64", 8, False), "F64": ("float64", 8, False), "I64": ("int64", 8, False),
    "U64": ("uint64", 8, False), "F4": ("float4_e2m1fn_x2", 1, True),
}

_PT = ("pt", "torch", "pytorch")
_CLOSED = "File is closed: open it again with gpufeed.safe_open"


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a checkpoint's tensors are made: their
    tens of thousands of new objects hold no cycles, and a full collection they set off would
    scan every object of the process, torch's included (tens of ms, at random). Re-enabled
    after, unless it was off before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _torch():
    try:
        import torch
    except ImportError as e:
        raise SafetensorError(
            f"gpufeed.safe_open(framework='pt') makes torch tensors, and torch is not installed ({e})"
        ) from None
    return torch


def _dtype(torch, name: str):
    """(torch dtype, bytes per storage element, packed) of safetensors dtype ``name``."""
    spec = _DTYPES.get(name)
    if spec is None or not hasattr(torch, spec[0]):
        raise SafetensorError(
            f"dtype {name} has no torch dtype in torch {torch.__version__}; read the bytes with "
            "gpufeed.load_range and reinterpret them"
        )
    return getattr(torch, spec[0]), spec[1], spec[2]


def _storage_shape(name: str, dtype: str, shape) -> Tuple[int, ...]:
    """The shape torch holds: F4 packs two values in a byte (the last dimension halved)."""
    if dtype != "F4":
        return tuple(shape)
    if not shape or shape[-1] % 2:
        raise SafetensorError(
            f"f4_x2 dtype requires that the last dim be divisible by 2 in torch: got {list(shape)} "
            f"({name})"
        )
    return tuple(shape[:-1]) + (shape[-1] // 2,)


def _strides(shape) -> Tuple[int, ...]:
    out = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        out[i - 1] = out[i] * max(shape[i], 1)
    return tuple(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def device_ordinal(device) -> Optional[int]:
    """``None`` for the CPU, else the CUDA ordinal of ``device`` (``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, ``N``, a ``torch.device``); other devices are refused."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise SafetensorError(f"device {device!r} is invalid")
    if isinstance(device, int):
        if device < 0:
            raise SafetensorError(f"device {device} is invalid")
        return device
    text = str(device)
    if text == "cpu":
        return None
    if text == "cuda":
        index = getattr(device, "index", None)
        return index if isinstance(index, int) else 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise SafetensorError(
        f"device {text} is invalid: gpufeed.safe_open loads to 'cpu', 'cuda', 'cuda:N' or N"
    )


def _translated(e: Exception, path=None) -> Exception:
    """A native error as ``SafetensorError`` (no GPU: also a ``NoGpuError``)."""
    if isinstance(e, SafetensorError):
        return e
    if isinstance(e, NoGpuError):
        return _NoGpu(str(e))
    if path is not None and _is_url(path):
        # An object's 404 (the index's or a shard's) reads "<url>: not found (no such bucket
        # or key...)", gpufeed_object::Error::NotFound's text.
        if ": not found (no such bucket or key" in str(e):
            return _FileNotFound(str(e))
        return SafetensorError(str(e))
    if path is not None and not os.path.exists(path):
        return _FileNotFound(f"No such file or directory: {path}")
    return SafetensorError(str(e))


def _as_int(v) -> Optional[int]:
    """``v`` as an int where it is an integer (numpy's and torch's too), else None; a bool is
    no integer here."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _is_url(path) -> bool:
    """Whether ``path`` names an object (``s3://``, ``s3a://``, ``http://``, ``https://``, with
    something after the scheme), as gpufeed's native ``ObjectUrl::is_url`` decides."""
    if not isinstance(path, str) or "://" not in path:
        return False
    scheme, rest = path.split("://", 1)
    return scheme.lower() in ("s3", "s3a", "http", "https") and bool(rest)


class TensorMeta:
    """A tensor's header entry, as written in the file; no data is read to build it:
    ``dtype`` (its safetensors name, e.g. ``"F32"``), ``shape`` and ``data_offsets`` (its
    ``(start, end)`` in the data section)."""

    def __init__(self, dtype: str, shape: List[int], data_offsets: Tuple[int, int]):
        self.dtype = dtype
        self.shape = shape
        self.data_offsets = data_offsets

    def __repr__(self) -> str:
        return (f"TensorMeta(dtype={self.dtype!r}, shape={self.shape}, "
                f"data_offsets={self.data_offsets})")



# One tensor: `file` (its index in the handle), `index` (in its file's `tensors()`), `dtype`,
# `shape`, `start`/`end` (absolute offsets in its file), `rel` (offsets in the data section);
# made by the native side for every tensor at once (`SafeFile.entries`).
_Entry = _gpufeed.Entry
_Array = _gpufeed.Array

_IMPORTERS: Dict[int, Any] = {}


class _Layout:
    """File ``k`` of a handle as the drop-in views it: ``names`` (as ``tensors()`` lists them,
    sorted), ``by_name`` (name -> ``_Entry``), ``order`` (the native indices in the order of
    the bytes), ``offset_names`` (the names in that order), ``dtypes`` (the set of its
    dtypes) and, made on first use, ``positions()`` (name -> ``(k, i)``, ``i`` its place in
    byte order). Made once per parse of a header and shared by every handle that opens a
    file of that header as its file ``k`` (``_layout``): read only."""

    __slots__ = ("k", "names", "by_name", "order", "offset_names", "dtypes", "_positions")

    def __init__(self, f, k: int):
        with _collector_paused():
            names, entries, order = f.entries(k)
            self.k = k
            self.names = names
            self.order = order
            self.by_name = dict(zip(names, entries))
            self.offset_names = [names[i] for i in order]
            self.dtypes = frozenset(e.dtype for e in entries)
            self._positions = None

    def positions(self) -> Dict[str, Tuple[int, int]]:
        got = self._positions
        if got is None:
            with _collector_paused():
                got = dict(zip(self.offset_names,
                               zip(itertools.repeat(self.k), range(len(self.offset_names)))))
            self._positions = got
        return got


# `_Layout`s of the headers opened last, by (`SafeFile.header_key().id`, k), each with its key
# (which keeps that id its parse's: a file being opened holds its parse, so an id found is the
# parse of that file's header): a file opened again (a checkpoint loaded twice, a shard opened
# for its names and again for its tensors) makes no Python object per tensor. Only views of
# parses the native side keeps (`HeaderKey.kept`: those a file opened again gets), at most
# `_LAYOUT_COUNT` of them, of `_LAYOUT_TENSORS` tensors in all (about 300 bytes each); where
# room is needed, views of parses the native side no longer keeps go first.
_LAYOUTS: "OrderedDict[Tuple[int, int], Tuple[Any, _Layout]]" = OrderedDict()
_LAYOUT_COUNT = 256
_LAYOUT_TENSORS = 1 << 18
_LAYOUTS_LOCK = threading.Lock()
_NO_POSITIONS: Dict[str, Tuple[int, int]] = {}


def _fresh_lock_after_fork() -> None:
    """A child forked while another thread held the views' lock gets one of its own."""
    global _LAYOUTS_LOCK
    _LAYOUTS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_after_fork)


def _layout(f, k: int) -> _Layout:
    """File ``k``'s ``_Layout``: the one made before for its header, else a new one (kept
    where its parse is)."""
    key = f.header_key()
    if key is None or len(key) > _LAYOUT_TENSORS:  # an object (parsed on every open); too large
        return _Layout(f, k)
    at = (key.id, k)
    with _LAYOUTS_LOCK:
        got = _LAYOUTS.get(at)
        if got is not None:
            _LAYOUTS.move_to_end(at)
            return got[1]
    lay = _Layout(f, k)
    if not key.kept:
        return lay
    with _LAYOUTS_LOCK:
        _LAYOUTS[at] = (key, lay)
        total = sum(len(kept.names) for _, kept in _LAYOUTS.values())
        if len(_LAYOUTS) > _LAYOUT_COUNT or total > _LAYOUT_TENSORS:
            # Room is needed: views of parses the native side no longer keeps first (no open
            # finds them again), then the least recent.
            for stale in [a for a, (kept, _) in _LAYOUTS.items() if not kept.kept]:
                total -= len(_LAYOUTS.pop(stale)[1].names)
        while len(_LAYOUTS) > _LAYOUT_COUNT or total > _LAYOUT_TENSORS:
            _, (_, gone) = _LAYOUTS.popitem(last=False)
            total -= len(gone.names)
    return lay


def _importer(torch):
    """How a DLPack capsule of a native array becomes a torch tensor: torch's own import
    (``torch._C._from_dlpack``), skipping ``torch.from_dlpack``'s protocol round (device and
    stream queries: the arrays' bytes are ready on every stream), about 1 us per tensor less;
    ``torch.from_dlpack`` (which takes capsules too) where this torch has no such function
    or it takes other arguments. The native side calls it itself where it hands out tensors
    (``importer=``)."""
    got = _IMPORTERS.get(id(torch))
    if got is None:
        raw = getattr(getattr(torch, "_C", None), "_from_dlpack", None)
        got = torch.from_dlpack
        if raw is not None:
            try:
                probe = raw(torch.zeros(1, dtype=torch.uint8).__dlpack__())
                if probe.dtype == torch.uint8 and probe.numel() == 1:
                    got = raw
            except Exception:  # noqa: BLE001 (another signature: the public way)
                pass
        _IMPORTERS[id(torch)] = got
    return got


def _as_tensor(torch, array, e: _Entry, shape=None):
    """``array`` (one tensor's own bytes, exported by the native side) as ``e``'s tensor:
    typed by DLPack where it carries the dtype, else viewed from bytes here. A tensor the
    native side already made (``importer=``) is returned as it is."""
    if not isinstance(array, _gpufeed.Array):
        return array
    try:
        capsule = array.__dlpack__()
    except GpufeedError as ex:  # a shape whose strides overflow: the handle's error class
        raise SafetensorError(f"a {e.dtype} tensor of shape {list(e.shape)}: {ex}") from None
    t = _importer(torch)(capsule)
    if array.dtype != e.dtype:
        td, _, _ = _dtype(torch, e.dtype)
        t = t.view(td).reshape(shape if shape is not None else
                                _storage_shape("", e.dtype, e.shape))
    return t


class PrefetchLoader:
    """Tensors of a handle loading to a CUDA device in the background, returned by
    ``safe_open.prefetch``: each handed out once, by ``take(name)`` or by iterating the loader
    as ``(name, tensor)`` pairs in readiness order, each a storage of its own on its chunk's
    device memory (1 GiB of tensors, or one larger tensor), which is freed once every tensor
    of it handed out is dropped; ``close`` (or the end of a ``with`` block) stops the load and
    drops what was not taken. Tensors are ready on every stream when handed out."""

    def __init__(self, torch, files, item_names, entries, shapes):
        self._torch = torch
        self._files = files  # [native prefetch], one per file
        # Per native prefetch, the name of each of its items (what was handed out is known
        # there: a tensor taken or iterated is marked so by the native side, once).
        self._item_names = item_names
        self._entries = entries  # name -> entry
        self._shapes = shapes  # name -> storage shape of a planned (row-sliced) tensor
        self._where: Optional[Dict[str, Tuple[int, int]]] = None  # built by the first take
        self._closed = False

    def names(self) -> List[str]:
        """The names this loader hands out, in file order."""
        return [n for names in self._item_names for n in names]

    def __len__(self) -> int:
        return sum(len(names) for names in self._item_names)

    def _tensor(self, name, array):
        """``name``'s tensor of what the native side handed over (a tensor it made, or an
        array of a dtype DLPack does not carry)."""
        if not isinstance(array, _gpufeed.Array):
            return array
        return _as_tensor(self._torch, array, self._entries[name], self._shapes.get(name))

    def _closed_error(self, name=None) -> SafetensorError:
        what = f"tensor {name}: the" if name is not None else "the"
        return SafetensorError(f"{what} prefetch loader was closed")

    def take(self, name: str):
        """``name``'s tensor, waiting for its bytes. Each tensor is handed out once (by
        ``take`` or by iterating); asking again raises."""
        where = self._where
        if where is None:
            where = {n: (f, i) for f, names in enumerate(self._item_names)
                     for i, n in enumerate(names)}
            self._where = where
        found = where.get(name)
        if found is None:
            raise SafetensorError(f"tensor {name} is not in the prefetch plan")
        if self._closed:
            raise self._closed_error(name)
        f, i = found
        try:
            handed = self._files[f].take_once(i, _importer(self._torch))
        except GpufeedError as e:
            if self._closed:
                raise self._closed_error(name) from None
            raise _translated(e) from None
        if handed is None:
            raise SafetensorError(
                f"tensor {name} was already delivered: a prefetch loader hands each tensor "
                "out once"
            )
        return self._tensor(name, handed)

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        """``(name, tensor)`` pairs as their bytes land; tensors already taken are skipped.
        After ``close`` it raises."""
        importer = _importer(self._torch)
        for native, names in zip(self._files, self._item_names):
            if self._closed:
                raise self._closed_error()
            try:
                # Every step native: the tensors come from the native side one by one.
                yield from native.iterate(names, importer, self._tensor)
            except GpufeedError as e:
                if self._closed:
                    raise self._closed_error() from None
                raise _translated(e) from None
        if self._closed:
            raise self._closed_error()

    def close(self) -> None:
        """Stops the background load and drops every tensor not taken; tensors handed out
        keep their memory."""
        self._closed = True
        for native in self._files:
            native.close()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class _Slice:
    """A tensor to index without reading it first (``safe_open.get_slice``): ``get_shape``,
    ``get_dtype``, and ``[...]`` with ints, slices (positive steps) and ``...``; on a GPU only
    the bytes of the slice are read. A slice keeps its file: it still reads after its handle
    was closed (``with`` block left), as safetensors' slices do."""

    def __init__(self, handle, name, entry):
        self._handle = handle
        self._name = name
        self._entry = entry

    def get_shape(self) -> List[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        return self._entry.dtype

    def __getitem__(self, index):
        return self._handle._slice(self._name, self._entry, index)

    def __repr__(self) -> str:
        return f"gpufeed slice of {self._name} ({self._entry.dtype} {self.get_shape()})"


def _is_index(x) -> bool:
    """Whether ``x`` is an integer to index with (an int, a numpy integer, ...)."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _indexers(index, shape):
    """``index`` (int, slice, ``...``, or a tuple of them) as one ``(start, stop, step,
    keep)`` per dimension of ``shape`` (``keep`` False for an int, whose dimension goes)."""
    if isinstance(index, list):
        if index:
            raise SafetensorError("Non empty lists are not implemented")
        return [(0, 0, 1, True)] + [(0, d, 1, True) for d in shape[1:]]
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise SafetensorError("Only one ellipsis (...) is allowed in slice index")
    explicit = sum(1 for it in items if it is not Ellipsis)
    if explicit > len(shape):
        raise SafetensorError(
            f"too many indices ({explicit}) for a tensor of {len(shape)} dimensions"
        )
    out = []
    for it in items:
        if it is Ellipsis:
            for _ in range(len(shape) - explicit):
                out.append((0, shape[len(out)], 1, True))
            continue
        dim = len(out)
        size = shape[dim]
        if isinstance(it, slice):
            step = None if it.step is None else (operator.index(it.step)
                                                 if _is_index(it.step) else it.step)
            if step is not None and (not isinstance(step, int) or step <= 0):
                raise SafetensorError(f"Slice step must be a positive integer, got {it.step}")
            start, stop, step = it.indices(size)
            stop = max(stop, start)
            out.append((start, stop, step, True))
        elif not isinstance(it, bool) and _is_index(it):
            it = operator.index(it)
            i = it + size if it < 0 else it
            if not 0 <= i < size:
                raise SafetensorError(f"Invalid index {it} for dimension {dim} of size {size}")
            out.append((i, i + 1, 1, False))
        else:
            raise SafetensorError(
                f"Unsupported slice index at position {dim}: expected slice, int, or ellipsis"
            )
    while len(out) < len(shape):
        out.append((0, shape[len(out)], 1, True))
    return out


class safe_open:
    """A safetensors file (or a sharded checkpoint's ``*.index.json``) opened once, its
    tensors as torch tensors when asked: the API of ``safetensors.safe_open`` for
    ``framework="pt"``.

    ``device`` is ``"cpu"`` (the default), ``"cuda"``, ``"cuda:N"``, ``N`` or a
    ``torch.device``; ``backend`` (``"mmap"`` or ``"pread"``) is accepted for compatibility
    (gpufeed reads the same way for both).

    ``filename`` may be an object's URL (``s3://bucket/key``, ``https://host/path``; an index
    with its shards beside it): headers by ranged GETs, each object read at the version
    (ETag) its header came from (one replaced meanwhile is an error). Its CPU tensors are
    read into host memory (``get_tensor``: that tensor's bytes; ``get_tensors``: each
    object's data section once; ``get_slice(name)[...]``: the whole tensor each time, then
    sliced); its CUDA tensors load by ranged GETs into pinned staging, uploaded as they
    fill, as files do (GPU slices read only the slice's bytes). Credentials and endpoint as for
    ``gpufeed.read_object`` (``AWS_*`` variables, profiles).

        with gpufeed.safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
            weights = {name: f.get_tensor(name) for name in f.keys()}
            with f.prefetch() as loader:            # every tensor, in the background
                for name, tensor in loader:
                    ...
    """

    def __init__(self, filename, framework="pt", device="cpu", *, backend="mmap"):
        if framework not in _PT:
            raise SafetensorError(
                f"framework {framework} is invalid: gpufeed.safe_open makes torch tensors "
                "('pt'); use safetensors.safe_open for other frameworks"
            )
        if backend not in ("mmap", "pread"):
            raise SafetensorError(
                f'backend "{backend}" is invalid (expected one of: "mmap", "pread")'
            )
        self._path = filename if _is_url(filename) else os.fspath(filename)
        self._ordinal = device_ordinal(device)
        try:
            self._files = _gpufeed.open_safetensors(self._path)
        except GpufeedError as e:
            raise _translated(e, self._path) from None
        layouts = [_layout(f, k) for k, f in enumerate(self._files)]
        # Per file, its tensors' names in the order of its native list (`tensors()`), its
        # native indices in the order of their bytes, and its names in that order. Shared with
        # the other handles of the same header (read only).
        self._file_names: List[List[str]] = [lay.names for lay in layouts]
        self._file_order: List[List[int]] = [lay.order for lay in layouts]
        self._file_offset_names: List[List[str]] = [lay.offset_names for lay in layouts]
        self._layouts = layouts
        if len(layouts) == 1:
            self._entries: Dict[str, _Entry] = layouts[0].by_name
            self._offset_keys: List[str] = layouts[0].offset_names
            # `tensors()` lists a file's names sorted.
            self._keys = layouts[0].names
        else:
            self._entries = {}
            self._offset_keys = []
            for lay in layouts:
                self._entries.update(lay.by_name)
                self._offset_keys.extend(lay.offset_names)
            self._keys = sorted(self._entries)
        # CUDA `get_tensor`: name -> (file, its item in the file's sweep); set once, under the
        # lock, before the first sweep is published (`_sweep`), never changed after.
        self._pos: Dict[str, Tuple[int, int]] = _NO_POSITIONS
        # Per file, the native indices of its sweep's items (`_sweep_positions`).
        self._sweep_items: Optional[List[List[int]]] = None
        self._closed = False
        self._lock = threading.Lock()
        self._torch_mod = None
        self._import = None  # `_importer(torch)`, set with the first sweep
        # Per file, its sweep: the native prefetch of its tensors in offset order, loading as
        # `get_tensor` asks for them one after another (see the module).
        self._sweeps: Dict[int, Any] = {}

    # -- the header -------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise SafetensorError(_CLOSED)

    def _entry(self, name) -> _Entry:
        self._check_open()
        entry = self._entries.get(name)
        if entry is None:
            raise SafetensorError(f"File does not contain tensor {name}")
        return entry

    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        self._check_open()
        return list(self._keys)

    def offset_keys(self) -> List[str]:
        """Tensor names in the order of their bytes in the file (files in the index's order)."""
        self._check_open()
        return list(self._offset_keys)

    def metadata(self) -> Optional[Dict[str, str]]:
        """The header's ``__metadata__`` (free-form strings), or ``None``; for an index, the
        first file's."""
        self._check_open()
        return self._files[0].metadata() if self._files else None

    def get_tensor_meta(self, name: str) -> TensorMeta:
        """``name``'s header entry (dtype, shape, offsets in the data section), no data read."""
        e = self._entry(name)
        return TensorMeta(e.dtype, list(e.shape), e.rel)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- tensors ----------------------------------------------------------------------------

    def _torch(self):
        if self._torch_mod is None:
            self._torch_mod = _torch()
        return self._torch_mod

    def _host_view(self, e: _Entry):
        """``e`` as a tensor of its own on its file's private mapping."""
        torch = self._torch()
        _dtype(torch, e.dtype)
        try:
            array = self._files[e.file].host_tensors([e.index])[0]
        except GpufeedError as ex:
            raise _translated(ex) from None
        return _as_tensor(torch, array, e)

    def _alone(self, e: _Entry, spans=None, shape=None):
        """``e`` (or its bytes ``spans``) loaded on its own into new device memory."""
        torch = self._torch()
        td, _, _ = _dtype(torch, e.dtype)
        spans = spans if spans is not None else [(e.start, e.end)]
        try:
            array = self._files[e.file].load_spans(self._ordinal, spans)
        except GpufeedError as ex:
            raise _translated(ex) from None
        shape = shape if shape is not None else _storage_shape("", e.dtype, e.shape)
        return torch.from_dlpack(array).view(td).reshape(shape)

    def _sweep(self, k) -> None:
        """Starts file ``k``'s sweep unless it has one."""
        if k not in self._sweeps:
            with self._lock:
                self._check_open()  # not after a close that raced this call
                if k not in self._sweeps:
                    torch = self._torch()
                    if self._sweep_items is None:
                        self._sweep_positions(torch)
                    try:
                        native = self._files[k].prefetch_tensors(
                            self._ordinal, self._sweep_items[k], _CHUNK, _SWEEP_AHEAD,
                            _SWEEP_FROM, _RUN)
                    except GpufeedError as e:
                        raise _translated(e) from None
                    self._import = _importer(torch)
                    self._sweeps[k] = native

    def _sweep_positions(self, torch) -> None:
        """The items of every file's sweep (its tensors in the order of their bytes, but those
        of dtypes this torch lacks) and ``_pos``, each tensor's file and item, set once (under
        the lock, before a sweep is published: a thread that finds a sweep finds its
        positions)."""
        lacking = {d for lay in self._layouts for d in lay.dtypes
                   if not hasattr(torch, _DTYPES.get(d, ("-",))[0])}
        items, pos = [], {}
        for k, lay in enumerate(self._layouts):
            if lay.dtypes & lacking:
                names = [n for n in lay.offset_names if lay.by_name[n].dtype not in lacking]
                items.append([lay.by_name[n].index for n in names])
                pos.update(zip(names, zip(itertools.repeat(k), range(len(names)))))
            else:
                items.append(lay.order)
                if len(self._layouts) == 1:
                    pos = lay.positions()  # shared with the other handles of this header
                else:
                    pos.update(lay.positions())
        self._sweep_items = items
        self._pos = pos

    def _item(self, name, rows=None):
        """``(start, end, align, tensor, shape)`` of ``name`` (rows ``rows`` of it) for a
        native prefetch."""
        e = self._entries[name]
        align = _DTYPES.get(e.dtype, ("", 1, False))[1]
        if rows is None:
            return (e.start, e.end, align, e.index, list(e.shape))
        row = (e.end - e.start) // e.shape[0] if e.shape[0] else 0
        shape = [rows[1] - rows[0]] + list(e.shape[1:])
        return (e.start + rows[0] * row, e.start + rows[1] * row, align, e.index, shape)

    def get_tensor(self, name: str, dtype=None):
        """The tensor ``name`` on the handle's device. ``dtype`` (gpufeed's, not safetensors'
        argument: a floating ``torch.dtype`` or its name) casts a floating tensor to it on that
        device after its load, by torch's ``.to`` (the loaded tensor is dropped after; its
        memory goes with the last tensor of its chunk). Whole checkpoints cast on the way, in
        a bounded staging: ``gpufeed.load_safetensors(dtype=)``."""
        if dtype is not None:
            return self._cast(self.get_tensor(name), dtype)
        at = self._pos.get(name)
        sweep = self._sweeps.get(at[0]) if at is not None else None
        if sweep is None or self._closed:
            e = self._entry(name)
            if self._ordinal is None:
                return self._host_view(e)
            _dtype(self._torch(), e.dtype)
            self._sweep(e.file)
            at = self._pos[name]
            sweep = self._sweeps.get(at[0])
            if sweep is None:  # closed by another thread meanwhile (`close` clears the sweeps)
                raise SafetensorError(_CLOSED)
        # A tensor of a sweep, handed out by the native side (None: asked for before).
        try:
            got = sweep.take_once(at[1], self._import)
        except GpufeedError as ex:
            raise _translated(ex) from None
        if got is None:
            return self._alone(self._entry(name))  # asked again: its own copy, as safetensors gives
        if got.__class__ is _Array:  # a dtype DLPack does not carry: viewed here
            return _as_tensor(self._torch_mod, got, self._entries[name])
        return got

    def _cast(self, t, dtype):
        """``t`` in ``dtype`` where it is floating and not already."""
        torch = self._torch()
        if isinstance(dtype, str):
            named = getattr(torch, dtype, None)
            if not isinstance(named, torch.dtype):
                raise SafetensorError(f"dtype {dtype!r} is not a torch dtype")
            dtype = named
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SafetensorError(f"dtype {dtype!r}: give a floating torch.dtype or its name")
        if t.dtype == dtype or not t.is_floating_point():
            return t
        return t.to(dtype)

    def get_tensors(self) -> Dict[str, Any]:
        """Every tensor, as a dict in the order of the file (``offset_keys``). On a GPU each
        file is one transfer into one allocation (every tensor is handed out: nothing is held
        for nobody), read through the descriptors this handle opened."""
        self._check_open()
        if self._ordinal is None:
            torch = self._torch()
            out = {}
            for k, f in enumerate(self._files):
                names = [n for n in self._offset_keys if self._entries[n].file == k]
                for name in names:
                    _dtype(torch, self._entries[name].dtype)
                try:
                    arrays = f.host_tensors([self._entries[n].index for n in names])
                except GpufeedError as ex:
                    raise _translated(ex) from None
                for name, array in zip(names, arrays):
                    out[name] = _as_tensor(torch, array, self._entries[name])
            return {n: out[n] for n in self._offset_keys}
        torch = self._torch()
        for dtype in {d for lay in self._layouts for d in lay.dtypes}:
            _dtype(torch, dtype)
        out = dict.fromkeys(self._offset_keys)
        importer = _importer(torch)
        for k, f in enumerate(self._files):
            with _collector_paused():
                try:
                    tensors = f.load_tensors(self._ordinal, importer)
                except GpufeedError as ex:
                    raise _translated(ex) from None
                out.update(zip(self._file_names[k], tensors))
                for name, t in zip(self._file_names[k], tensors):
                    if isinstance(t, _gpufeed.Array):  # a dtype DLPack does not carry
                        out[name] = _as_tensor(torch, t, self._entries[name])
        return out

    def get_slice(self, name: str) -> _Slice:
        """A slice object of ``name``: ``get_shape()``, ``get_dtype()``, and ``[...]`` reading
        only the slice."""
        return _Slice(self, name, self._entry(name))

    def _slice(self, name, e: _Entry, index):
        # No open check: a slice taken before `close` still reads (safetensors' do); the
        # native file it reads stays until the last slice and the handle are gone.
        torch = self._torch()
        td, size, packed = _dtype(torch, e.dtype)
        shape = list(e.shape)
        if self._ordinal is None and not packed:
            # On the CPU, as safetensors does it: torch's indexing of the tensor's view of the
            # mapping (a view, contiguous or not; torch's errors).
            return self._host_view(e)[index]
        dims = _indexers(index, shape)
        if packed and dims and dims[-1][:3] != (0, shape[-1], 1):
            raise SafetensorError(
                f"{name}: F4 packs two values in a byte; slicing its last dimension is not supported"
            )
        if self._ordinal is None:
            # F4 with its last dimension whole: the same index of the view of its bytes (whose
            # other dimensions are the tensor's).
            return self._host_view(e)[index]
        # On a GPU: the bytes of the step-1 hull of the slice, in runs; dimensions in storage
        # units (F4: the last one, taken whole, in bytes of two values).
        sto = list(_storage_shape(name, e.dtype, shape)) if shape else []
        hull = [(a, b) for a, b, _, _ in dims]
        if packed and hull:
            hull[-1] = (0, sto[-1])
        sshape = [b - a for a, b in hull]
        if _numel(sshape) == 0:
            result = torch.empty(sshape, dtype=td, device=f"cuda:{self._ordinal}")
        elif not shape:
            result = self._alone(e, shape=sshape)
        else:
            strides = _strides(sto)
            # The last dimension the slice does not take whole: runs are contiguous below it.
            p = max((d for d, (a, b) in enumerate(hull) if (a, b) != (0, sto[d])), default=0)
            run = (hull[p][1] - hull[p][0]) * strides[p] * size
            if _numel(sshape[:p]) <= _MAX_RUNS:
                starts = self._row_major_starts(e, hull, p, strides, size)
                result = self._alone(e, [(s, s + run) for s in starts], shape=sshape)
            else:
                a0, b0 = hull[0]
                row = strides[0] * size
                rows = self._alone(e, [(e.start + a0 * row, e.start + b0 * row)],
                                   shape=[b0 - a0] + sto[1:])
                cut = (slice(None),) + tuple(slice(a, b) for a, b in hull[1:])
                result = rows[cut].contiguous()
        steps = tuple(slice(None, None, s) for _, _, s, _ in dims)
        if any(s != 1 for _, _, s, _ in dims):
            result = result[steps].contiguous()
        drop = [d for d, (_, _, _, keep) in enumerate(dims) if not keep]
        if drop:
            result = result.reshape([n for d, n in enumerate(result.shape) if d not in drop])
        return result

    @staticmethod
    def _row_major_starts(e, hull, p, strides, elem):
        """Absolute start of each run of a slice, outermost index slowest."""
        starts = [e.start + hull[p][0] * strides[p] * elem]
        for d in range(p - 1, -1, -1):
            a, b = hull[d]
            step = strides[d] * elem
            starts = [s + i * step for i in range(a, b) for s in starts]
        return starts

    # -- prefetch ---------------------------------------------------------------------------

    def _plan(self, plan):
        """``plan`` as ``{name: None | (start row, end row)}`` (checked as safetensors does)."""
        if plan is None:
            return None
        if not isinstance(plan, dict):
            raise SafetensorError("a prefetch plan is a dict of tensor names to None or a slice")
        rows_of = {}
        for name, value in plan.items():
            if not isinstance(name, str):
                raise SafetensorError("prefetch plan keys must be tensor names")
            e = self._entries.get(name)
            if e is None:
                raise SafetensorError(f"File does not contain tensor {name}")
            if value is None:
                rows_of[name] = None
                continue
            if not isinstance(value, slice):
                raise SafetensorError(
                    f"prefetch plan values must be None or a slice, got {type(value)} for {name}"
                )
            if not e.shape:
                raise SafetensorError(f"cannot slice rows of the 0-d tensor {name}")
            n = e.shape[0]
            for attr in ("start", "stop"):
                v = getattr(value, attr)
                if v is None:
                    continue
                v = _as_int(v)  # numpy's and torch's integers too, as safetensors takes them
                if v is None:
                    raise SafetensorError(
                        f"prefetch plan slice bounds for {name} must be integers or None"
                    )
                if v > n or v < -n:
                    raise SafetensorError(
                        f"prefetch plan slice {attr} {v} for {name} is out of range for {n} rows"
                    )
            try:
                start, stop, step = value.indices(n)
            except (ValueError, TypeError) as ex:
                raise SafetensorError(f"invalid prefetch plan slice for {name}: {ex}") from None
            if step != 1:
                raise SafetensorError(
                    f"prefetch plan slices must have step 1, got {step} for {name}"
                )
            nbytes = e.end - e.start
            if n and nbytes % n:
                raise SafetensorError(
                    f"cannot slice rows of {name}: a row is not a whole number of bytes"
                )
            rows_of[name] = (start, max(stop, start))
        return rows_of

    def prefetch(self, plan=None, *, device=None, threads: int = 8) -> PrefetchLoader:
        """Starts loading the tensors of ``plan`` (every tensor where ``None``; values ``None``
        for a whole tensor or a step-1 ``slice`` of its rows: only those bytes are read) to a
        CUDA device (``device``, else the handle's) in the background: a ``PrefetchLoader``.
        ``threads`` is accepted for compatibility (gpufeed's loader uses its own IO
        threads). The handle itself is unchanged; several loaders may run from one handle."""
        self._check_open()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise SafetensorError(f"threads {threads!r} is invalid: use a positive number")
        ordinal = self._ordinal if device is None else device_ordinal(device)
        if ordinal is None:
            shown = "cpu" if device is None else device
            raise SafetensorError(f"prefetch loads to cuda devices, not {shown}")
        torch = self._torch()
        rows_of = self._plan(plan)
        entries = self._entries
        # Per file with tensors in the plan: (file, native items, their names), in file order.
        per_file: List[Tuple[int, list, List[str]]] = []
        shapes: Dict[str, list] = {}
        if rows_of is None:
            dtypes = {d for lay in self._layouts for d in lay.dtypes}
            per_file = [(k, self._file_order[k], self._file_offset_names[k])
                        for k in range(len(self._files)) if self._file_order[k]]
        else:
            names = [n for n in self._offset_keys if n in rows_of]
            if not names:
                raise SafetensorError("prefetch plan selects no tensors")
            dtypes = {entries[n].dtype for n in names}
            by_file: Dict[int, Tuple[list, List[str]]] = {}
            whole = all(r is None for r in rows_of.values())
            for name in names:
                e = entries[name]
                items, item_names = by_file.setdefault(e.file, ([], []))
                item_names.append(name)
                rows = rows_of[name]
                if whole:
                    items.append(e.index)  # the native side knows their bytes and shapes
                    continue
                shape = list(e.shape)
                if rows is not None:
                    shape[0] = rows[1] - rows[0]
                shapes[name] = _storage_shape(name, e.dtype, shape)
                items.append(self._item(name, rows))
            per_file = [(k, *by_file[k]) for k in sorted(by_file)]
        for dtype in dtypes:
            if dtype not in _DTYPES or not hasattr(torch, _DTYPES[dtype][0]):
                raise SafetensorError(
                    f"prefetch cannot hand out dtype {dtype}: torch has no matching dtype"
                )
        natives = []
        try:
            for k, items, _ in per_file:
                f = self._files[k]
                start = f.prefetch if shapes else f.prefetch_tensors
                natives.append(start(ordinal, items, _CHUNK, run_bytes=_RUN))
        except GpufeedError as e:
            for n in natives:
                n.close()
            raise _translated(e) from None
        return PrefetchLoader(torch, natives, [names for _, _, names in per_file], entries,
                              shapes)

    # -- the handle -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the handle (later calls raise); tensors handed out stay valid."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sweeps = list(self._sweeps.values())
            self._sweeps.clear()
        for native in sweeps:
            native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def load_bytes(data: bytes) -> Dict[str, Any]:
    """A whole safetensors file held in ``data`` as CPU tensors (a copy of the bytes, as
    ``safetensors.torch.load`` gives)."""
    torch = _torch()
    try:
        start, _, tensors = _gpufeed.parse_header(bytes(data))
    except GpufeedError as e:
        raise SafetensorError(str(e)) from None
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else \
        torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, dtype, shape, a, b in sorted(tensors, key=lambda t: t[3]):
        td, size, _ = _dtype(torch, dtype)
        sshape = _storage_shape(name, dtype, shape)
        out[name] = whole[start + a: start + b].clone().view(td).reshape(sshape)
    return out
