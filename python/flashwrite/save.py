"""Save: flatten -> plan -> stage (native) -> write (native) -> commit.

``Writer`` owns a native engine whose staging pool is allocated once and reused
by every save; ``SaveFuture`` tracks one save from staging to commit.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _core, commit, defaults
from . import cuda as _cuda
from .flatten import flatten
from .format import build_index, build_manifest
from .plan import PlannedFile, plan_files

log = logging.getLogger("flashwrite")

DEFAULT_STRIPES = defaults.STRIPES
DEFAULT_CHUNK_BYTES = defaults.CHUNK_BYTES
DEFAULT_QUEUE_DEPTH = defaults.WRITE_QUEUE_DEPTH


def _default_copy_threads() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0))))


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
    pinned: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.total_s / 1e9 if self.total_s else None


class SaveFuture:
    """A save in progress. ``result()`` returns its SaveStats once the checkpoint is
    durable and committed, or raises what went wrong (the temporary directory is
    then already removed and no earlier checkpoint was touched)."""

    def __init__(self, path: str, job: Any, stats: SaveStats, t0: float):
        self.path = path
        self._job = job
        self._stats = stats
        self._t0 = t0
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._released = False
        self._state_lock = threading.Lock()
        self._cancelled = False
        self._committing = False

    def _begin_commit(self) -> bool:
        """Called by the commit thread: False if the save was cancelled, else from
        now on cancel() can no longer stop it."""
        with self._state_lock:
            self._committing = not self._cancelled
            return self._committing

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
        ``concurrent.futures.CancelledError``. Returns False (and changes nothing)
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


class Writer:
    """Writes checkpoints with a reusable staging pool.

    stripes: files per checkpoint (more = more parallel streams on NFS / RAID).
    queue_depth: I/O requests kept in flight. chunk_bytes: size of each request
    and staging slot (multiple of 4096). backend: "auto", "io_uring" or "threads".
    direct: use O_DIRECT (falls back per file where the file system refuses it).
    max_staging_bytes: bound the pool; staging then overlaps writing and the
    caller waits for part of the write. copy_threads: parallel memcpy threads.
    """

    def __init__(self, stripes: int = DEFAULT_STRIPES, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, backend: str = "auto", direct: bool = True,
                 max_staging_bytes: int | None = None, copy_threads: int | None = None):
        if stripes < 1:
            raise ValueError("stripes must be >= 1")
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        if chunk_bytes < 4096 or chunk_bytes % 4096 or chunk_bytes > 1 << 30:
            # 1 GiB: the largest checksum block a reader accepts, and below io_uring's 32-bit lengths.
            raise ValueError("chunk_bytes must be a multiple of 4096 between 4 KiB and 1 GiB")
        if backend not in ("auto", "io_uring", "threads"):
            raise ValueError(f"backend must be 'auto', 'io_uring' or 'threads', not {backend!r}")
        if backend == "io_uring" and not _core.io_uring_compiled():
            raise RuntimeError("backend='io_uring' requested but flashwrite was built without liburing")
        self.stripes = stripes
        self.queue_depth = queue_depth
        self.chunk_bytes = chunk_bytes
        self.backend = backend
        self.direct = direct
        self.copy_threads = copy_threads or _default_copy_threads()
        self._engine = _core.Engine(chunk_bytes, max_staging_bytes or 0)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def max_staging_bytes(self) -> int | None:
        return self._engine.max_staging_bytes or None

    @property
    def pool_bytes(self) -> int:
        """Bytes of staging memory this writer holds (kept for the next save)."""
        return self._engine.pool_bytes

    def _committer(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("Writer is closed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashwrite-commit")
            return self._executor

    def write_stripes(self, state_dict: Any, directory: str, t0: float, *, prefix: str = "model",
                      allow_pickle: bool = False, metadata: dict[str, str] | None = None) -> StripeWrite:
        """Start staging + writing the stripes of ``state_dict`` into ``directory`` (which
        must exist; nothing is committed). The building block of ``save_async`` and of
        multi-rank saves, where every rank writes its own stripes into one directory."""
        tree, tensors, aliases = flatten(state_dict, allow_pickle=allow_pickle, share_storage=True)
        files = plan_files(tensors, self.stripes, prefix=prefix, metadata=metadata)
        keepalive, segments, streams = _stage_sources(files)
        job = self._engine.start_save(
            [(os.path.join(directory, f.name), f.header, f.size) for f in files], segments, keepalive,
            self.backend, self.queue_depth, self.copy_threads, self.direct, streams=streams)
        if streams and self._engine.pin_error:
            _warn_unpinned(self._engine.pin_error)
        stats = SaveStats(path=directory, bytes=sum(f.size for f in files), tensors=len(tensors), stripes=len(files))
        return StripeWrite(self, job, files, tree, aliases, metadata, stats, t0)

    def save_async(self, state_dict: Any, path: str | os.PathLike, *, overwrite: bool = False, block: bool = True,
                   allow_pickle: bool = False, metadata: dict[str, str] | None = None, process_group: Any = None,
                   coordination_group: Any = None, timeout: float | None = None) -> SaveFuture:
        """Snapshot ``state_dict`` and write it to ``path`` in the background.

        Returns once every tensor is copied into the staging pool (block=True):
        the caller may then modify its tensors. With block=False it returns as soon
        as the copies are started; call ``wait_staged()`` before mutating them.
        A target that exists or cannot be created raises here; failures while
        writing (no space, I/O errors) are raised by the future.

        process_group: save this rank's ``state_dict`` as its part of one checkpoint
        written by every rank of the group (see ``flashwrite.distributed``; every
        rank calls this; ``timeout`` bounds how long a rank waits for a silent peer,
        ``coordination_group`` supplies flashwrite's gloo group for subgroups).
        """
        if process_group is not None or coordination_group is not None:
            from . import distributed
            return distributed.save_async(self, state_dict, path, process_group=process_group,
                                          coordination_group=coordination_group, timeout=timeout,
                                          overwrite=overwrite, block=block, allow_pickle=allow_pickle,
                                          metadata=metadata)
        if timeout is not None:
            raise ValueError("timeout= applies to multi-rank saves (process_group=)")
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Writer is closed")
        path = os.path.abspath(os.fspath(path))
        tmp = commit.prepare(path, overwrite)
        try:
            sw = self.write_stripes(state_dict, tmp, t0, allow_pickle=allow_pickle, metadata=metadata)
        except BaseException:
            commit.discard(tmp)
            raise
        sw.stats.path = path
        fut = SaveFuture(path, sw.job, sw.stats, t0)

        def finish() -> SaveStats:
            manifest = sw.wait_durable()
            commit.finalize(tmp, path, manifest, build_index(manifest), overwrite)
            sw.stats.total_s = time.perf_counter() - t0
            log.debug("saved %s: %.3f GB in %.3f s (stall %.3f s, %s, direct=%s)", path, sw.stats.bytes / 1e9,
                      sw.stats.total_s, sw.stats.stall_s or 0, sw.stats.backend, sw.stats.direct)
            return sw.stats

        return self._launch(fut, sw, finish, lambda: commit.discard(tmp), block)

    def _launch(self, fut: SaveFuture, sw: StripeWrite, finish: Callable[[], Any], cleanup: Callable[[], None],
                block: bool) -> SaveFuture:
        """Wait for staging if asked, then run ``finish`` on the commit thread; its
        result (or exception, after ``cleanup``) completes the future."""
        def run() -> None:
            try:
                sw.job.wait()
                fut._release_sources()
                if not fut._begin_commit():
                    raise concurrent.futures.CancelledError(f"save to {fut.path} was cancelled")
                result = finish()
            except BaseException as e:
                cleanup()
                fut._future.set_exception(e)
                return
            fut._future.set_result(result)

        try:
            if block:
                fut.wait_staged()
            fut._future.set_running_or_notify_cancel()
            self._committer().submit(run)  # raises if the writer was closed meanwhile
        except BaseException:
            sw.job.cancel()
            sw.job.wait()
            cleanup()
            raise
        sw.stats.stall_s = time.perf_counter() - fut._t0
        return fut

    def save(self, state_dict: Any, path: str | os.PathLike, **kwargs: Any) -> SaveStats:
        """Blocking save: returns once the checkpoint is durable and committed."""
        return self.save_async(state_dict, path, **kwargs).result()

    def close(self) -> None:
        """Wait for saves in flight, then free the staging pool."""
        with self._lock:
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
        self._engine.trim()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Writer(stripes={self.stripes}, queue_depth={self.queue_depth}, chunk_bytes={self.chunk_bytes}, "
                f"backend={self.backend!r}, direct={self.direct}, max_staging_bytes={self.max_staging_bytes})")


def _stage_sources(files: list[PlannedFile]) -> tuple[list, list[tuple[int, int, int, int, int]], list[tuple[int, int]]]:
    """(objects that own the bytes, [(address, nbytes, file, offset, device)], [(device, stream)])
    for the native stager. device is -1 for host memory; CUDA tensors are copied by the
    native engine on its own streams, ordered after the returned current streams.

    The keepalive list is held by the native job until staging ends, so callers may
    drop their references right after save_async returns.
    """
    keepalive: list = []
    segments = []
    devices: set[int] = set()
    for fi, f in enumerate(files):
        for p in f.tensors:
            src = p.source
            dev = -1
            if _cuda.uses_native(src):
                dev = src.device.index if src.device.index is not None else torch.cuda.current_device()
                devices.add(dev)
            elif src.device.type != "cpu":
                # No native path to this device: PyTorch copies it to host memory
                # (synchronously, so the snapshot is exact).
                src = src.to("cpu")
            keepalive.append(src)
            p.source = None  # from here on only the job's keepalive holds it
            if p.nbytes:
                segments.append((src.data_ptr(), p.nbytes, fi, p.offset, dev))
    return keepalive, segments, _cuda.current_streams(devices) if devices else []


@functools.lru_cache(maxsize=None)
def _warn_unpinned(reason: str) -> None:
    log.warning("flashwrite: the staging pool could not be page-locked, GPU copies will be slower: %s", reason)


class StripeWrite:
    """Stripes of one state dict being staged and written (no commit)."""

    def __init__(self, writer: Writer, job: Any, files: list[PlannedFile], tree: Any, aliases: dict,
                 metadata: dict | None, stats: SaveStats, t0: float):
        self.writer, self.job, self.files, self.tree = writer, job, files, tree
        self.aliases, self.metadata, self.stats, self.t0 = aliases, metadata, stats, t0

    def wait_durable(self) -> dict:
        """Wait until every stripe is written and fsync'd (raising what failed) and
        return this write's manifest (not yet on disk)."""
        job, stats = self.job, self.stats
        job.wait()
        job.rethrow()
        native = job.stats()
        stats.durable_s = time.perf_counter() - self.t0
        stats.backend = native["backend"]
        stats.files_buffered = native["files_buffered"]
        stats.direct = native["files_buffered"] == 0 and self.writer.direct
        stats.pool_bytes = self.writer.pool_bytes
        stats.pinned = self.writer._engine.pool_pinned
        sums = iter(job.checksums())  # one list per non-empty tensor, in plan order
        by_key = {p.key: (next(sums) if p.nbytes else []) for f in self.files for p in f.tensors}
        return build_manifest(self.files, by_key, self.aliases, self.tree, self.writer.chunk_bytes,
                              _core.__version__, self.metadata)


_default_writers: dict[tuple, Writer] = {}
_default_lock = threading.Lock()
_WRITER_OPTIONS = ("stripes", "queue_depth", "chunk_bytes", "backend", "direct", "max_staging_bytes", "copy_threads")


def default_writer(**options: Any) -> Writer:
    """The shared Writer for these options (one staging pool per distinct configuration;
    options spelled out at their default values name the same writer as no options)."""
    defaults = inspect.signature(Writer.__init__).parameters
    effective = {k: p.default for k, p in defaults.items() if k != "self"}
    unknown = set(options) - set(effective)
    if unknown:
        raise TypeError(f"unknown Writer options: {sorted(unknown)}")
    effective.update(options)
    key = tuple(sorted(effective.items()))
    with _default_lock:
        w = _default_writers.get(key)
        if w is None or w._closed:
            w = _default_writers[key] = Writer(**options)
        return w


def _split_options(options: dict) -> tuple[dict, dict]:
    wopts = {k: options.pop(k) for k in list(options) if k in _WRITER_OPTIONS}
    return wopts, options


def save_async(state_dict: Any, path: str | os.PathLike, **options: Any) -> SaveFuture:
    """Snapshot ``state_dict`` into host memory and write it to ``path`` in the background.

    Options: Writer settings (stripes, queue_depth, chunk_bytes, backend, direct,
    max_staging_bytes, copy_threads) and per-save settings (overwrite, block,
    allow_pickle, metadata; process_group, coordination_group, timeout for a
    multi-rank save).
    """
    wopts, sopts = _split_options(dict(options))
    return default_writer(**wopts).save_async(state_dict, path, **sopts)


def save(state_dict: Any, path: str | os.PathLike, **options: Any) -> SaveStats:
    """Save and wait until the checkpoint is durable and committed."""
    return save_async(state_dict, path, **options).result()
