"""Where flashwrite's DCP writer keeps DCP's own contract rather than flashwrite's.

overwrite: as torch's ``FileSystemWriter``, a save replaces the checkpoint at its path
by default, and with ``overwrite=False`` it is refused only when a checkpoint is there:
an existing empty directory is written into. The replacement is flashwrite's atomic
commit, so the earlier checkpoint stays whole until the new one is committed. A refusal
carries DCP's own message and is a ``RuntimeError`` (what ``FileSystemWriter`` raises)
as well as flashwrite's ``CheckpointExistsError``, so code that matches either keeps
working. What flashwrite never replaces stays refused with either setting: a path
that is neither a flashwrite checkpoint nor an empty directory (a file, a directory
holding other files, a checkpoint of torch's own ``FileSystemWriter``).

The executor: the writer stages into flashwrite's native engine in this process, so
``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``, which
pickles the writer into a separate checkpoint process, is refused at the call,
before anything is staged; the thread executor (the default) is the one to use.
"""

from __future__ import annotations

import sys
from typing import Any

from ...saving import commit
from ...errors import CheckpointExistsError
from ...targets.target import Target

# torch/distributed/checkpoint/filesystem.py, FileSystemWriter.prepare_local_plan:
#     raise RuntimeError(f"Checkpoint already exists and {self.overwrite=}.")
EXISTS_MESSAGE = "Checkpoint already exists and self.overwrite=False."

PROCESS_MESSAGE = ("FlashwriteStorageWriter cannot run in DCP's process executor "
                   "(async_checkpointer_type=AsyncCheckpointerType.PROCESS): it stages into flashwrite's native "
                   "engine in this process, which already writes off the training thread. Use "
                   "async_checkpointer_type=AsyncCheckpointerType.THREAD (the default).")


class DcpCheckpointExistsError(CheckpointExistsError, RuntimeError):
    """The DCP save's path holds a checkpoint and ``overwrite=False``; or the path holds
    something flashwrite never replaces. Both a ``CheckpointExistsError`` (``FileExistsError``)
    and the ``RuntimeError`` DCP's ``FileSystemWriter`` raises, with its message."""


def target_problem(final: str, overwrite: bool, target: Target) -> str | None:
    """Why a DCP save may not go to ``final``, or None (DCP's rule, see the module doc)."""
    problem = commit.target_problem(final, True, target)  # what flashwrite never replaces
    if problem:
        return problem
    if not overwrite and target.exists(final) and target.list(final):  # a checkpoint; an empty directory is not
        return EXISTS_MESSAGE
    return None


def check_target(final: str, overwrite: bool, target: Target) -> None:
    raise_problem(target_problem(final, overwrite, target), final, target)


def raise_problem(problem: str | None, final: str, target: Target) -> None:
    if problem:
        raise DcpCheckpointExistsError(17, problem, target.show(final))


def refuse_process_executor() -> None:
    """Raise at ``async_save`` when it was asked for the process executor. ``stage()`` runs
    before DCP picks its executor, so the call's own argument is read from its frame;
    where that cannot be found, pickling the writer (``__reduce__``) raises the same."""
    frame: Any = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        if frame.f_code.co_name == "async_save" and \
                frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_saver":
            kind = frame.f_locals.get("async_checkpointer_type")
            if getattr(kind, "name", None) == "PROCESS":
                raise ValueError(PROCESS_MESSAGE)
            return
        frame = frame.f_back
