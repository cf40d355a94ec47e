"""Restore across tiers: the newest step that verifies, from node memory or storage.

``CheckpointManager.restore`` hands the work here. On one process, each candidate
step (newest first) is tried from its local snapshots (``tier.py``), then from
storage; a step that only a snapshot holds is written back to storage. With a
process group every rank offers what it can restore (its committed steps, the
steps its own snapshots verify, and the neighbour copies it holds for rank r-1);
all ranks agree on the newest step every rank can get, a rank that lost its own
snapshot fetches the copy its neighbour keeps (``neighbour.swap``), and all ranks
vote on the outcome, so they never restore different steps.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import snapshot as local, neighbour
from ..system.coord import Coordinator, collective, coordinator
from ..errors import CorruptCheckpointError
from ..state.flatten import flatten, unflatten
from ..loading.load import load
from ..loading.read import LoadResult, fill_into, tensor_placer
from .node import LocalTier

log = logging.getLogger("flashwrite")

Restored = tuple[int, Any]  # (step, state)


class TierRestore:
    """Restore for one manager's root and local tier.

    steps(): the committed steps, ascending; path_for(step): the checkpoint of a step;
    candidates(replicas): the tier's snapshots of this root by step (the manager's
    ``local_snapshots``); write_back(step, make_state): save a step that only a snapshot
    holds (make_state() builds its state)."""

    def __init__(self, *, tier: LocalTier | None, rank: tuple[int, int] | None, process_group: Any,
                 allow_pickle: bool, steps: Callable[[], list[int]], path_for: Callable[[int], str],
                 candidates: Callable[[bool], dict[int, list[local.Snapshot]]],
                 write_back: Callable[[int, Callable[[], Any]], None]):
        self.tier, self.rank, self.process_group, self.allow_pickle = tier, rank, process_group, allow_pickle
        self.replica_group: Any = None  # set by the manager: restores read each replicated byte once
        self.steps, self.path_for, self.candidates, self.write_back = steps, path_for, candidates, write_back
        self._lock = threading.Lock()
        self._restoring: dict[int, int] = {}

    def restoring(self) -> set[int]:
        """Steps being read from storage now (retention keeps them)."""
        with self._lock:
            return set(self._restoring)

    def restore(self, step: int | None, into: Any, fallback: bool, options: dict) -> Restored | None:
        if self.process_group is not None:
            if step is not None:
                return step, self._load(step, into, options)
            return self._restore_agreed(into, options)
        return self._restore_one(step, into, fallback, options)

    def _load(self, step: int, into: Any, options: dict) -> Any:
        if self.process_group is not None:
            if self.replica_group is not None:
                options = {"replica_group": self.replica_group, **options}
            return load(self.path_for(step), into=into, allow_pickle=self.allow_pickle,
                        process_group=self.process_group, **options)
        return load(self.path_for(step), into=into, allow_pickle=self.allow_pickle, **options)

    # ------------------------------------------------------------ one process

    def _restore_one(self, step: int | None, into: Any, fallback: bool, options: dict) -> Restored | None:
        committed = self.steps()
        snaps = self.candidates(False)
        candidates = [step] if step is not None else sorted(set(committed) | set(snaps), reverse=True)
        first_error: BaseException | None = None
        for s in candidates:
            for snap in snaps.get(s, []):
                res = self._read_local(s, snap, options, into, on_storage=s in committed)
                if res is not None:
                    state = self._state_of(res, into, options)
                    if s not in committed:
                        self._write_back(s, res)
                    return s, state
            if s not in committed and step is None:
                continue
            with self._lock:
                self._restoring[s] = self._restoring.get(s, 0) + 1
            try:
                return s, self._load(s, into, options)
            except (CorruptCheckpointError, OSError) as e:
                unreadable = not isinstance(e, OSError) or isinstance(e, FileNotFoundError) or e.errno == errno.EIO
                if step is not None or not fallback or not unreadable:
                    raise
                log.error("checkpoint step %d cannot be restored (%s); trying an older one", s, e)
                first_error = first_error or e
            finally:
                with self._lock:
                    self._restoring[s] -= 1
                    if not self._restoring[s]:
                        del self._restoring[s]
        if first_error is not None:
            raise first_error
        return None

    def _read_local(self, step: int, snap: local.Snapshot, options: dict, into: Any = None,
                    on_storage: bool = False) -> LoadResult | None:
        """What a local snapshot holds, verified; None (logged) when it does not verify.
        into: its CPU tensors are filled in place where they fit (no second copy).
        on_storage: storage holds the step too, so the snapshot may be taken (see
        ``CheckpointManager.restore``)."""
        assert self.tier is not None
        t0 = time.perf_counter()
        targets = None
        if into is not None:
            wrapped = into if self.rank is None else {self.rank[0]: into}
            targets = {ft.key: ft.tensor for ft in flatten(wrapped, allow_pickle=True)[1]}
        phases: dict = {}
        try:
            zero_copy = options.get("zero_copy")
            m, tensors = self.tier.read(snap, verify=options.get("verify", True), targets=targets,
                                        adopt=bool(zero_copy) and into is None,
                                        take=on_storage and zero_copy is not False and into is None,
                                        timings=phases)
        except (CorruptCheckpointError, OSError, KeyError, TypeError, ValueError) as e:
            log.error("local snapshot of step %d (%s) cannot be restored (%s); trying other copies", step,
                      snap.header, e)
            return None
        log.info("restored step %d from local memory (%s) in %.3f s (%s)", step, snap.header,
                 time.perf_counter() - t0, ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
        return LoadResult(m, tensors, time.perf_counter() - t0, "local", False)

    def _state_of(self, res: LoadResult, into: Any, options: dict) -> Any:
        # A rank's snapshot holds {rank: state}, like its part of a multi-rank checkpoint.
        rank = self.rank
        wrap: Callable[[Any], Any] = (lambda x: x) if rank is None else (lambda x: {rank[0]: x})
        if into is not None:
            return fill_into(res, into, flatten(wrap(into), allow_pickle=True), wrap, options.get("strict", True),
                             self.allow_pickle)
        state = unflatten(res.manifest.tree, tensor_placer(res, options.get("map_location", "cpu")),
                          allow_pickle=self.allow_pickle)
        return state if rank is None else state[rank[0]]

    def _write_back(self, step: int, res: LoadResult) -> None:
        """Save a step that only a local snapshot holds to root (returns once staged)."""
        self.write_back(step, lambda: self._state_of(res, None, {}))

    # ------------------------------------------------------------ every rank

    def _restore_agreed(self, into: Any, options: dict) -> Restored | None:
        """Every rank offers the committed steps, the steps its own snapshots verify, and
        those whose copy it keeps for rank r-1; all take the newest step that every rank can
        get from some tier. A rank without its own snapshot of it fetches the copy from r+1."""
        coord = coordinator(self.process_group)
        committed = self.steps()
        newest = committed[-1] if committed else -1
        verified: dict[int, LoadResult] = {}
        for s, snaps in sorted(self.candidates(False).items(), reverse=True):
            if s < newest:
                break  # storage has a newer step for every rank
            for snap in snaps:
                res = self._read_local(s, snap, options, on_storage=s in committed)
                if res is not None:
                    verified[s] = res
                    break
        held = {s: snaps[0] for s, snaps in self.candidates(True).items() if s >= newest}
        offer = {"steps": sorted(set(committed) | set(verified)), "own": sorted(verified), "held": sorted(held),
                 "fetch": self.tier is not None}
        offers: list = [None] * coord.size
        coord.run(collective, dist.all_gather_object, offers, offer, group=coord.group).result()
        avail = [set(o["steps"]) | (set(offers[(i + 1) % coord.size]["held"]) if o["fetch"] else set())
                 for i, o in enumerate(offers)]
        common = set.intersection(*avail)
        log.info("rank %d offers steps %s; the ranks agree on %s", coord.rank, offer["steps"][-3:],
                 max(common, default=None))
        # The newest common step first; an older one when some rank cannot get its part of
        # it after all (a neighbour's copy that fails its checksums, say): every rank decides
        # alike, from one vote, so all restore the same step.
        for s in sorted(common, reverse=True):
            fetched = self._fetch_agreed(coord, s, offers, held, committed, options)
            if fetched is None:
                continue
            res, got = fetched
            res = res if res is not None else verified.get(s)
            try:
                if res is not None:
                    state = self._state_of(res, into, options)
                    if s not in committed:
                        self._write_back(s, res)  # every rank: none has it on storage
                    return s, state
                return s, self._load(s, into, options)
            finally:
                if got is not None and os.path.exists(got.header):
                    local.remove(got)  # read (not taken): the write-back has its own snapshot once staged
        return None

    def _fetch_agreed(self, coord: Coordinator, s: int, offers: list, held: dict, committed: list,
                      options: dict) -> tuple[LoadResult | None, local.Snapshot | None] | None:
        """Fetch this rank's part of step s from rank r+1's memory where it needs it, and
        vote on whether every rank now has its part. Returns (what the fetched copy holds,
        verified; the copy) or (None, None) when nothing was fetched; None when some rank
        cannot restore s (every rank gets None alike)."""
        rank, world = coord.rank, coord.size
        needs = [s not in o["own"] and s in offers[(i + 1) % world]["held"] and o["fetch"]
                 for i, o in enumerate(offers)]
        res, snap, ok = None, None, True
        if world > 1 and any(needs):
            prv, nxt = (rank - 1) % world, (rank + 1) % world
            store = self.tier.fetch_store() if self.tier is not None else None
            snap = coord.run(neighbour.swap, coord, prv if needs[prv] else None, held.get(s) if needs[prv] else None,
                             nxt if needs[rank] else None, store, False).result()
            if needs[rank]:
                if snap is not None:
                    log.info("rank %d fetched its snapshot of step %d from rank %d's memory", rank, s, nxt)
                    res = self._read_local(s, snap, options, on_storage=s in committed)
                    if res is None:
                        local.remove(snap)  # refused: it must not be offered again
                        snap = None
                if res is None and s not in committed:
                    log.error("rank %d: step %d is only in memory, and the copy rank %d keeps of it did not arrive "
                              "whole or does not verify (see above); the ranks fall back to an older step",
                              rank, s, nxt)
                    ok = False
        vote = torch.tensor([int(ok)], dtype=torch.int64)
        coord.run(collective, dist.all_reduce, vote, op=dist.ReduceOp.MIN, group=coord.group).result()
        if int(vote[0]):
            return res, snap
        if snap is not None:
            local.remove(snap)
        return None
