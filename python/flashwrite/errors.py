"""Exceptions raised by flashwrite.

OS failures are plain ``OSError`` subclasses (``FileNotFoundError``, ``PermissionError``,
``OSError`` with ``errno.ENOSPC``...) whose message names the operation and file offset;
the native layer also sets ``.offset`` and ``.op`` on them.
"""

from __future__ import annotations


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return e


class FlashwriteError(Exception):
    """Base class of flashwrite's own errors.

    They pickle with their fields (``file``, ``offset``, ``divergence``...): DCP ships
    each rank's error to the others, and Exception's own pickling calls ``__init__``
    with the message alone, which the keyword-only fields refuse."""

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, self.__dict__))


class CorruptCheckpointError(FlashwriteError):
    """A checkpoint's bytes or structure are not what its manifest promises.

    ``file`` and ``tensor`` name the damaged place when it is known.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.file = file
        self.tensor = tensor


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not hash to the checksum recorded at save time."""

    def __init__(self, message: str, *, file: str, tensor: str, offset: int, expected: str, actual: str):
        super().__init__(message, file=file, tensor=tensor)
        self.offset = offset
        self.expected = expected
        self.actual = actual


class UnsafeCheckpointError(CorruptCheckpointError):
    """The checkpoint asks for something flashwrite will not do by default
    (unpickling, a path outside the checkpoint directory)."""


class CheckpointExistsError(FlashwriteError, FileExistsError):
    """The target path already holds a checkpoint and ``overwrite=True`` was not given."""


class DistributedSaveError(FlashwriteError):
    """A multi-rank save failed on another rank (or contact with a peer was lost).

    ``failures`` maps each failed rank of the group to its error text; it is empty
    when a peer was lost without a word (killed, or silent past the timeout)."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class DivergedReplicasError(DistributedSaveError):
    """Ranks declared replicas of one another (``replica_group=``) hold different bytes.

    Silent data corruption on some GPU or host, or a nondeterminism bug. ``divergence``
    lists each disagreeing piece: ``{"tensor", "piece": [start, end], "digests": {hex:
    [ranks]}, "majority": hex or None}`` (byte ranges within the tensor, global ranks).
    Nothing was committed."""

    def __init__(self, message: str, divergence: list[dict]):
        super().__init__(message)
        self.divergence = divergence


class DistributedLoadError(FlashwriteError):
    """A multi-rank load with ``replica_group=`` failed on another rank, or a peer was
    lost during the exchange of what each rank read."""
