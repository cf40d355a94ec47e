"""Work in flight: the futures that ``save_async`` and ``load_async`` return.

Both are ``CheckpointFuture``s, which are ``concurrent.futures.Future``s (so
``concurrent.futures.wait`` and ``as_completed`` take them) with the same extras:
``path``, ``wait(timeout)`` (True once done, never raises the work's error) and
``stats`` (``SaveStats`` or ``LoadStats``). A save's future tracks it from staging to
commit (``SaveFuture``); a load's, from its queue to the returned state (``LoadFuture``).

Every save, on one rank or many, is launched the same way (``SaveFuture.start``):
wait for staging if asked, then run the save's ``finish`` on a background thread,
which waits until the stripes are durable, passes the commit gate, and commits.
The gate is the one place where a cancel either wins (nothing is committed) or
loses for good, so ``cancel()`` means the same thing for every kind of save.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its executors' join at exit before ours: ours runs first
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .system.sigint import ignoring_sigint, sigint_deferred, wait_until


# concurrent.futures.Future's states in which done() is True (stable names since Python 3.2).
_ENDED = ("CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED")


class CheckpointFuture(concurrent.futures.Future):
    """What every flashwrite future has: ``result``, ``exception``, ``done``,
    ``add_done_callback`` and ``cancel`` as ``concurrent.futures.Future`` has them, plus
    ``path`` (the checkpoint), ``wait`` and ``stats``."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the work has ended, well or not; True when it has, False when
        ``timeout`` ran out first. Its outcome is for ``result()`` to raise. The caller
        waits holding no lock (``system.sigint.wait_until``): a Ctrl-C in
        ``concurrent.futures``' own wait could leave the future's Condition held, and the
        thread completing the future then blocked on it for ever (issue 44 item 1)."""
        return wait_until(lambda: self._state in _ENDED, timeout)  # a plain read of the state that done() reads

    def result(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        return super().result(timeout=0)  # ended: returns or raises at once (TimeoutError if not)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.wait(timeout)
        return super().exception(timeout=0)

    @property
    def stats(self) -> Any:
        raise NotImplementedError


@dataclass
class LoadStats:
    """Figures of one ``load_async``. Times are seconds from the load_async call."""

    path: str
    queued_s: float | None = None   # waited for a free loader thread
    total_s: float | None = None    # the state returned
    tensors: int = 0                # tensors in the returned state
    bytes: int = 0                  # their bytes

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.total_s / 1e9 if self.total_s else None


class LoadFuture(CheckpointFuture):
    """A ``load_async`` in progress. ``result()`` returns what ``load`` returns, or raises
    what it raised. ``cancel()`` succeeds only while the load is still queued."""

    def __init__(self, path: str):
        super().__init__(path)
        self._stats = LoadStats(path)
        self._t0 = time.perf_counter()

    def _run(self, load: Callable[[], Any]) -> None:
        """Run ``load`` on this (loader) thread and complete the future with its outcome."""
        if not self.set_running_or_notify_cancel():
            return
        self._stats.queued_s = time.perf_counter() - self._t0
        try:
            state = load()
        except BaseException as e:
            self.set_exception(e)
            return
        self._stats.tensors, self._stats.bytes = _count_tensors(state)
        self._stats.total_s = time.perf_counter() - self._t0
        self.set_result(state)

    @property
    def stats(self) -> LoadStats:
        return self._stats

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "failed" if self.done() and self.exception() else \
            "loaded" if self.done() else "loading" if self.running() else "queued"
        return f"<LoadFuture {self.path!r} {state}>"


def launch_load(path: str, load: Callable[[], Any], submit: Callable[[Callable[[], None]], Any]) -> LoadFuture:
    """A ``LoadFuture`` for ``load()``, which ``submit`` runs on a loader thread."""
    fut = LoadFuture(path)
    sigint_deferred(lambda: submit(lambda: fut._run(load)))  # may start the pool's thread: see system.sigint
    return fut


def _count_tensors(obj: Any) -> tuple[int, int]:
    """(tensors, bytes) in a nested state as load returns it."""
    n = nbytes = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            n, nbytes = n + 1, nbytes + o.nelement() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return n, nbytes


@dataclass
class SaveStats:
    """Figures of one save. Times are seconds from the save_async call."""

    path: str
    bytes: int = 0
    tensors: int = 0
    stripes: int = 0
    stall_s: float | None = None    # how long save_async blocked the caller
    staged_s: float | None = None   # every byte in the staging pool
    durable_s: float | None = None  # every stripe written and fsync'd
    total_s: float | None = None    # committed (manifest written, renamed, parent fsync'd)
    backend: str = ""
    direct: bool = False            # every stripe written with O_DIRECT
    files_buffered: int = 0         # stripes that fell back to buffered I/O + fsync
    pool_bytes: int = 0
    # Of stall_s, how long the save waited for the staging pool to hold its slots: a
    # preparation still under way (Writer.reserve, or one the CheckpointManager started
    # from the first state it saw), or memory this save allocated and faulted in itself.
    # ~0 once the pool is ready, as for every save after the first.
    pool_wait_s: float = 0.0
    pinned: bool = False
    pin_s: float = 0.0              # page-locking the staging pool for this save (GPU saves; 0 once pinned)
    # How long this save waited for staging memory, on the caller's thread or on the save's
    # own threads (a GPU save grows and pins its pool there, in slabs of at most
    # FLASHWRITE_PIN_SLAB_BYTES, its copies starting into the slabs already pinned), and why:
    # "fault-in" (a new slab being faulted in), "pin" (a slab being page-locked), "pool busy"
    # (every slot in use, by this save's writes or another save's); "" when it never waited.
    staging_wait_s: float = 0.0
    staging_wait_reason: str = ""
    unpinned_bytes: int = 0         # of the pool, left pageable because their registration failed
    settings: dict = field(default_factory=dict)  # stripes/queue_depth/chunk_bytes used, and where each came from
    # Incremental saves (incremental=True): bytes is the checkpoint's size, bytes_written what
    # this save wrote, bytes_linked what it hard-linked from the earlier checkpoint;
    # link_fallbacks counts stripes written because the file system refused a link;
    # compared_bytes what was hashed from the source to compare; watched_bytes what was
    # compared without hashing, because the kernel saw no write to it since a save hashed
    # it (write_watch.py); rechecked_bytes what the watch vouched for but was hashed again
    # all the same (each piece at least every FLASHWRITE_WATCH_RECHECK_EVERY saves, default
    # 16), watch_misses how many tensors that re-hash found changed, a write the watch missed
    # (written, not linked, with a warning naming them). incremental: "" when not asked,
    # else "on", "on: no earlier checkpoint to link from", or "off: <why>".
    bytes_written: int = 0
    bytes_linked: int = 0
    stripes_linked: int = 0
    link_fallbacks: int = 0
    compared_bytes: int = 0
    watched_bytes: int = 0
    rechecked_bytes: int = 0
    watch_misses: int = 0
    incremental: str = ""
    # Multi-rank saves with replica_group= and on_divergence="warn": the pieces on which the
    # replicas disagreed (tensor, byte range, digests by rank, majority), also in the manifest.
    diverged: list = field(default_factory=list)
    # Compressed saves (Writer(compress=)): compress says "off", "on" or "auto: on|off
    # (why)"; bytes_stored is what was sent to the files (frames padded to 4 KiB and the
    # chunks written plain), compress_s the copy threads' seconds compressing.
    compress: str = "off"
    bytes_stored: int = 0
    compress_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.total_s / 1e9 if self.total_s else None


def stop_job(job: Any) -> None:
    """Stop a native job and join it: cancel what it has not done yet, then wait until it
    has ended (its requests in flight landed, its files closed). Every path that removes,
    frees or reuses what a job writes into or reads from calls this first."""
    if not job.done:
        job.cancel()
    job.wait()


# finish(commit_gate) -> SaveStats: runs on the save's background thread; it calls
# commit_gate() once every stripe is durable and before anything becomes visible.
Finish = Callable[[Callable[[], None]], SaveStats]


class SaveFuture(CheckpointFuture):
    """A save in progress. ``result()`` returns its SaveStats once the checkpoint is
    durable and committed, or raises what went wrong (the temporary directory is
    then already removed and no earlier checkpoint was touched)."""

    def __init__(self, path: str, job: Any, stats: SaveStats, t0: float):
        super().__init__(path)
        self._job = job  # the native save job (staging + writing this rank's stripes)
        self._stats = stats
        self._t0 = t0
        self._released = False
        self._state_lock = threading.Lock()
        self._cancelled = False
        self._committing = False
        _IN_FLIGHT.add(self)

    def start(self, finish: Finish, submit: Callable[[Callable[[], None]], Any], *, block: bool,
              cleanup: Callable[[], None], abandon: Callable[[BaseException], None] | None = None) -> SaveFuture:
        """Start the save's background part (called once, by the save session that made
        this future, as an executor calls ``set_result``): wait for staging if ``block``,
        then hand ``finish`` to ``submit`` (the thread that commits). Its result, or its
        exception after ``cleanup()``, completes this future. If the start itself fails, the
        job is stopped and ``abandon(error)`` (default: ``cleanup()``) runs before it raises."""

        def run() -> None:
            try:
                result = finish(self._commit_gate)
            except BaseException as e:
                # finish can fail before the job has ended (its checksums report the error
                # first): stop it, so that none of its writes recreates or holds open what
                # cleanup() removes.
                stop_job(self._job)
                cleanup()
                self.set_exception(e)
                return
            self.set_result(result)

        job = self._job
        # Until the start has handed the save on (or its clean-up thread has run), the exit
        # owes it a clean-up: a second Ctrl-C can land anywhere in the except clause below,
        # before that thread is started.
        _UNFINISHED_STARTS[id(self)] = (self, lambda: (stop_job(job), cleanup()))
        try:
            if block:
                self.wait_staged()
            self.set_running_or_notify_cancel()
            # Raises if the thread that commits was shut down meanwhile. Its first call
            # starts that thread, which a Ctrl-C must not cut short (system.sigint).
            sigint_deferred(lambda: submit(run))
            _UNFINISHED_STARTS.pop(id(self), None)
        except BaseException as e:
            undo = abandon if abandon is not None else (lambda _e: cleanup())
            if not self.done():
                self.set_exception(e)  # nobody waits for it, and the exit has nothing to wait for
            if isinstance(e, KeyboardInterrupt):
                # Ctrl-C lands now: the interrupted wait has cancelled the job, which keeps
                # its sources alive until it is joined; a thread of its own joins it and
                # then removes what it wrote (the interpreter's exit waits for that thread).
                key = id(self)
                clean_up_later(lambda err=e: (stop_job(job), undo(err), _UNFINISHED_STARTS.pop(key, None)),
                               f"the save to {self.path}")  # e is unbound after except
                raise
            stop_job(job)
            undo(e)
            _UNFINISHED_STARTS.pop(id(self), None)
            raise
        self._stats.stall_s = time.perf_counter() - self._t0
        return self

    def _commit_gate(self) -> None:
        """Called by ``finish`` once the stripes are durable: raises CancelledError if
        cancel() came first; from its return on, cancel() can no longer stop the save."""
        self._release_sources()
        with self._state_lock:
            self._committing = not self._cancelled
        if not self._committing:
            raise concurrent.futures.CancelledError(f"save to {self.path} was cancelled")

    def _release_sources(self) -> None:
        if not self._released and self._job.staged:
            self._job.release_sources()
            self._released = True
            if self._stats.staged_s is None:
                self._stats.staged_s = time.perf_counter() - self._t0

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block (GIL released) until the snapshot is in host memory; after that the
        caller may change or free its tensors. True when staged."""
        ok = self._job.wait_staged(timeout)
        if ok:
            self._release_sources()
        return ok

    @property
    def staged(self) -> bool:
        return self._job.staged

    def progress(self) -> float:
        """Fraction of the bytes written so far (1.0 once durable)."""
        written, total = self._job.progress()
        return written / total if total else 1.0

    @property
    def stats(self) -> SaveStats:
        return self._stats

    def cancel(self) -> bool:
        """Abandon the save: nothing is committed and ``result()`` raises
        ``concurrent.futures.CancelledError`` (in a multi-rank save, the other ranks'
        futures raise ``DistributedSaveError``). Returns False (and changes nothing)
        once the commit has begun or the save has finished."""
        with self._state_lock:
            if self._committing or self.done():
                return False
            self._cancelled = True
        self._job.cancel()
        return True

    def __repr__(self) -> str:
        state = "committed" if self.done() and not self.exception() else \
            "failed" if self.done() else "staged" if self.staged else "staging"
        return f"<SaveFuture {self.path!r} {state} {self.progress():.0%}>"


