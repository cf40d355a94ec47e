"""One save in flight: its figures (``SaveStats``) and its future (``SaveFuture``).

Every save, on one rank or many, is launched the same way (``SaveFuture._launch``):
wait for staging if asked, then run the save's ``finish`` on a background thread,
which waits until the stripes are durable, passes the commit gate, and commits.
The gate is the one place where a cancel either wins (nothing is committed) or
loses for good, so ``cancel()`` means the same thing for every kind of save.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


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
    pin_s: float = 0.0              # of the stall: page-locking the staging pool (GPU saves; 0 once pinned)
    settings: dict = field(default_factory=dict)  # stripes/queue_depth/chunk_bytes used, and where each came from
    # Incremental saves (incremental=True): bytes is the checkpoint's size, bytes_written what
    # this save wrote, bytes_linked what it hard-linked from the earlier checkpoint;
    # link_fallbacks counts stripes written because the file system refused a link;
    # compared_bytes what was hashed from the source to compare. incremental: "" when not
    # asked, else "on", "on: no earlier checkpoint to link from", or "off: <why>".
    bytes_written: int = 0
    bytes_linked: int = 0
    stripes_linked: int = 0
    link_fallbacks: int = 0
    compared_bytes: int = 0
    incremental: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.total_s / 1e9 if self.total_s else None


# finish(commit_gate) -> SaveStats: runs on the save's background thread; it calls
# commit_gate() once every stripe is durable and before anything becomes visible.
Finish = Callable[[Callable[[], None]], SaveStats]


class SaveFuture:
    """A save in progress. ``result()`` returns its SaveStats once the checkpoint is
    durable and committed, or raises what went wrong (the temporary directory is
    then already removed and no earlier checkpoint was touched)."""

    def __init__(self, path: str, job: Any, stats: SaveStats, t0: float):
        self.path = path
        self._job = job  # the native save job (staging + writing this rank's stripes)
        self._stats = stats
        self._t0 = t0
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._released = False
        self._state_lock = threading.Lock()
        self._cancelled = False
        self._committing = False

    def _launch(self, finish: Finish, submit: Callable[[Callable[[], None]], Any], *, block: bool,
                cleanup: Callable[[], None], abandon: Callable[[BaseException], None] | None = None) -> SaveFuture:
        """Start the save's background part: wait for staging if ``block``, then hand
        ``finish`` to ``submit`` (the thread that commits). Its result, or its exception
        after ``cleanup()``, completes this future. If the launch itself fails, the job
        is stopped and ``abandon(error)`` (default: ``cleanup()``) runs before it raises."""

        def run() -> None:
            try:
                result = finish(self._commit_gate)
            except BaseException as e:
                # finish can fail before the job has ended (its checksums report the error
                # first): stop it and let its writes in flight land and its files close, so
                # that none of them recreates or holds open what cleanup() removes.
                self._job.cancel()
                self._job.wait()
                cleanup()
                self._future.set_exception(e)
                return
            self._future.set_result(result)

        try:
            if block:
                self.wait_staged()
            self._future.set_running_or_notify_cancel()
            submit(run)  # raises if the thread that commits was shut down meanwhile
        except BaseException as e:
            self._job.cancel()
            self._job.wait()
            if abandon is not None:
                abandon(e)
            else:
                cleanup()
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

    def result(self, timeout: float | None = None) -> SaveStats:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveFuture], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

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
            if self._committing or self._future.done():
                return False
            self._cancelled = True
        self._job.cancel()
        return True

    def __repr__(self) -> str:
        state = "committed" if self.done() and not self._future.exception() else \
            "failed" if self.done() else "staged" if self.staged else "staging"
        return f"<SaveFuture {self.path!r} {state} {self.progress():.0%}>"
