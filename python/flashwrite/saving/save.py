"""Save: flatten -> plan -> stage (native) -> write (native) -> commit.

``Writer`` owns a native engine whose staging pool is allocated once and reused
by every save; ``save_async`` saves on one rank, or (``process_group=``) as this
rank's part of a multi-rank checkpoint (``distributed.py``). Either way the
returned ``SaveFuture`` (``future.py``) tracks the save from staging to commit.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from .. import _core, defaults
from . import commit, distributed
from . import compress as _compress
from . import hf
from ..targets import tuning
from ..incremental import link as _incremental
from ..incremental.wiring import Wiring
from . import write as _write
from ..state.flatten import flatten_columns
from ..future import SaveFuture, SaveStats
from ..targets.locate import kind_of, resolve
from ..layout.plan import plan_files
from .session import RenameCommit, SaveSession
from ..targets.target import check_path, unsupported
from ..tier.node import LocalTier
from .write import StripeWrite

__all__ = ["Writer", "SaveFuture", "SaveStats", "StripeWrite", "default_writer", "save_async", "save"]

log = logging.getLogger("flashwrite")


class Writer:
    """Writes checkpoints with a reusable staging pool.

    stripes: files per checkpoint (more = more parallel streams on NFS / RAID).
    queue_depth: I/O requests kept in flight. chunk_bytes: size of each request
    and staging slot (multiple of 4096). backend: "auto", "io_uring" or "threads".
    direct: use O_DIRECT (falls back per file where the file system refuses it).
    max_staging_bytes: bound the pool; staging then overlaps writing and the
    caller waits for part of the write. copy_threads: parallel memcpy threads
    (default ``defaults.COPY_THREADS``: one per CPU, up to a cap).
    local_snapshots: back the pool with a file in ``local_dir`` (default /dev/shm)
    and leave a checkable snapshot of each staged save there, which outlives the
    process (``flashwrite.tier``, docs/tiers.md; ``CheckpointManager.restore`` uses it). A save
    larger than max_staging_bytes gets none; when local_dir is too small the pool
    says so once and uses private memory.
    neighbour_copies: with local_snapshots, in multi-rank saves (``process_group=``), each
    rank also keeps a copy of rank r-1's snapshot (``tier/neighbour.py``); every rank
    must set it alike.
    reserve: a state dict (or a size in bytes) to prepare the staging pool for now, in the
    background (``reserve()``), so the first save stalls no longer than later ones.
    incremental: stripes whose tensors did not change since the newest committed checkpoint
    beside the target (on nfs://: the last one this Writer committed there) are hard-linked
    from it instead of written (``flashwrite.incremental``; per save:
    ``save_async(incremental=)``). With local_snapshots the snapshot is whole and the
    unchanged stripes are linked on storage.
    compress: None (default), "zstd" or "auto": lossless compression of each chunk (byte
    planes + zstd) on the copy threads, after staging; "auto" only where the target's
    measured rate is below what the cores compress (``saving/compress.py``). A
    compressed checkpoint is not plain safetensors (``flashwrite convert`` writes
    plain files); incremental saves, hf_model= and multi-rank saves refuse it.
    """

    def __init__(self, stripes: int | None = None, queue_depth: int | None = None,
                 chunk_bytes: int | None = None, backend: str = "auto", direct: bool = True,
                 max_staging_bytes: int | None = None, copy_threads: int | None = None, *,
                 local_snapshots: bool = False, local_dir: str | os.PathLike | None = None,
                 neighbour_copies: bool = False, reserve: Any = None, incremental: bool = False,
                 compress: str | None = None):
        # Settings not given here come, per save, from a tuning saved for the target's
        # file system (`flashwrite tune --save`), else from defaults.py.
        self._explicit = {k for k, v in (("stripes", stripes), ("queue_depth", queue_depth),
                                         ("chunk_bytes", chunk_bytes)) if v is not None}
        stripes = defaults.STRIPES if stripes is None else stripes
        queue_depth = defaults.WRITE_QUEUE_DEPTH if queue_depth is None else queue_depth
        chunk_bytes = defaults.CHUNK_BYTES if chunk_bytes is None else chunk_bytes
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
        self.copy_threads = copy_threads or defaults.COPY_THREADS
        if neighbour_copies and not local_snapshots:
            raise ValueError("neighbour_copies=True needs local_snapshots=True")
        self.incremental = bool(incremental)
        self.compress = _compress.check_mode(compress)
        if self.compress is not None and self.incremental:
            raise ValueError(_compress.refusal(True, False, False))
        self._bases = _incremental.BaseCache()
        self._tier = LocalTier(local_dir, neighbour_copies) if local_snapshots else None
        self._engine = self._new_engine(chunk_bytes, max_staging_bytes or 0)
        self._engine_used = False
        self._reserving: concurrent.futures.Future | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_pid = 0
        self._lock = threading.Lock()
        self._closed = False
        if reserve is not None:
            self.reserve(reserve)

    def _new_engine(self, chunk_bytes: int, max_staging_bytes: int) -> Any:
        engine = _core.Engine(chunk_bytes, max_staging_bytes)
        if self._tier is not None:
            engine.set_backing_file(self._tier.pool_path)
        return engine

    @property
    def local_snapshots(self) -> bool:
        return self._tier is not None

    @property
    def local_tier(self) -> LocalTier | None:
        """The node-local tier this writer keeps its snapshots in (``local_snapshots=True``), or None."""
        return self._tier

    def reserve(self, nbytes: int | Any, *, device: int | str | torch.device | None = None,
                block: bool = False) -> concurrent.futures.Future:
        """Allocate, fault in and (for GPU states) page-lock the staging pool now, in the
        background, so the first save stalls no longer than later ones.

        nbytes: a size in bytes, or the state dict to be saved (sized exactly, as its save
        will be planned). device: the GPU the pool is pinned for (default: that of the
        state's first CUDA tensor; none for a size or a CPU state). The pool's chunk size
        is fixed from here on (a tuned one is no longer picked by the first save).
        Returns a future that completes when the pool is ready (block=True waits for it).
        """
        if not isinstance(nbytes, int):
            nbytes, found = _planned_bytes(nbytes, self.stripes, self.chunk_bytes)
            device = found if device is None else device
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        dev = -1
        if device is not None:
            d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            if d.type == "cuda":
                dev = d.index if d.index is not None else torch.cuda.current_device()
        with self._lock:
            if self._closed:
                raise RuntimeError("Writer is closed")
            self._engine_used = True
            engine = self._engine
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def run() -> None:
            try:
                t0 = time.perf_counter()
                engine.reserve(nbytes, dev)
                log.debug("reserved %d bytes of staging pool in %.3f s", engine.pool_bytes, time.perf_counter() - t0)
                fut.set_result(engine.pool_bytes)
            except BaseException as e:
                fut.set_exception(e)

        # Not a daemon: the interpreter waits for it at exit. A daemon thread would be torn
        # down inside the native reservation while the interpreter finalizes (std::terminate).
        threading.Thread(target=run, name="flashwrite-reserve").start()
        self._reserving = fut
        if block:
            fut.result()
        return fut

    def prepare(self, state: Any, directory: str | os.PathLike | None = None) -> concurrent.futures.Future | None:
        """``reserve(state)`` unless the pool is already prepared or being prepared, or a save
        has used it: how a ``CheckpointManager`` gets the pool ready from the first state it
        sees (a restored one, or one handed to a save that was not due), before the first
        save needs it. directory: where saves will go (a tuned chunk size for its file
        system is taken first). Returns the reservation's future, or None."""
        with self._lock:
            if self._closed or self._reserving is not None or self._engine_used or self._engine.pool_bytes:
                return None
        if directory is not None:
            self._settings_for(os.fspath(directory))
        return self.reserve(state)

    @property
    def max_staging_bytes(self) -> int | None:
        return self._engine.max_staging_bytes or None

    @property
    def pool_bytes(self) -> int:
        """Bytes of staging memory this writer holds (kept for the next save)."""
        return self._engine.pool_bytes

    @property
    def pool_pages(self) -> str | None:
        """The page size of the pool's newest slab and why: 2 MiB pages unless they fault in
        over 3x slower than 4 KiB pages on this host (``FLASHWRITE_HUGE_PAGES=auto``, the
        default; ``on`` or ``off`` decides instead), or None before the pool exists."""
        return self._engine.pool_pages

    def _committer(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("Writer is closed")
            # A forked child has the executor but not its thread (fork copies only the
            # calling thread): work handed to it would never run, so the child makes its own.
            if self._executor is None or self._executor_pid != os.getpid():
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashwrite-commit")
                self._executor_pid = os.getpid()
            return self._executor

    def write_stripes(self, state_dict: Any, directory: str, t0: float, *, prefix: str = "model",
                      allow_pickle: bool = False, metadata: dict[str, str] | None = None,
                      hf_model: str | None = None, hold_slots: bool = False,
                      incremental: Callable[..., Any] | None = None, remote: object | None = None,
                      replicas: Callable[..., Any] | None = None) -> StripeWrite:
        """Start staging + writing the stripes of ``state_dict`` into ``directory`` (which
        must exist; nothing is committed); ``remote``: its target's ``native_files()``. The building block of ``save_async`` and of
        multi-rank saves, where every rank writes its own stripes into one directory."""
        settings = self._settings_for(directory)
        on, why = _compress.decide(self.compress, directory, self.copy_threads)
        if on:
            refused = _compress.refusal(incremental is not None, hf_model is not None, prefix != "model")
            if refused and self.compress == "zstd":
                raise ValueError(refused)
            if refused:
                on, why = False, f"auto: off ({refused.split(':')[0].split(' (')[0]})"
        sw = _write.start(self._engine, state_dict, directory, t0, stripes=settings["stripes"], backend=self.backend,
                          queue_depth=settings["queue_depth"], copy_threads=self.copy_threads, direct=self.direct,
                          prefix=prefix, allow_pickle=allow_pickle, metadata=metadata, hf_model=hf_model,
                          hold_slots=hold_slots, incremental=incremental, remote=remote, compress=on,
                          replicas=replicas)
        sw.stats.settings = settings
        sw.stats.compress = why
        sw.on_durable = functools.partial(_compress.observe, directory, copy_threads=self.copy_threads)
        return sw

    def incremental_wiring(self, on: bool = True, *, view: Callable[[Any], Any] | None = None,
                           refused: str = "", rank: tuple[int, int] | None = None) -> Wiring | None:
        """An incremental save with this Writer's cached base and copy threads, as every save
        path hands it to its session (None where ``on`` is false); ``view``: how a save that
        drives its own steps (``flashwrite.dcp``) sees the base, and ``rank`` the rank it plans
        for; ``refused``: why it cannot apply (see ``incremental.wiring.Wiring``)."""
        if not on:
            return None
        return Wiring(self._bases, self.copy_threads, view, refused, rank)

    def _settings_for(self, directory: str) -> dict:
        """Explicit settings, else a saved tuning for directory's file system, else defaults.
        chunk_bytes sizes the staging pool, so a tuned one is taken only before the first save."""
        s = tuning.resolve(directory, {k: getattr(self, k) for k in self._explicit})
        with self._lock:
            if s["chunk_bytes"] != self.chunk_bytes:
                if self._engine_used:
                    s["chunk_bytes"], s["source"]["chunk_bytes"] = self.chunk_bytes, "pool (sized by the first save)"
                else:
                    self._engine = self._new_engine(s["chunk_bytes"], self._engine.max_staging_bytes)
                    self.chunk_bytes = s["chunk_bytes"]
            self._engine_used = True
        return s

    def save_async(self, state_dict: Any, path: str | os.PathLike, *, overwrite: bool = False, block: bool = True,
                   allow_pickle: bool = False, metadata: dict[str, str] | None = None, process_group: Any = None,
                   coordination_group: Any = None, timeout: float | None = None, hf_model: str | None = None,
                   hf_config: Any = None, extra_files: Any = None, incremental: bool | None = None,
                   replica_group: Any = None, rank_local: Any = None, on_divergence: str = "raise") -> SaveFuture:
        """Snapshot ``state_dict`` and write it to ``path`` in the background.

        Returns once every tensor is copied into the staging pool (block=True):
        the caller may then modify its tensors. With block=False it returns as soon
        as the copies are queued: GPU work queued afterwards on the current stream
        (the next optimizer step) waits on the GPU for the copies of GPU tensors;
        CPU tensors, and GPU tensors changed from other streams, need
        ``wait_staged()`` before they change.
        A target that exists or cannot be created raises here; failures while
        writing (no space, I/O errors) are raised by the future.

        process_group: save this rank's ``state_dict`` as its part of one checkpoint
        written by every rank of the group (see ``saving/distributed.py``; every
        rank calls this; ``timeout`` bounds how long a rank waits for a silent peer,
        ``coordination_group`` supplies flashwrite's gloo group for subgroups).

        replica_group, rank_local, on_divergence: ranks whose state is identical write each
        replicated byte once and are checked to agree (``saving/replicas.py``, docs/replicas.md).

        hf_model: the key of a model's state dict in ``state_dict`` (e.g. "model"): its
        tensors are stored under their own names in the stripes that
        model.safetensors.index.json lists, so ``from_pretrained(path)`` loads the model
        while ``flashwrite.load(path)`` returns the whole state. hf_config: a
        ``PretrainedConfig`` or dict, written as config.json.

        extra_files: small files to commit inside the checkpoint directory, in the same
        atomic commit: ``{name: bytes or path of a file}`` (a path is read now). Names are
        plain file names (``trainer_state.json``, ``tokenizer.json``); they are written and
        fsync'd before the manifest, so the directory never appears without them.

        incremental: overrides the Writer's ``incremental`` for this save. Where it cannot
        apply (local snapshots, hf_model=) the save writes every stripe and
        ``SaveStats.incremental`` says why.
        """
        kind = kind_of(path, "save")  # a URL other than nfs:// is refused before anything else
        if not kind.holds_local_snapshots and self._tier is not None:
            raise unsupported(f"save: {os.fspath(path)!r}: local snapshots with nfs:// are not supported yet; save to "
                              "a mounted path", path)
        single = ("hf_model", hf_model), ("hf_config", hf_config), ("extra_files", extra_files)
        multi = process_group is not None or coordination_group is not None or replica_group is not None
        if multi:
            given = [name for name, v in single if v is not None]
            if given:
                raise ValueError(f"{'= and '.join(given)}= apply to single-process saves")
        config = hf.config_bytes(hf_config) if hf_config is not None else None
        extra = {hf.CONFIG_NAME: config} if config is not None else {}
        if extra_files is not None:
            extra.update(commit.extra_files(extra_files, reserved=tuple(extra)))
        incr = self.incremental if incremental is None else bool(incremental)
        _compress.check_save(self.compress, incr, hf_model is not None, multi)
        if multi:
            return distributed.save_async(
                self, state_dict, path, process_group=process_group, coordination_group=coordination_group,
                timeout=timeout, overwrite=overwrite, block=block, allow_pickle=allow_pickle, metadata=metadata,
                tier=self._tier, incremental=self.incremental_wiring(incr), on_committed=self._bases.committed,
                replica_group=replica_group, rank_local=rank_local, on_divergence=on_divergence)
        if rank_local is not None or on_divergence != "raise":
            raise ValueError("rank_local= and on_divergence= apply to saves with replica_group=")
        if timeout is not None:
            raise ValueError("timeout= applies to multi-rank saves (process_group=)")
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("Writer is closed")
        target, path = resolve(path, "save")
        wiring = self.incremental_wiring(incr, refused=hf.NOT_INCREMENTAL if hf_model is not None else "")
        # The next incremental save's base, where directories are not scanned (nfs://).
        strategy = RenameCommit(path, target, overwrite, extra, lambda run: self._committer().submit(run),
                                on_committed=self._bases.committed)
        session = SaveSession(self, strategy, self._tier, t0)
        session.stage(state_dict, allow_pickle=allow_pickle, metadata=metadata, hf_model=hf_model,
                      incremental=wiring)
        return session.launch(block)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run (a closed Writer refuses new saves)."""
        return self._closed

    def save(self, state_dict: Any, path: str | os.PathLike, **kwargs: Any) -> SaveStats:
        """Blocking save: returns once the checkpoint is durable and committed."""
        with _write.caller_waits():  # each chunk checksummed as it is copied
            return self.save_async(state_dict, path, **kwargs).result()

    def close(self, keep_local: bool = False) -> None:
        """Wait for saves in flight, then free the staging pool. With local snapshots,
        their files go too, except (keep_local=True) the newest snapshot's and those of
        saves that never reached storage."""
        with self._lock:
            self._closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
        if self._reserving is not None:
            self._reserving.exception()  # a reservation in flight ends before the pool goes
        if self._tier is not None and self._tier.close(keep_newest=keep_local):
            return  # the pool file holds a snapshot: its pages stay (unmapped at exit)
        self._engine.trim()
        if self._tier is not None:
            self._tier.remove_pool_file()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Writer(stripes={self.stripes}, queue_depth={self.queue_depth}, chunk_bytes={self.chunk_bytes}, "
                f"backend={self.backend!r}, direct={self.direct}, max_staging_bytes={self.max_staging_bytes})")


def _planned_bytes(state: Any, stripes: int, chunk_bytes: int) -> tuple[int, Any]:
    """(pool bytes the save of ``state`` needs, the device of its first CUDA tensor or None):
    planned as a save plans it, so the count of chunks is exact."""
    _, _, columns = flatten_columns(state, allow_pickle=True)
    device = next((torch.device(d) for d in columns.devices if d.startswith("cuda")), None)
    files = plan_files(None, stripes, columns=columns)
    return sum(-(-f.size // chunk_bytes) for f in files) * chunk_bytes, device


_default_writers: dict[tuple, Writer] = {}
_default_lock = threading.Lock()
# The options of save/save_async that configure the shared Writer: its constructor's, read
# from it so that a new one cannot be left out (neighbour_copies once was).
_WRITER_OPTIONS = tuple(k for k in inspect.signature(Writer.__init__).parameters if k != "self")


def default_writer(path: str | os.PathLike | None = None, **options: Any) -> Writer:
    """The shared Writer for these options (one staging pool per distinct configuration;
    backend/direct/... spelled out at their default values name the same writer as no options;
    stripes/queue_depth/chunk_bytes given explicitly do not, since they override a saved tuning)."""
    defaults = inspect.signature(Writer.__init__).parameters
    effective = {k: p.default for k, p in defaults.items() if k != "self"}
    unknown = set(options) - set(effective)
    if unknown:
        raise TypeError(f"unknown Writer options: {sorted(unknown)}")
    effective.update(options)
    if path is not None and options.get("chunk_bytes") is None and kind_of(path, "save").os_paths:
        # A tuned chunk size sizes the pool: one shared writer per chunk size, so a save to
        # another file system is not bound to the first one's tuning.
        effective["tuned_chunk"] = tuning.resolve(os.fspath(path), {})["chunk_bytes"]
    key = tuple(sorted(effective.items()))
    with _default_lock:
        w = _default_writers.get(key)
        if w is None or w.closed:
            w = _default_writers[key] = Writer(**options)
        return w


def _split_options(options: dict) -> tuple[dict, dict]:
    wopts = {k: options.pop(k) for k in list(options) if k in _WRITER_OPTIONS}
    return wopts, options


def save_async(state_dict: Any, path: str | os.PathLike, **options: Any) -> SaveFuture:
    """Snapshot ``state_dict`` into host memory and write it to ``path`` in the background.

    Options: every parameter of ``Writer(...)`` (read from its signature: stripes,
    queue_depth, chunk_bytes, backend, direct, max_staging_bytes, copy_threads,
    local_snapshots, local_dir, neighbour_copies, reserve), which pick the shared Writer,
    and every parameter of ``Writer.save_async`` (overwrite, block, allow_pickle, ...).
    """
    wopts, sopts = _split_options(dict(options))  # default_writer checks the path, before any tuning is looked up
    return default_writer(path, **wopts).save_async(state_dict, path, **sopts)


def prepare(state_dict: Any, path: str | os.PathLike, **options: Any) -> concurrent.futures.Future | None:
    """Prepare the staging pool that ``save_async(state_dict, path, **options)`` will use,
    in the background, so the process's first save stalls no longer than later ones: call it
    once the state is complete (after the first optimizer step, which creates the optimizer's
    state), well before the first save; the pool is allocated and faulted in while training
    runs (about 0.3-1 s of CPU per GiB on a VM). A save of a larger state grows the pool. path: where the saves go (its file system's tuned
    chunk size is taken). Options: the ``Writer(...)`` options the saves pass. Returns the
    preparation's future, or None when that pool is already prepared or in use."""
    check_path(path, "save")
    wopts, sopts = _split_options(dict(options))
    if sopts:
        raise TypeError(f"prepare() takes Writer options only, not {sorted(sopts)}")
    return default_writer(path, **wopts).prepare(state_dict, path)


def save(state_dict: Any, path: str | os.PathLike, **options: Any) -> SaveStats:
    """Save and wait until the checkpoint is durable and committed."""
    wopts, sopts = _split_options(dict(options))
    return default_writer(path, **wopts).save(state_dict, path, **sopts)
