"""One save's life cycle, written once for every save path.

prepare -> stage -> seal the local snapshot -> durable -> commit gate -> commit ->
tell the local tier it committed (or that the save ended). ``SaveSession`` runs
these steps; a save path supplies only its commit strategy (a ``Commit``): where
the stripes go and how the checkpoint becomes visible. A single-process save
renames its own temporary directory into place (``RenameCommit``, here); a
multi-rank save agrees with every rank, then rank 0 commits
(``distributed.AgreedCommit``); the DCP writer commits in DCP's ``finish``
(``dcp/writer.py``). The background part runs through ``SaveFuture.start``
(``future.py``), whose commit gate is where a ``cancel()`` wins or loses.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import commit
from ..format import build_index
from ..future import SaveFuture, SaveStats, clean_up_later, join_cleanups, owe_at_exit, settled, stop_job
from ..targets.target import Target
from ..tier.node import LocalSave, LocalTier
from .write import StripeWrite, StripeWriter

log = logging.getLogger("flashwrite")


class Commit:
    """A save's commit strategy. ``final`` is the checkpoint's path as ``target`` names it."""

    # The exit removes what this save made if it has not ended by then (SaveSession.stage):
    # for strategies whose every session ends in finish() or discard()
    removed_at_exit = False

    def __init__(self, final: str, target: Target):
        self.final, self.target = final, target
        self.future: SaveFuture | None = None  # set by SaveSession.launch

    def prepare(self) -> str:
        """Make the directory the stripes are written into, and return it."""
        raise NotImplementedError

    def abandon(self, error: BaseException) -> None:
        """Staging or the launch failed (``error``): nothing will be committed; the job has
        been stopped and joined. After Ctrl-C the removal runs on a thread of its own
        (joined at exit) so that KeyboardInterrupt lands at once."""
        if isinstance(error, KeyboardInterrupt):
            clean_up_later(self.discard, f"the temporary directory of {self.final}")
        else:
            self.discard()

    def discard(self) -> None:
        """The save failed after its launch: remove what it wrote."""

    def submit(self, run: Callable[[], None]) -> Any:
        """Run the save's background part on the thread that commits."""
        raise NotImplementedError

    def while_writing(self, sw: StripeWrite, snapshot: LocalSave | None) -> None:
        """Work that overlaps the writes, once staged and sealed."""

    def durable(self, sw: StripeWrite, gate: Callable[[], None]) -> dict:
        """Wait until the stripes are durable, pass the commit gate; this write's manifest."""
        sw.job.wait()
        gate()
        return sw.wait_durable()

    def commit(self, sw: StripeWrite, manifest: dict) -> SaveStats:
        """Make the checkpoint visible."""
        raise NotImplementedError

    def end(self) -> None:
        """The save is over, either way."""


class RenameCommit(Commit):
    """A single-process save: its own temporary directory, renamed into place."""

    removed_at_exit = True

    def __init__(self, final: str, target: Target, overwrite: bool, extra: dict[str, bytes],
                 submit: Callable[[Callable[[], None]], Any], on_committed: Callable[[str], None] | None = None):
        super().__init__(final, target)
        self.overwrite, self.extra, self._submit = overwrite, extra, submit
        self.on_committed = on_committed
        self.tmp: str | None = None
        self.encoded: dict[str, bytes] | None = None

    def prepare(self) -> str:
        def named(tmp: str) -> None:
            self.tmp = tmp  # before the mkdir: discard() finds it whenever a Ctrl-C lands
        return commit.prepare(self.final, self.overwrite, self.target, named)

    def discard(self) -> None:
        if self.tmp is not None:
            commit.discard(self.tmp, self.target)
        settled(id(self))

    def submit(self, run: Callable[[], None]) -> Any:
        return self._submit(run)

    def while_writing(self, sw: StripeWrite, snapshot: LocalSave | None) -> None:
        # Manifest, index and their encoding need only the checksums: made while the
        # stripes are still being written and fsync'd.
        early = sw.early_manifest()
        self.encoded = commit.encode_files(early, build_index(early)) if early is not None else None

    def commit(self, sw: StripeWrite, manifest: dict) -> SaveStats:
        assert self.tmp is not None
        commit.finalize(self.tmp, self.final, manifest, build_index(manifest) if self.encoded is None else None,
                        self.overwrite, extra=self.extra, encoded=self.encoded, target=self.target)
        if self.on_committed is not None:
            self.on_committed(self.final)
        return sw.stats


