"""Checks ``CheckpointManager``'s arguments and builds the writer (and so the local tier)
it saves with."""

from __future__ import annotations

import inspect
import os

from ..saving.save import Writer
from ..targets.target import unsupported

# What a caller may pass per save: Writer.save_async's keyword options, less those the
# manager sets itself (derived, so a new save option reaches the manager with no edit here).
_MANAGER_SETS = {"overwrite", "block", "allow_pickle", "metadata", "process_group", "coordination_group",
                 "timeout", "incremental", "replica_group", "rank_local", "on_divergence"}
SAVE_OPTIONS = tuple(k for k, p in inspect.signature(Writer.save_async).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in _MANAGER_SETS)


def check_save_options(options: dict) -> None:
    unknown = sorted(set(options) - set(SAVE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown save options {unknown}: the manager passes on only {list(SAVE_OPTIONS)}")


def check_schedule(every_n_steps: int | None, every_n_seconds: float | None, keep_last: int | None,
                   keep_every_n_steps: int | None, if_busy: str) -> None:
    for arg, v in (("every_n_steps", every_n_steps), ("keep_last", keep_last),
                   ("keep_every_n_steps", keep_every_n_steps)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{arg} must be a positive integer or None, not {v!r}")
    if every_n_seconds is not None and not every_n_seconds > 0:
        raise ValueError(f"every_n_seconds must be positive or None, not {every_n_seconds!r}")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy must be 'wait' or 'skip', not {if_busy!r}")


def manager_writer(root: str, root_is_local: bool, writer: Writer | None, local_snapshots: bool,
                   local_dir: str | os.PathLike | None, neighbour_copies: bool) -> Writer:
    """The writer given (checked to keep the local snapshots and neighbour copies asked
    for), or a new one that does; local snapshots need a local root."""
    if not root_is_local and (local_snapshots or neighbour_copies or (writer is not None and writer.local_snapshots)):
        raise unsupported(f"CheckpointManager root {root!r}: local snapshots with nfs:// are not supported yet",
                          root)
    if writer is None:
        return Writer(local_snapshots=local_snapshots, local_dir=local_dir, neighbour_copies=neighbour_copies)
    if local_snapshots and not writer.local_snapshots:
        raise ValueError("local_snapshots=True needs a writer made with local_snapshots=True")
    if neighbour_copies and (writer.local_tier is None or writer.local_tier.neighbours is None):
        raise ValueError("neighbour_copies=True needs a writer made with neighbour_copies=True")
    return writer