# ------------------------------------------------------------ saves in flight at exit

# Every SaveFuture made in this process; the thread that commits one holds it until it
# is done, so the set holds at least every save still in flight.
_IN_FLIGHT: weakref.WeakSet[SaveFuture] = weakref.WeakSet()


# Removals of abandoned temporary directories, run off the raising path so that a
# Ctrl-C lands at once (removing a GiB save's preallocated files takes ~0.1 s); the exit
# drain joins them, so nothing is left once the process has exited normally (and a
# process killed meanwhile leaves a directory the next save's clean_dead_saves removes).
_CLEANUPS: list[threading.Thread] = []
_CLEANUPS_LOCK = threading.Lock()
# Saves whose start was interrupted before it handed them on, with their clean-up
# (stop the job, remove the temporary directory): the exit runs what is still here once
# the clean-up threads have ended, and completes their futures (nothing else will).
_UNFINISHED_STARTS: dict[int, tuple[SaveFuture, Callable[[], None]]] = {}
# What a save in this process still owes its storage (its temporary directory removed,
# unless it commits), from before the directory is made until the save is over: the
# exit pays what is left once every save in flight has ended (a Ctrl-C can land in the
# code that was to hand the removal to a thread).
_EXIT_DEBTS: dict[int, Callable[[], None]] = {}


