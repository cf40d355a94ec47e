"""Checkpoint manager: periodic saves, retention, crash clean-up, preemption.

A training loop drives it with one call per step::

    mgr = flashwrite.CheckpointManager("ckpt/", every_n_steps=500, keep_last=3)
    restored = mgr.restore()                   # None on a fresh start
    start = restored[0] + 1 if restored else 0
    for step in range(start, steps):
        train_step()
        mgr.maybe_save(step, state_dict)       # returns once the state is staged
    mgr.close()                                # waits until the last save is durable

Layout: one committed checkpoint per step, ``root/step-00001000`` (``name=`` sets the pattern). A checkpoint
directory only ever appears whole (see ``commit``), so listing the directory is
the truth about which checkpoints exist, also across processes and restarts.

The policies (one save in flight, failed saves, retention, clean-up at start-up) are stated
once, in docs/manager.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from ..tier import snapshot as local
from ..future import SaveFuture, SaveStats
from .setup import check_save_options, check_schedule, manager_writer
from .preempt import Preemption
from ..tier.restore import TierRestore
from ..saving.save import Writer
from ..system.sizes import fmt_bytes
from .steps import DEFAULT_NAME, StepDirs

log = logging.getLogger("flashwrite")

StateSource = Any  # a (nested) state dict, or a callable returning one (called only when a save is due)


class _Pending:
    """One save started by the manager; ``done`` is set after logging and retention."""

    def __init__(self, step: int, path: str, future: SaveFuture):
        self.step = step
        self.path = path
        self.future = future
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.error_seen = False


class CheckpointManager:
    """Periodic checkpoints of a training run under ``root``.

    every_n_steps: ``maybe_save`` saves when ``step % every_n_steps == 0``.
    every_n_seconds: ... or when this long has passed since the last save started
    (or since the manager was created). With neither, ``maybe_save`` never saves
    and ``save`` is the way to checkpoint.
    keep_last: keep this many newest checkpoints (None: keep all).
    keep_every_n_steps: also keep every checkpoint whose step is a multiple of this.
    writer: the ``Writer`` to save with (its staging pool is reused); default: one
    owned by the manager and closed by ``close()``.
    if_busy: "wait" or "skip" when a save is due while the previous one is in flight.
    cleanup: remove stale temporary directories at start-up (False for read-only observers).
    handle_sigterm / final_state: see ``install_sigterm_handler``.
    allow_pickle: store (and restore) non-tensor objects by pickling. Only for trusted storage.
    local_snapshots: keep each staged save as a snapshot in node memory (``local_dir``,
    default /dev/shm) that outlives the process: ``restore()`` then takes the newest step
    that verifies from memory or storage, and writes a snapshot that never reached
    storage to root in the background (``wait()`` covers it). See ``flashwrite.tier`` and docs/tiers.md.
    keep_local: ``close()`` keeps the newest snapshot in local_dir (for a restart).
    reserve: a state dict (or a size in bytes) to size the staging pool for now, in the
    background, so the first save stalls no longer than later ones (``Writer.reserve``).
    Without it the manager does the same from the first state it sees: the one
    ``restore()`` returns, or one passed to ``maybe_save`` at a step that is not due
    (``SaveStats.pool_wait_s`` says how long a save still waited for the pool).
    process_group: every rank of the group runs a manager on the same root; each save is
    one multi-rank checkpoint (``save_async(process_group=)``), each rank keeps its own
    local snapshot, and ``restore()`` agrees across ranks on the newest step that every
    rank can restore, from memory or storage (never mixing steps). Rank 0 cleans up and
    applies retention in root.
    replica_group: the ranks whose state equals this rank's (DDP: the world; implies
    process_group): each save writes every replicated byte once and checks the replicas
    agree, each restore from storage reads it once (``save_async(replica_group=)``);
    rank_local: key prefixes of per-rank leaves (RNG states), saved per rank.
    on_divergence: ``"raise"`` (default: a save whose replicas disagree fails on every rank,
    nothing committed, the previous checkpoint stays the newest) or ``"warn"`` (the
    majority's bytes are committed and the disagreement recorded: ``SaveStats.diverged``).
    neighbour_copies: with process_group and local_snapshots, each rank also keeps a copy
    of rank r-1's snapshot, so ``restore()`` finds a lost node's part in its neighbour's
    memory (``tier/neighbour.py``). Every rank must set it alike.
    name: the checkpoint directory name of a step, a format string with one ``{step}``
    field (default ``"step-{step:08d}"``; ``"checkpoint-{step}"`` is the Hugging Face
    Trainer's). Listing, retention, restore and the local tier all go by it; other names
    in root are not checkpoints to this manager.
    incremental: hard-link the stripes that did not change since the previous checkpoint
    instead of writing them (``flashwrite.incremental``); every checkpoint stays whole on
    its own, so retention may delete any of them. Default: on (with process_group, each
    rank links from its own part of the previous checkpoint; with local snapshots, every
    stripe is staged for the snapshot and the unchanged ones are linked on storage instead
    of written; where it cannot apply, saves write every stripe and
    ``SaveStats.incremental`` says why).
    on_commit: ``on_commit(step, path)`` runs on the commit thread after each save has
    committed (and retention has run), before ``wait()`` returns; an error it raises is
    logged (the checkpoint itself is committed).
    """

    def __init__(self, root: str | os.PathLike, every_n_steps: int | None = None, every_n_seconds: float | None = None,
                 keep_last: int | None = None, keep_every_n_steps: int | None = None, writer: Writer | None = None, *,
                 if_busy: str = "wait", cleanup: bool = True, handle_sigterm: bool = False,
                 final_state: Callable[[], tuple[int, Any]] | None = None, allow_pickle: bool = False,
                 local_snapshots: bool = False, local_dir: str | os.PathLike | None = None, keep_local: bool = False,
                 reserve: Any = None, process_group: Any = None, neighbour_copies: bool = False,
                 name: str = DEFAULT_NAME, on_commit: Callable[[int, str], None] | None = None,
                 incremental: bool | None = None, replica_group: Any = None, rank_local: Any = None,
                 on_divergence: str = "raise"):
        check_schedule(every_n_steps, every_n_seconds, keep_last, keep_every_n_steps, if_busy)
        self.on_commit = on_commit
        self.name = name
        self._steps = StepDirs(root, name)
        self.root = self._steps.root
        self._owns_writer = writer is None
        self._writer = manager_writer(self.root, self._steps.local, writer, local_snapshots, local_dir,
                                      neighbour_copies)
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.keep_last = keep_last
        self.keep_every_n_steps = keep_every_n_steps
        self.if_busy = if_busy
        self.allow_pickle = allow_pickle
        self._tier = self._writer.local_tier
        self.keep_local = keep_local
        self.incremental = True if incremental is None else bool(incremental)
        self.local_dir = self._tier.dir if self._tier is not None else None
        if replica_group is not None and process_group is None:
            process_group = dist.group.WORLD
        self.process_group = process_group
        # replica_group: saves write each replicated byte once, restores read it once (flashwrite.save_async)
        self.replica_group, self.rank_local = replica_group, rank_local
        if on_divergence not in ("raise", "warn"):
            raise ValueError(f"on_divergence must be 'raise' or 'warn', not {on_divergence!r}")
        self.on_divergence = on_divergence
        self._rank: tuple[int, int] | None = None  # (rank, size) in a multi-rank run
        if process_group is not None:
            self._rank = (dist.get_rank(process_group), dist.get_world_size(process_group))
        self._lock = threading.Lock()
        self._inflight: _Pending | None = None
        self._last_start = time.monotonic()
        self._closed = False
        self._sigterm = Preemption(self._drain)
        self._final_state = final_state
        self._restorer = TierRestore(tier=self._tier, rank=self._rank, process_group=process_group,
                                     allow_pickle=allow_pickle, steps=self.all_steps, path_for=self.path_for,
                                     candidates=lambda replicas: self.find_local_snapshots(replicas=replicas),
                                     write_back=self._write_back)
        self._restorer.replica_group = replica_group
        self._steps.target.make_dirs(self._steps.dir)
        if cleanup:
            self.cleanup_stale()
        self._pool_prepared = reserve is not None
        if reserve is not None:
            self._writer.reserve(reserve)
        if handle_sigterm:
            self.install_sigterm_handler(final_state)

    # ----------------------------------------------------------------- naming

    def path_for(self, step: int) -> str:
        """The checkpoint of ``step``, as save and load take it (a URL for nfs://)."""
        return self._steps.path_for(step)

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints under root, ascending. A directory
        counts only under its exact name and with its manifest in place."""
        return self._steps.all_steps()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ----------------------------------------------------------------- saving

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, not {step!r}")
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

    def is_due(self, step: int) -> bool:
        """Whether ``maybe_save(step, ...)`` would start a save (ignoring a busy writer)."""
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            return True
        return self.every_n_seconds is not None and time.monotonic() - self._last_start >= self.every_n_seconds

    def maybe_save(self, step: int, state_dict: StateSource, **save_options: Any) -> SaveFuture | None:
        """Save if a checkpoint is due at ``step``; returns its future (already staged)
        or None. ``state_dict`` may be a callable that builds it, called only when due.
        A step that already has a checkpoint is not saved again. save_options: hf_model,
        hf_config and extra_files of ``Writer.save_async``."""
        self._check_step(step)
        check_save_options(save_options)
        if not self.is_due(step):
            if not callable(state_dict):
                self._prepare_pool(state_dict)
            return None
        with self._sigterm.call():
            p = self._inflight
            if (p is not None and p.step == step and not p.done.is_set()) or self._steps.exists(step):
                log.warning("checkpoint for step %d already exists in %s; not saving it again", step, self.root)
                return None
            return self._start(step, state_dict, overwrite=False, policy=self.if_busy, save_options=save_options)

    def save(self, step: int, state_dict: StateSource, *, overwrite: bool = False, **save_options: Any) -> SaveFuture:
        """The same as ``save_async``: returns once staged, NOT once durable (unlike
        ``flashwrite.save`` and ``Writer.save``). Call ``.result()`` on the future, or
        ``wait()``, to block until the checkpoint is committed. Kept under this name
        because a training loop that checkpoints must not stall on the disk."""
        return self.save_async(step, state_dict, overwrite=overwrite, **save_options)

    def save_async(self, step: int, state_dict: StateSource, *, overwrite: bool = False,
                   **save_options: Any) -> SaveFuture:
        """Save now (after the save in flight, if any, is durable). Returns the save's
        future once staged, as ``flashwrite.save_async`` does. save_options: as for
        ``maybe_save``."""
        self._check_step(step)
        check_save_options(save_options)
        with self._sigterm.call():
            fut = self._start(step, state_dict, overwrite=overwrite, policy="wait", save_options=save_options)
            assert fut is not None
            return fut

    def _start(self, step: int, state_dict: StateSource, *, overwrite: bool, policy: str,
               save_options: dict | None = None) -> SaveFuture | None:
        prev = self._inflight
        if prev is not None and not prev.done.is_set():
            if policy == "skip":
                log.info("skipping the checkpoint at step %d: step %d is still being written", step, prev.step)
                return None
            t0 = time.perf_counter()
            prev.done.wait()
            log.debug("step %d waited %.3f s for the checkpoint of step %d", step, time.perf_counter() - t0, prev.step)
        if callable(state_dict):
            state_dict = state_dict()
        path = self.path_for(step)
        self._last_start = time.monotonic()
        fut = self._writer.save_async(state_dict, path, overwrite=overwrite, allow_pickle=self.allow_pickle,
                                      metadata={"step": str(step)}, process_group=self.process_group,
                                      incremental=self.incremental, **self._replica_options(), **(save_options or {}))
        pending = _Pending(step, path, fut)
        with self._lock:
            self._inflight = pending
        fut.add_done_callback(lambda _f: self._finished(pending))
        return fut

    def _replica_options(self) -> dict:
        if self.replica_group is None:
            return {}
        return {"replica_group": self.replica_group, "rank_local": self.rank_local,
                "on_divergence": self.on_divergence}

    def _prepare_pool(self, state: Any) -> None:
        """Prepare the writer's staging pool in the background from the first state seen
        (see ``Writer.prepare``); a state that cannot be planned is left to its save."""
        if self._pool_prepared:
            return
        self._pool_prepared = True
        try:
            self._writer.prepare(state, self.root)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            log.debug("not preparing the staging pool: %s", e)

    def _finished(self, p: _Pending) -> None:
        """Runs once per save, on the writer's commit thread: log, then retention."""
        try:
            exc = p.future.exception()
            if exc is not None:
                p.error = exc
                log.error("checkpoint step %d failed, nothing was committed (%s: %s)", p.step, type(exc).__name__, exc)
                return
            st = p.future.result()
            log.info("checkpoint step %d committed: %s, %s, stall %.3f s, durable after %.3f s, %.3g GB/s", p.step,
                     p.path, fmt_bytes(st.bytes), st.stall_s or 0.0, st.total_s or 0.0, st.gbps or 0.0)
            self._retain(p.step)
            if self.on_commit is not None:
                self.on_commit(p.step, p.path)
            if self.local_dir is not None:
                self._clean_local(lambda s: s <= p.step)
        except Exception:
            log.exception("checkpoint step %d: retention or on_commit failed (the checkpoint itself is committed)", p.step)
        finally:
            p.done.set()

    def in_flight(self) -> tuple[int, str, SaveFuture] | None:
        """The save started and not yet finished, as ``(step, path, future)``: not yet
        committed (or failed), or its retention and ``on_commit`` still running (inside
        ``on_commit`` it is the save being reported). None when there is none."""
        p = self._inflight
        return None if p is None or p.done.is_set() else (p.step, p.path, p.future)

    def wait(self) -> SaveStats | None:
        """Block until the save in flight is durable and committed (and retention
        has run). Returns its stats; if it failed, raises its error (the first
        wait after the failure does; later ones return None)."""
        with self._sigterm.call():
            p = self._inflight
            if p is None:
                return None
            p.done.wait()
            if p.error is not None:
                if not p.error_seen:
                    p.error_seen = True
                    raise p.error
                return None
            return p.future.result()

    # -------------------------------------------------------------- retention

    def _retain(self, committed: int) -> None:
        if self.keep_last is None or (self._rank is not None and self._rank[0] != 0):
            return
        steps = self.all_steps()
        if not steps:
            return
        keep = set(steps[-self.keep_last:])
        if self.keep_every_n_steps is not None:
            keep.update(s for s in steps if s % self.keep_every_n_steps == 0)
        keep.update((steps[-1], committed))
        keep.update(self._restorer.restoring())
        for s in steps:
            if s not in keep:
                self._steps.delete(s)

    def cleanup_stale(self) -> list[str]:
        """Remove temporary directories left in root by crashed saves and deletions
        (and put back a checkpoint whose replacement never appeared), and local
        snapshots of this root whose owner died that are older than its newest
        committed step. Returns the names it removed or restored. Called by the
        constructor."""
        touched = self._steps.clean_stale() if self._rank is None or self._rank[0] == 0 else []
        if self.local_dir is not None:
            latest = self.latest_step()
            if latest is not None:
                touched += self._clean_local(lambda s: s < latest)
            self._tier.remove_orphan_pools()
        return touched

    def find_local_snapshots(self, replicas: bool = False) -> dict[int, list[local.Snapshot]]:
        """Local snapshots of this root's steps (any owner), newest first per step.
        replicas: the copies this rank holds of rank r-1's snapshots instead
        (``neighbour_copies``)."""
        if self._tier is None:
            return {}
        return self._tier.candidates(self._steps.step_of, self._rank, replicas)

    def _clean_local(self, doomed: Callable[[int], bool]) -> list[str]:
        """Dead owners' snapshots of the steps ``doomed`` picks go (callers pick only steps
        older than, or equal to, a committed one)."""
        return self._tier.remove_dead(self._steps.step_of, self._rank, doomed) if self._tier is not None else []

    # ---------------------------------------------------------------- restore

    def restore(self, step: int | None = None, into: Any = None, *, fallback: bool = True,
                **load_options: Any) -> tuple[int, Any] | None:
        """Load a checkpoint: ``(step, state)``, or None when there is none.

        step=None takes the newest; if it is damaged (CorruptCheckpointError) and
        ``fallback`` is true, the error is logged and the next older one is tried.
        into: fill an existing state dict in place (see ``flashwrite.load``); it is
        left untouched by a damaged checkpoint, whose bytes are checked first.
        load_options go to ``flashwrite.load`` (map_location, verify, ...).

        From a local snapshot of a step that storage also holds, the restore takes the
        snapshot (``local.read_snapshot(take=True)``): tensors of 1 MiB or more become its
        shared-memory pages and the snapshot leaves the local tier, so nothing is copied
        and no fresh memory is faulted in. A snapshot that is the only copy of its step is
        copied into fresh memory (and written back to storage). ``zero_copy=True`` maps
        such a snapshot copy-on-write instead of copying it (its shared memory stays held
        while the tensors live; pages written later are copied then); ``zero_copy=False``
        copies every snapshot into fresh memory, resizable like ``torch.load``'s. From
        storage, ``zero_copy=True`` means views of read buffers.

        The state restored is the first one the manager sees: unless ``reserve=`` was
        given, the writer's staging pool is prepared from it in the background.
        """
        if step is not None and self.process_group is None:
            self._check_step(step)
        with self._sigterm.call():
            got = self._restorer.restore(step, into, fallback, load_options)
        if got is not None:
            self._prepare_pool(got[1])
        return got

    def _write_back(self, step: int, make_state: Callable[[], Any]) -> None:
        """Save a step that only a local snapshot holds to root; returns once staged
        (the caller may then change what it was given), commits in the background."""
        p = self._inflight
        if p is not None and p.step == step and not p.done.is_set():
            return  # this manager's own save of it is being committed
        if step in self.all_steps():
            return  # committed since restore() looked (this manager's own save, just finished)
        log.warning("step %d was never committed to %s: writing it from its local snapshot", step, self.root)
        self._start(step, make_state, overwrite=False, policy="wait")

    def restore_latest(self, into: Any = None, **load_options: Any) -> tuple[int, Any] | None:
        return self.restore(None, into, **load_options)

    # ------------------------------------------------------------- preemption

    def install_sigterm_handler(self, final_state: Callable[[], tuple[int, Any]] | None = None) -> None:
        """On SIGTERM: finish the save in flight, then, if ``final_state`` is given,
        save ``final_state() -> (step, state_dict)`` (unless that step is already
        saved), then hand the signal to the handler that was installed before
        (the default one terminates the process). Main thread only.

        The handler runs between bytecodes of the main thread, so ``final_state``
        must return a consistent state from wherever the loop was interrupted
        (e.g. the state as of the last completed step). A signal that arrives
        while the main thread is inside a manager call is handled when that call
        returns.
        """
        if final_state is not None:
            self._final_state = final_state
        self._sigterm.install(self._on_sigterm)

    def uninstall_sigterm_handler(self) -> None:
        self._sigterm.uninstall(self._on_sigterm)

    @property
    def preempted(self) -> bool:
        """Whether a SIGTERM reached this manager."""
        return self._sigterm.preempted

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm.on_signal(signum, frame)

    def _drain(self) -> None:
        """On SIGTERM: complete the save in flight, then save the final state, if any."""
        log.warning("SIGTERM: completing the checkpoint in flight%s", " and saving a final one"
                    if self._final_state else "")
        try:
            self.wait()
        except Exception as e:
            log.error("the checkpoint in flight failed: %s", e)
        if self._final_state is not None and not self._closed:
            try:
                step, state = self._final_state()
                if step in self.all_steps():
                    log.info("final checkpoint: step %d is already saved", step)
                else:
                    self.save(step, state)
                    self.wait()
            except Exception:
                log.exception("final checkpoint on SIGTERM failed")

    # --------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Wait for the save in flight (raising its error if unseen), restore the
        previous SIGTERM handler, and close the writer if the manager owns it."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if threading.current_thread() is threading.main_thread():
                self.uninstall_sigterm_handler()
            if self._owns_writer:
                self._writer.close(keep_local=self.keep_local)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # do not hide the exception already on its way
            log.error("closing the checkpoint manager: %s", e)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.root!r}, every_n_steps={self.every_n_steps}, "
                f"every_n_seconds={self.every_n_seconds}, keep_last={self.keep_last}, "
                f"keep_every_n_steps={self.keep_every_n_steps}, if_busy={self.if_busy!r})")

