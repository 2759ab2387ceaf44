"""gpufeed: files, safetensors checkpoints and dataset batches on NVIDIA GPUs, fast.

The loads return ``torch.Tensor`` objects on ``cuda:<device>`` without a copy (DLPack); where
torch is not installed they return ``gpufeed.Array`` objects (here ``Tensor`` is then unknown
to the type checker too). The docstrings are in ``__init__.py`` (pyright and Pylance read them
there) and in ``_gpufeed.pyi``. ``tests/test_cpu.py`` checks that this stub names every public
function and class of the package, with their parameters."""

from os import PathLike
from typing import Literal, Sequence

from torch import Tensor
from torch import device as _TorchDevice

from ._gpufeed import Array as Array
from ._gpufeed import Batch as Batch
from ._gpufeed import BatchLoader as BatchLoader
from ._gpufeed import EpochIter as EpochIter
from ._gpufeed import GpufeedError as GpufeedError
from ._gpufeed import NoGpuError as NoGpuError
from ._gpufeed import RegisteredFile as RegisteredFile
from ._gpufeed import __version__ as __version__
from ._gpufeed import advise as advise
from ._gpufeed import doctor as doctor

__all__ = [
    "Array",
    "Batch",
    "BatchLoader",
    "GpufeedError",
    "Loader",
    "NoGpuError",
    "RegisteredFile",
    "advise",
    "as_tensor",
    "doctor",
    "load_file",
    "load_range",
    "load_replicated",
    "load_replicated_rank",
    "load_replicated_safetensors",
    "load_safetensors",
    "load_sharded",
    "load_tensor_parallel",
    "load_tensor_parallel_rank",
    "safe_open",
]

_Path = str | PathLike[str]
# The dimension a tensor-parallel load cuts: rows (0), columns (1) or a dimension number.
_Split = Literal["rows", "columns"] | int
# A CUDA ordinal, "cuda", "cuda:N" or a torch.device.
_Device = int | str | _TorchDevice

def as_tensor(array: Array) -> Tensor: ...

class Loader:
    def __init__(
        self, device: int = 0, strategy: Literal["auto", "registered", "staged", "direct"] = "auto"
    ) -> None: ...
    @property
    def device(self) -> int: ...
    def load_file(self, path: _Path) -> Tensor: ...
    def load_range(self, path: _Path, start: int, end: int) -> Tensor: ...
    def load_safetensors(self, path: _Path) -> dict[str, Tensor]: ...
    def register_file(self, path: _Path) -> RegisteredFile: ...
    def load_registered(
        self, file: RegisteredFile, start: int = 0, end: int | None = None
    ) -> Tensor: ...

def load_file(path: _Path, device: int = 0) -> Tensor: ...
def load_range(path: _Path, start: int, end: int, device: int = 0) -> Tensor: ...
def load_safetensors(path: _Path, device: int = 0) -> dict[str, Tensor]: ...
def load_replicated(path: _Path, devices: Sequence[int] = (0, 1)) -> list[Tensor]: ...
def load_sharded(
    paths: Sequence[_Path], devices: Sequence[int] = (0, 1)
) -> tuple[list[Tensor], list[list[tuple[int, int, int]]]]: ...
def load_replicated_rank(path: _Path) -> tuple[Tensor, int, int]: ...
def load_tensor_parallel(
    path: _Path, devices: Sequence[int] = (0, 1), split: _Split = "rows"
) -> list[dict[str, Tensor]]: ...
def load_replicated_safetensors(
    path: _Path, devices: Sequence[int] = (0, 1)
) -> list[dict[str, Tensor]]: ...
def load_tensor_parallel_rank(
    path: _Path, split: _Split = "rows"
) -> tuple[dict[str, Tensor], int, int]: ...

class safe_open:
    def __init__(
        self, path: _Path, framework: Literal["pt", "torch"] = "pt", device: _Device = 0
    ) -> None: ...
    def keys(self) -> list[str]: ...
    def get_tensor(self, name: str) -> Tensor: ...
    def __contains__(self, name: str) -> bool: ...
    def __len__(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> safe_open: ...
    def __exit__(self, *exc: object) -> Literal[False]: ...