def owe_at_exit(key: int, pay: Callable[[], None]) -> None:
    _EXIT_DEBTS[key] = pay


def settled(key: int) -> None:
    _EXIT_DEBTS.pop(key, None)


def _pay_exit_debts() -> None:
    for key, pay in list(_EXIT_DEBTS.items()):
        try:
            pay()
        except Exception as e:  # noqa: BLE001 - logged; clean_dead_saves is the backstop
            import logging
            logging.getLogger("flashwrite").warning("flashwrite: cannot clean up at exit: %s", e)
        _EXIT_DEBTS.pop(key, None)


def clean_up_later(cleanup: Callable[[], None], what: str) -> None:
    """Run ``cleanup()`` on a thread of its own; a failure is logged, never raised."""

    def run() -> None:
        try:
            cleanup()
        except Exception as e:  # noqa: BLE001 - nobody waits for it; clean_dead_saves is the backstop
            import logging
            logging.getLogger("flashwrite").warning("flashwrite: cannot clean up %s: %s", what, e)

    t = threading.Thread(target=run, name="flashwrite-cleanup", daemon=False)
    with _CLEANUPS_LOCK:
        _CLEANUPS[:] = [c for c in _CLEANUPS if c.is_alive()]
        _CLEANUPS.append(t)
    sigint_deferred(t.start)


