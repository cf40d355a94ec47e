"""Multi-rank checkpoints on torch.distributed.

The commit protocol of a multi-rank save (the multi-rank load is
``loading.load.load_rank``). Every rank
stages and writes its own stripes (``model-rank00003-00001-of-00004.safetensors``)
into one shared temporary directory, at the same time. flashwrite's own gloo
group (``coord.py``), never the training group, then carries the coordination,
on one background thread per group so the caller's collectives are never
blocked or interleaved with ours:

1. status rounds: every ``POLL_S`` while writing, each rank contributes
   (failed, still writing) to an all_reduce. A failure anywhere ends the save on
   every rank; when no rank is still writing, all are durable. A rank reports
   "durable" only after passing its future's commit gate, so a ``cancel()`` that
   returns True on any rank makes that rank report a failure: nothing commits.
   Because a rank
   that is still writing keeps answering rounds, the timeout never has to cover
   the write itself, only the silence of a peer.
2. the local manifests are gathered to group rank 0, which merges them, writes
   the index and the manifest last, and renames the directory into place
   (``commit.finalize``); the outcome is broadcast and completes every rank's
   future.

Agreeing on the temporary directory costs no collective per save: when the
group is created, rank 0 broadcasts a random nonce once; the n-th save on that
group uses ``.<name>.flashwrite-tmp-<nonce>-s<n>``, identical on every rank
because every rank saves in the same order (collectives require that anyway).

Failure bound (``timeout``, default ``DEFAULT_TIMEOUT_S``): a rank that raises,
hits ENOSPC or is cancelled fails the next round, so peers fail within
``POLL_S``; a rank that dies closes its gloo connections and its peers fail at
once; a rank that stops responding fails its peers after ``timeout`` seconds
(the gloo group's timeout, which bounds each coordination step). In every case
nothing is committed, the temporary directory is removed, and the previous
checkpoint stays the latest complete one. After a peer is lost the group is
unusable; later saves on it raise at once (restart the job, as torchrun does).

On disk a multi-rank checkpoint is a format-version-1 checkpoint whose tree is
``{rank: state}`` (so ``flashwrite.load(path)`` in one process returns every
rank's state) plus a ``ranks`` section: ``{"world_size": N, "files": [[first,
count], ...]}`` saying which stripes each rank wrote, so ``load(path,
process_group=pg)`` reads only its own.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import commit
from ..tier import neighbour
from ..incremental import link as _incremental
from ..incremental.wiring import Wiring
from ..system.coord import DEFAULT_TIMEOUT_S, Coordinator, PeerLost, collective, coordinator
from ..errors import DistributedSaveError, DivergedReplicasError, FlashwriteError
from ..format import build_index, merge_manifests, parse_manifest
from ..future import SaveFuture, SaveStats
from ..targets.locate import resolve
from ..layout.plan import rank_prefix
from .session import Commit, SaveSession
from ..targets.target import Target
from ..tier.node import LocalSave, LocalTier
from .write import StripeWrite, StripeWriter
from . import replicas as _replicas
from ..system.replicas import replica_layout

log = logging.getLogger("flashwrite")

POLL_S = 0.1  # how often a rank that is still writing answers a status round

__all__ = ["DistributedSaveError", "DEFAULT_TIMEOUT_S", "coordinator", "save_async", "load"]


# --------------------------------------------------------------------------- save


def save_async(writer: StripeWriter, state_dict: Any, path: str | os.PathLike, *, process_group: Any = None,
               coordination_group: Any = None, timeout: float | None = None, overwrite: bool = False,
               block: bool = True, allow_pickle: bool = False, metadata: dict[str, str] | None = None,
               tier: LocalTier | None = None, incremental: Wiring | None = None,
               on_committed: Callable[[str], None] | None = None, replica_group: Any = None,
               rank_local: Any = None, on_divergence: str = "raise") -> SaveFuture:
    """``Writer.save_async`` for one rank of a multi-rank save (see the module doc).

    Every rank of ``process_group`` must call it with the same path, in the same
    order relative to its other flashwrite saves on that group. tier: the writer's
    local tier (each rank keeps its own part as a local snapshot, whose manifest's
    tree is {rank: state}; with neighbour copies, rank r-1's too).
    incremental: the Writer's ``incremental.wiring.Wiring`` (or None): this rank compares its state with its own part of the
    newest committed checkpoint and links its unchanged stripes into the shared temporary
    directory; rank 0's directory fsync before the manifest makes them durable, as it does
    every rank's stripes (where it cannot apply, SaveStats.incremental says why).
    on_committed: called on every rank with the checkpoint's path once rank 0's broadcast
    says it committed (the next incremental save's base on nfs://, where directories are
    not scanned; see ``incremental.BaseCache``).
    replica_group: the process group of ranks whose state equals this rank's (``replicas.py``):
    each replicated byte is written once by the group, the replicas' digests are compared
    before anything is staged. rank_local: key prefixes of leaves that differ per rank by
    design (saved per rank, never compared). on_divergence: "raise" or "warn".
    """
    coord = coordinator(process_group, timeout, coordination_group)
    split = None
    if replica_group is not None:
        local = _replicas.check_options(rank_local, on_divergence)
        if tier is not None:
            raise ValueError("replica_group= with local_snapshots is not supported: each rank would keep only its "
                             "share; save without local snapshots, or without replica_group=")
        layout = replica_layout(coord, replica_group)
        incremental = None  # not yet with replica groups: every stripe is written
    elif rank_local is not None or on_divergence != "raise":
        raise ValueError("rank_local= and on_divergence= apply to saves with replica_group=")
    seq = coord.next_seq()
    t0 = time.perf_counter()
    target, final = resolve(path, "save")
    if replica_group is not None:
        split = functools.partial(_replicas.split, layout, coord.rank, metadata=metadata,
                                  threads=getattr(writer, "copy_threads", 1), rank_local=local,
                                  on_divergence=on_divergence, shown=target.show(final),
                                  global_rank=coord.global_rank)
    strategy = AgreedCommit(coord, final, commit.shared_temp_dir_for(final, coord.nonce, seq), overwrite, target,
                            tier, t0, on_committed)
    session = SaveSession(writer, strategy, tier, t0)
    session.stage({coord.rank: state_dict}, rank=(coord.rank, coord.size), prefix=rank_prefix(coord.rank),
                  allow_pickle=allow_pickle, metadata=metadata, incremental=incremental,
                  **({"replicas": split} if split is not None else {}))
    return session.launch(block)


class AgreedCommit(Commit):
    """The commit strategy of a multi-rank save: status rounds until every rank is durable
    (or one failed), then rank 0 merges the manifests and commits; everyone learns the outcome."""

    def __init__(self, coord: Coordinator, final: str, tmp: str, overwrite: bool, target: Target,
                 tier: LocalTier | None, t0: float, on_committed: Callable[[str], None] | None = None):
        super().__init__(final, target)
        self.coord, self.tmp, self.overwrite, self.tier, self.t0 = coord, tmp, overwrite, tier, t0
        self.on_committed = on_committed
        self.lost: PeerLost | None = None  # the neighbour exchange lost a peer: the rounds fail on it

    def prepare(self) -> str:
        commit.check_target(self.final, self.overwrite, self.target)
        self.target.make_dirs(self.tmp)  # every rank: the name is agreed, so whoever comes first creates it
        return self.tmp

    def abandon(self, error: BaseException) -> None:
        # Tell the peers now instead of letting them wait for the timeout.
        done = self.coord.run(self._report_failure, error)
        if isinstance(error, DivergedReplicasError):
            # The group agreed before launching anything: wait for the agreement, so that the
            # temporary directory is gone (rank 0) when the error reaches the caller.
            done.result()

    def discard(self) -> None:
        pass  # rank 0 removes the directory, once every rank has stopped (see durable)

    def submit(self, run: Callable[[], None]) -> Any:
        return self.coord.run(run)

    def while_writing(self, sw: StripeWrite, snapshot: LocalSave | None) -> None:
        if self.tier is not None and self.tier.neighbours is not None and snapshot is not None:
            try:
                self.tier.exchange(self.coord, snapshot)
            except PeerLost as e:
                self.lost = e

    def _report_failure(self, error: BaseException) -> None:
        """This rank failed before its save was launched: take part in the save's rounds as
        failed (and in its exchange of neighbour copies, with nothing to send)."""
        try:
            if self.tier is not None and self.tier.neighbours is not None:
                neighbour.exchange(self.coord, None, self.tier.neighbours)
            self._rounds(None, error, None)
        except BaseException as e:  # noqa: BLE001 - the caller already has its own error
            if e is not error:
                log.warning("flashwrite: coordination of %s failed: %s", self.final, e)

    def durable(self, sw: StripeWrite, gate: Callable[[], None]) -> dict:
        manifest = self._rounds(sw, self.lost, gate)
        assert manifest is not None  # a rank without its manifest failed in the rounds
        return manifest

    def _rounds(self, sw: StripeWrite | None, error: BaseException | None,
                gate: Callable[[], None] | None) -> dict | None:
        """1. status rounds until someone failed or nobody is still writing; on a failure,
        every rank stops and raises, and rank 0 removes the directory."""
        group, manifest = self.coord.group, None
        try:
            while True:
                if error is None and sw is not None and manifest is None:
                    done = sw.job.done or sw.job.wait(POLL_S)
                    if self.future is not None:
                        self.future.wait_staged(0)  # staged: the caller's tensors are let go of
                    if done:
                        try:
                            manifest = sw.wait_durable()
                            if gate is not None:
                                gate()  # a cancel that won makes this rank fail the round
                        except BaseException as e:  # noqa: BLE001 - reported to every rank below
                            error = e
                failed = error is not None
                status = torch.tensor([int(failed), int(not failed and manifest is None)], dtype=torch.int64)
                collective(dist.all_reduce, status, group=group)
                if status[0] > 0 or status[1] == 0:
                    break
            if status[0] > 0:
                self._fail(sw, error)
        except PeerLost as e:
            raise self._peer_lost(e, sw, error) from (error or e.__cause__)
        return manifest

    def _fail(self, sw: StripeWrite | None, error: BaseException | None) -> None:
        """2a. someone failed (see ``settle_failure``)."""
        settle_failure(self._all_gather, self.coord.rank, sw, error, lambda: commit.discard(self.tmp, self.target),
                       self.final)

    def _all_gather(self, mine: Any) -> list:
        out: list = [None] * self.coord.size
        collective(dist.all_gather_object, out, mine, group=self.coord.group)
        return out

    def commit(self, sw: StripeWrite, manifest: dict) -> SaveStats:
        """2b. everyone is durable: gather manifests, rank 0 commits, everyone learns the outcome."""
        coord, error = self.coord, None
        try:
            manifests = [None] * coord.size if coord.rank == 0 else None
            collective(dist.gather_object, manifest, manifests, dst=coord.global_rank(0), group=coord.group)
            outcome: list = [None]
            if coord.rank == 0:
                try:
                    merged = _incremental.merge_sections(merge_manifests(manifests), manifests)
                    _check_visible(merged, self.tmp, self.target)
                    parse_manifest(json.dumps(merged).encode())  # what a reader will check, before it is visible
                    commit.finalize(self.tmp, self.final, merged, build_index(merged), self.overwrite,
                                    target=self.target)
                    outcome[0] = ("ok", sum(f["size"] for f in merged["files"]))
                except BaseException as e:  # noqa: BLE001 - broadcast, then raised on every rank
                    commit.discard(self.tmp, self.target)
                    outcome[0] = ("error", f"{type(e).__name__}: {e}"[:2000])
                    error = e
            collective(dist.broadcast_object_list, outcome, src=coord.global_rank(0), group=coord.group)
        except PeerLost as e:
            raise self._peer_lost(e, sw, error) from (error or e.__cause__)
        kind, value = outcome[0]
        if kind != "ok":
            if error is not None:
                raise error
            raise DistributedSaveError(f"multi-rank save to {self.final}: the commit on rank 0 failed: {value}",
                                       {0: value})
        # Every rank learns of the commit from this broadcast: no collective of its own
        # tells the ranks their next base.
        if self.on_committed is not None:
            self.on_committed(self.final)
        sw.stats.extra["global_bytes"] = value
        return sw.stats

    def _peer_lost(self, e: PeerLost, sw: StripeWrite | None, error: BaseException | None) -> DistributedSaveError:
        _stop(sw)
        self.coord.lost(e)
        commit.discard(self.tmp, self.target)
        return DistributedSaveError(
            f"multi-rank save to {self.final}: lost contact with a peer (it died, or was silent for longer than the "
            f"timeout of {self.coord.timeout_s} s); nothing was committed. {e}")


def failure_text(error: BaseException | None) -> str | None:
    """What a rank tells the others of its failure (None: it did not fail)."""
    return None if error is None else f"{type(error).__name__}: {error}"[:2000]


def settle_failure(exchange: Callable[[str | None], list], rank: int, sw: StripeWrite | None,
                   error: BaseException | None, discard: Callable[[], None], final: str) -> None:
    """The failure agreement of every multi-rank save, once some rank failed: stop this
    rank's writes, learn who failed and why (``exchange``: every rank's failure text, in
    rank order; also the point after which no rank writes any more), rank 0 removes the
    temporary directory (``discard``), and every rank raises: its own error, with a note
    naming the others, or a ``DistributedSaveError`` naming who failed."""
    _stop(sw)
    texts = exchange(failure_text(error))
    if rank == 0:
        discard()
    failures = {r: t for r, t in enumerate(texts) if t is not None}
    summary = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
    if error is not None:
        if hasattr(error, "add_note"):
            error.add_note(f"flashwrite: multi-rank save to {final} failed ({summary}); nothing was committed")
        raise error
    raise DistributedSaveError(f"multi-rank save to {final} failed on {summary}; nothing was committed", failures)


def _stop(sw: StripeWrite | None) -> None:
    if sw is not None:
        sw.stop()


def _check_visible(merged: dict, tmp: str, target: Target) -> None:
    for f in merged["files"]:
        if not target.exists(os.path.join(tmp, f["name"])):
            raise FlashwriteError(f"stripe {f['name']} is not visible in {tmp} from rank 0: every rank must write to "
                                  "the same shared file system")
