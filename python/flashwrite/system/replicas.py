"""Replica groups: which ranks hold identical state (``replica_group=``), agreed once.

A replica group is a process group of ranks whose state is the same by design: the
world for DDP, the replicate dimension of the mesh for HSDP. The first save or load
that names one gathers every rank's view of its group over the coordination group and
checks that the groups partition the ranks consistently; each group then gets a gloo
group of its own (created by its members only), on which the digests of a save and
the pieces of a load are exchanged from the caller's thread. It is never the caller's
group, so flashwrite's collectives never interleave with training ones.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .coord import DEFAULT_TIMEOUT_S, Coordinator, collective, coordinator

__all__ = ["ReplicaLayout", "replica_layout", "layout_for_load", "balance"]


@dataclass(frozen=True)
class ReplicaLayout:
    members: tuple[int, ...]       # this rank's replica group, as ranks of the coordination group
    index: int                     # this rank's place in members
    groups: tuple[tuple[int, ...], ...]  # every replica group (coordination-group ranks), sorted
    group: Any                     # gloo group over members (None when this rank is its only member)
    timeout_s: float

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> int:
        """The rank whose key the group's replicated tensors are stored under."""
        return self.members[0]


_layouts: dict[tuple, ReplicaLayout] = {}
_lock = threading.Lock()


def _members(replica_group: Any, coord_group: Any) -> tuple[int, ...]:
    ranks = dist.get_process_group_ranks(replica_group)
    try:
        return tuple(sorted(dist.get_group_rank(coord_group, g) for g in ranks))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"replica_group holds ranks {ranks} that are not all in process_group: {e}") from e


def _check(views: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """Every rank's view of its own replica group must name it and agree with its peers'."""
    for r, members in enumerate(views):
        if r not in members:
            raise ValueError(f"rank {r}'s replica_group {list(members)} does not hold rank {r}")
        for m in members:
            if views[m] != members:
                raise ValueError(f"replica groups disagree: rank {r} says {list(members)}, rank {m} says "
                                 f"{list(views[m])}; each rank must pass the group of ranks whose state equals its own")
    return tuple(sorted(set(views)))


def replica_layout(coord: Coordinator, replica_group: Any) -> ReplicaLayout:
    """The agreed layout for ``replica_group`` (collective over the coordination group on
    first use: every rank must take part, in the same order of saves and loads)."""
    members = _members(replica_group, coord.group)
    key = (id(coord), members)
    with _lock:
        got = _layouts.get(key)
    if got is not None:
        return got
    views: list = [None] * coord.size
    # On the coordination group's own thread, after any save still using it.
    coord.run(collective, dist.all_gather_object, views, members, group=coord.group).result()
    groups = _check([tuple(v) for v in views])
    timeout_s = float(coord.timeout_s or DEFAULT_TIMEOUT_S)
    group = None
    if len(members) > 1:
        globals_ = [dist.get_global_rank(coord.group, m) for m in members]
        group = dist.new_group(globals_, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
    layout = ReplicaLayout(members, members.index(coord.rank), groups, group, timeout_s)
    with _lock:
        return _layouts.setdefault(key, layout)


def layout_for_load(process_group: Any, replica_group: Any, timeout: float | None = None) -> ReplicaLayout:
    """``replica_layout`` for a load: the coordination group of ``process_group``."""
    return replica_layout(coordinator(process_group, timeout), replica_group)


def balance(sizes: dict[int, int], n: int, prefer: dict[int, list[int]] | None = None) -> dict[int, int]:
    """Each stripe's rank (index in the group) for a save's writes or a load's reads:
    balanced by bytes, largest first, the same on every rank; a stripe in ``prefer``
    goes to the least loaded of the ranks listed for it."""
    load = [0] * n
    out: dict[int, int] = {}
    for fi in sorted(sizes, key=lambda f: (-sizes[f], f)):
        allowed = (prefer or {}).get(fi) or range(n)
        r = min(allowed, key=lambda x: (load[x], x))
        out[fi] = r
        load[r] += sizes[fi]
    return out
