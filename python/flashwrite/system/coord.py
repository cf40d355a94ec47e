"""flashwrite's own coordination group for multi-rank work.

One gloo group per process group, never the training group, created on first
use, and one background thread per group that issues every collective on it in
submission order, so the caller's collectives are never blocked by ours or
interleaved with them. Rank 0 broadcasts a random nonce once, when the group is
made; together with a per-save sequence number it names each save's temporary
directory identically on every rank at no further cost (``commit.shared_temp_dir_for``).
After a collective fails (a peer died or went silent past the timeout) the group
is unusable; later work on it raises at once.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import uuid
from typing import Any

import torch.distributed as dist

from ..errors import DistributedSaveError

DEFAULT_TIMEOUT_S = 300.0

__all__ = ["Coordinator", "coordinator", "PeerLost", "collective", "DEFAULT_TIMEOUT_S"]


class Coordinator:
    """flashwrite's gloo group over the ranks of one process group, and the single
    thread that issues every collective on it, in submission order."""

    def __init__(self, group: Any, timeout_s: float | None, nonce: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.nonce = nonce
        self.seq = 0
        self.broken: str | None = None
        self.lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashwrite-coord")

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def next_seq(self) -> int:
        with self.lock:
            if self.broken:
                raise DistributedSaveError(f"flashwrite's coordination group is unusable since a peer was lost "
                                           f"({self.broken}); restart the job")
            self.seq += 1
            return self.seq

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.executor.submit(fn, *args, **kwargs)

    def lost(self, e: BaseException) -> None:
        with self.lock:
            if not self.broken:
                self.broken = f"{type(e).__name__}: {e}"[:500]


_coordinators: dict[tuple, Coordinator] = {}
_coordinators_lock = threading.Lock()


def coordinator(process_group: Any = None, timeout: float | None = None,
                coordination_group: Any = None) -> Coordinator:
    """The cached coordination group for ``process_group`` (None: the default group).

    Created on first use, collectively (every rank of the default group must call
    this in the same order, which the first multi-rank save does). For a subgroup
    pass ``coordination_group``: a gloo group over the same ranks that nothing but
    flashwrite uses, created by every rank (``dist.new_group`` is collective over
    the default group).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs torch.distributed to be initialized (init_process_group)")
    if coordination_group is not None:
        if dist.get_backend(coordination_group) != "gloo":
            raise ValueError("coordination_group must be a gloo group")
        key: tuple = ("given", id(coordination_group))
        group, timeout_s = coordination_group, None
    else:
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        if len(ranks) != dist.get_world_size():
            raise ValueError("process_group is a subgroup: create a gloo group over its ranks on every rank "
                             "(dist.new_group(ranks, backend='gloo', timeout=...)) and pass it as coordination_group")
        timeout_s = float(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        if timeout_s <= 0:
            raise ValueError("timeout must be positive")
        key, group = (ranks, timeout_s), None
    with _coordinators_lock:
        c = _coordinators.get(key)
        if c is not None:
            return c
        if group is None:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        box = [uuid.uuid4().hex[:12] if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        c = _coordinators[key] = Coordinator(group, timeout_s, box[0])
        return c


class PeerLost(Exception):
    """A collective on the coordination group failed: a peer died or went silent."""


def collective(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run one collective of the coordination group; a failure of it means a lost peer."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # gloo reports a closed connection or a timeout as RuntimeError
        raise PeerLost(f"{type(e).__name__}: {e}") from e
