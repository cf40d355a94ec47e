"""flashwrite: nearly free PyTorch checkpoints.

``save_async`` returns once the state is snapshotted in host memory; a native
engine (io_uring, O_DIRECT, striped) writes it and commits it atomically. Each
checkpoint is a directory of valid safetensors files plus a manifest.
"""

from ._core import __version__
from .errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DistributedLoadError,
    DistributedSaveError,
    DivergedReplicasError,
    FlashwriteError,
    UnsafeCheckpointError,
)
from .future import CheckpointFuture, LoadFuture, LoadStats, SaveFuture, SaveStats
from .system.info import backend_info
from .loading.load import load, load_async, verify
from .manager.manager import CheckpointManager
from .saving.save import Writer, prepare, save, save_async
from .targets.target import UnsupportedTargetError

__all__ = [
    "__version__",
    "backend_info",
    "save",
    "save_async",
    "prepare",
    "load",
    "load_async",
    "verify",
    "Writer",
    "SaveFuture",
    "SaveStats",
    "CheckpointFuture",
    "LoadFuture",
    "LoadStats",
    "CheckpointManager",
    "FlashwriteError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "UnsafeCheckpointError",
    "CheckpointExistsError",
    "DistributedLoadError",
    "DistributedSaveError",
    "DivergedReplicasError",
    "UnsupportedTargetError",
]