class SaveSession:
    """One save through its life cycle: ``stage()``, then ``launch()`` (or, for a caller
    that drives the steps itself, ``seal()``, ``durable()`` and ``commit()``)."""

    def __init__(self, writer: StripeWriter, strategy: Commit, tier: LocalTier | None, t0: float):
        self.writer, self.strategy, self.tier, self.t0 = writer, strategy, tier, t0
        self.sw: StripeWrite | None = None
        self.snapshot: LocalSave | None = None

    def stage(self, state_dict: Any, *, rank: tuple[int, int] | None = None, **write_options: Any) -> StripeWrite:
        """Prepare the directory and start staging + writing the stripes. rank: (rank, world
        size) of a multi-rank save. A failure here is the strategy's to clean up, then raised.
        incremental (a write option): the save's ``incremental.wiring.Wiring``, or None."""
        wiring = write_options.pop("incremental", None)
        make_planner = wiring.planner(self.strategy.final, self.strategy.target, rank) if wiring is not None else None
        planner = None
        # A save interrupted by Ctrl-C is joined and removed on a thread of its own: the next
        # save waits for that first, so the disk and the pool hold one save's files at a time.
        join_cleanups()
        if self.strategy.removed_at_exit:
            owe_at_exit(id(self.strategy), self._pay_at_exit)  # until the save is over, whatever Ctrl-Cs come
        try:
            directory = self.strategy.prepare()
            if make_planner is not None:
                planner = write_options["incremental"] = make_planner(directory)
            if self.tier is not None:
                self.tier.before_save()  # the slots of finished saves are reused: their headers go first
                write_options["hold_slots"] = True
            sw = self.writer.write_stripes(state_dict, directory, self.t0, remote=self.strategy.target.native_files(),
                                           **write_options)
        except BaseException as e:
            self.strategy.abandon(e)  # after Ctrl-C on a thread: the exit pays if it never ran
            raise
        sw.stats.path = self.strategy.target.show(self.strategy.final)
        if planner is not None:
            sw.stats.incremental = planner.note
        elif wiring is not None:
            sw.stats.incremental = wiring.refused
        if rank is not None:
            sw.stats.extra.update(rank=rank[0], world_size=rank[1])
        self.sw = sw
        if self.tier is not None:
            self.snapshot = self.tier.local_save(sw, self.strategy.final, rank)
        return sw

    def seal(self) -> None:
        """Once staged: write the local snapshot's header (from the caller or the commit
        thread, whichever comes first)."""
        if self.snapshot is not None:
            self.snapshot.seal()

    def wait_staged(self) -> None:
        """Block until every byte is staged, then let go of the caller's tensors."""
        assert self.sw is not None
        self.sw.job.wait_staged()
        self.sw.job.release_sources()

    def durable(self, gate: Callable[[], None] | None = None) -> dict:
        """For a caller that drives the steps itself (DCP): staged, durable, past ``gate``;
        this write's manifest. ``finish`` does the same on a launched save's thread."""
        assert self.sw is not None
        self.wait_staged()
        return self.strategy.durable(self.sw, gate if gate is not None else (lambda: None))

    def _pay_at_exit(self) -> None:
        """At exit, for a save whose removal a Ctrl-C kept from being handed on."""
        if self.sw is not None:
            stop_job(self.sw.job)
        self.strategy.discard()

    def finish(self, gate: Callable[[], None]) -> SaveStats:
        """The background part: seal, overlap, durable, gate, commit, tell the tier."""
        sw = self.sw
        assert sw is not None
        try:
            self.seal()
            self.strategy.while_writing(sw, self.snapshot)
            manifest = self.strategy.durable(sw, gate)
            stats = self.strategy.commit(sw, manifest)
            if self.tier is not None and self.snapshot is not None:
                self.tier.committed(self.snapshot, self.strategy.final)
        finally:
            settled(id(self.strategy))  # committed, or the future's clean-up (this thread, next) removes it
            self.strategy.end()
            if self.snapshot is not None:
                self.snapshot.end()
        stats.total_s = time.perf_counter() - self.t0
        log.debug("saved %s: %.3f GB in %.3f s (stall %.3f s, %s, direct=%s)", self.strategy.final,
                  stats.bytes / 1e9, stats.total_s, stats.stall_s or 0, stats.backend, stats.direct)
        return stats

    def launch(self, block: bool) -> SaveFuture:
        """Hand ``finish`` to the strategy's thread (after staging, if ``block``); the future."""
        sw = self.sw
        assert sw is not None
        fut = SaveFuture(sw.stats.path, sw.job, sw.stats, self.t0)
        self.strategy.future = fut
        fut.start(self.finish, self.strategy.submit, block=block, cleanup=self.strategy.discard,
                  abandon=self.strategy.abandon)
        if self.snapshot is not None and block:
            # Returning "staged" means the snapshot outlives this process from here on.
            self.snapshot.seal()
            fut.stats.stall_s = time.perf_counter() - self.t0
        return fut