def reap_later(job: Any) -> None:
    """Join a cancelled native job on a thread of its own (``clean_up_later``), holding
    it, and what it keeps alive, until it has ended: for a caller that must not wait for
    the requests it still has in flight (an interrupted load)."""
    clean_up_later(lambda: job.wait(), "a cancelled job")


def join_cleanups() -> None:
    """Wait for every clean_up_later still running, also those that one of them started
    (an interrupted save's thread joins its job, then hands the removal to another)."""
    while True:
        with _CLEANUPS_LOCK:
            todo = [t for t in _CLEANUPS if t.is_alive()]
        if not todo:
            return
        for t in todo:
            t.join()


def _drain_at_exit() -> None:
    """At interpreter exit, before the commit threads are joined: say what the exit waits
    for, once, on stderr, and wait. A Ctrl-C then abandons those saves cleanly (each
    cancelled at its commit gate, its temporary directory removed, nothing committed
    that had not begun to commit) and exits with status 130. Every join after that
    point, and the clean-up threads' join on every exit, ignores further Ctrl-Cs
    (``system.sigint.ignoring_sigint``): an interrupted join let the interpreter finalise under a
    native thread still at work (``terminate called without an active exception``) or
    end before a temporary directory was removed."""
    ignoring_sigint(_finish_interrupted_starts, keep=False)
    live = [f for f in list(_IN_FLIGHT) if not f.done()]
    if live:
        names = ", ".join(f.path for f in live[:3]) + (f" and {len(live) - 3} more" if len(live) > 3 else "")
        what = "a checkpoint save" if len(live) == 1 else f"{len(live)} checkpoint saves"
        try:
            print(f"flashwrite: exit waits for {what} in flight to commit: {names} (Ctrl-C abandons it)",
                  file=sys.stderr, flush=True)
            for f in live:
                f.wait()
        except KeyboardInterrupt:
            ignoring_sigint(lambda: _abandon(live))
    ignoring_sigint(lambda: (join_cleanups(), _pay_exit_debts()))


def _finish_interrupted_starts() -> None:
    """The saves a Ctrl-C stopped in their start before a clean-up thread took them: their
    jobs stopped and temporary directories removed here, their futures failed."""
    join_cleanups()
    for key, (fut, clean) in list(_UNFINISHED_STARTS.items()):
        clean()
        _UNFINISHED_STARTS.pop(key, None)
        if not fut.done():
            fut.set_exception(KeyboardInterrupt())


def _abandon(live: list[SaveFuture]) -> None:
    kept = [f.path for f in live if not f.cancel() and not f.done()]
    for f in live:
        f.wait()  # a cancelled save stops at its commit gate and removes its temporary directory
    join_cleanups()
    _pay_exit_debts()
    gone = [f.path for f in live if f.cancelled() or (f.done() and f.exception() is not None)]
    print(f"flashwrite: abandoned {len(gone)} save(s) in flight: nothing of them was committed"
          + (f"; {', '.join(kept)} had begun to commit and did" if kept else ""), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


try:
    threading._register_atexit(_drain_at_exit)  # type: ignore[attr-defined]  # runs before threads are joined
except RuntimeError:  # imported while the interpreter shuts down: no save can start now either
    pass
