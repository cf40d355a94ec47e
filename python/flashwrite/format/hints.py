"""What to tell someone who passed a path that is not a checkpoint directory: what it
is instead (nothing, a torch.save file, a safetensors file, another file, a
CheckpointManager root) and what to do with it. Reads at most a few bytes of a file
and one listing of a directory."""

from __future__ import annotations

import errno
import os
import re
import stat

from .manifest import MANIFEST_NAME

_STEP = re.compile(r"^step-(\d+)$")


def file_kind(path: str) -> str:
    """"torch", "safetensors" or "file", from the first bytes of a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "file"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "file"
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch.save: a zip (since 1.6) or a bare pickle
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "file"


def file_hint(path: str, shown: str) -> str:
    """Why the file at ``path`` is not a flashwrite checkpoint, and what to do with it."""
    kind = file_kind(path)
    if kind == "torch":
        return (f"{shown} is a torch.save file, not a flashwrite checkpoint: read it with "
                f"torch.load(path, weights_only=True), or make a checkpoint of it with "
                f"`flashwrite convert {shown} DIR`")
    if kind == "safetensors":
        return (f"{shown} is a safetensors file, not a flashwrite checkpoint directory: flashwrite.load reads it "
                f"as it is, or make a checkpoint of it with `flashwrite convert {shown} DIR`")
    return (f"{shown} is a file, not a checkpoint directory: pass the directory that holds the checkpoint's "
            f"{MANIFEST_NAME}")


def manager_steps(path: str) -> list[str]:
    """Names of the committed step-N checkpoints right under ``path``, oldest first."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    steps = [n for n in names if _STEP.match(n) and os.path.isfile(os.path.join(path, n, MANIFEST_NAME))]
    return sorted(steps, key=lambda n: int(_STEP.match(n).group(1)))  # type: ignore[union-attr]


def manager_root_hint(path: str, shown: str) -> str | None:
    """For a directory with no manifest that holds step-N checkpoints: what to load instead."""
    steps = manager_steps(path)
    if not steps:
        return None
    newest = os.path.join(shown, steps[-1])
    return (f"{shown} is a CheckpointManager root holding {len(steps)} checkpoint(s), not one checkpoint: load "
            f"one step, e.g. the newest, {newest!r}, or use CheckpointManager({shown!r}).restore() "
            "(the newest one that verifies)")


def not_a_checkpoint(path: str, shown: str | None = None) -> OSError:
    """The error for ``path`` when a checkpoint directory was expected and ``path`` is not
    a directory: FileNotFoundError when nothing is there, NotADirectoryError (saying
    what the file is and what to do) when a file is."""
    shown = os.fspath(shown if shown is not None else path)
    if not os.path.lexists(path):
        return FileNotFoundError(errno.ENOENT, "no such checkpoint directory", shown)
    return NotADirectoryError(errno.ENOTDIR, file_hint(path, shown), shown)


def no_manifest(path: str, shown: str) -> OSError | None:
    """For a directory without a manifest: the error naming what it is, when it is a
    CheckpointManager root (else None: the caller's own message stands)."""
    hint = manager_root_hint(path, shown)
    return None if hint is None else FileNotFoundError(errno.ENOENT, hint, os.path.join(shown, MANIFEST_NAME))
