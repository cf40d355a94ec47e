"""Stage and write the stripes of one state dict (no commit).

The building block of every save: a single-process save commits what this
writes into its own temporary directory, a multi-rank save has every rank write
its stripes into one shared directory, and the DCP writer writes the chunks DCP
asks for. ``StripeWriter`` is what those callers need of a ``Writer``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import time
from typing import Any, Callable, Protocol

import torch

from .. import _core
from ..system import gcpause
from ..incremental import held
from . import hf
from ..system import cuda as _cuda
from .. import defaults as _defaults
from ..state.flatten import diagnose, flatten_columns
from ..format import build_manifest
from ..format import codec
from . import compress as _compress
from ..future import SaveStats, stop_job
from ..system.sigint import ignoring_sigint
from ..incremental.link import annotate
from ..layout.plan import PlannedFile, plan_files

log = logging.getLogger("flashwrite")

# Set while a blocking save (``save``, ``Writer.save``) stages: its caller waits for the
# whole save anyway, so each chunk is checksummed as it is copied, from cache, instead of
# in a pass after staging that reads every slot again (a pass that only shortens the stall
# of a ``save_async``; measured in docs/nfs.md section 14).
_CALLER_WAITS: contextvars.ContextVar[bool] = contextvars.ContextVar("flashwrite_caller_waits", default=False)


@contextlib.contextmanager
def caller_waits() -> Any:
    token = _CALLER_WAITS.set(True)
    try:
        yield
    finally:
        _CALLER_WAITS.reset(token)


class StripeWriter(Protocol):
    """What the save paths need of a ``flashwrite.Writer``."""

    def write_stripes(self, state_dict: Any, directory: str, t0: float, *, prefix: str = "model",
                      allow_pickle: bool = False, metadata: dict[str, str] | None = None,
                      hf_model: str | None = None, hold_slots: bool = False,
                      remote: object | None = None) -> StripeWrite: ...


def start(engine: Any, state_dict: Any, directory: str, t0: float, *, stripes: int, backend: str, queue_depth: int,
          copy_threads: int, direct: bool, prefix: str = "model", allow_pickle: bool = False,
          metadata: dict[str, str] | None = None, hf_model: str | None = None,
          hold_slots: bool = False, incremental: Callable[..., Any] | None = None,
          remote: object | None = None, compress: bool = False,
          replicas: Callable[..., Any] | None = None) -> StripeWrite:
    """Start staging + writing the stripes of ``state_dict`` into ``directory`` (which
    must exist) on ``engine`` (a ``_core.Engine``, whose pool and chunk size it uses).
    hf_model: the key of a model state dict whose tensors get stripes of their own,
    under their own names, for Hugging Face's index (see ``hf.py``).
    incremental: an ``incremental.Planner``: plans the stripes instead, linking into
    ``directory`` those that did not change since the checkpoint it compares with; only
    the others are staged and written.
    compress: frame the stripes' chunks with the native codec (``compress.py``); the
    caller has refused what cannot be compressed (incremental, hf_model).
    replicas: ``replicas.split`` bound to a replica group: (tree, aliases, columns) ->
    ``replicas.Split``, whose files (this rank's share) are the ones staged and written."""
    with gcpause.paused():  # per-tensor work: see gcpause
        try:
            # Unchecked: a tensor with no plain bytes fails below (no data pointer, no
            # shape, a dtype we cannot name, a copy out of meta), and is named then.
            tree, aliases, columns = flatten_columns(state_dict, allow_pickle=allow_pickle)
            hf_section = None
            iplan = None
            split = replicas(tree, aliases, columns, stripes=stripes, block=engine.chunk_bytes) if replicas else None
            if split is not None:
                tree, aliases, files = split.tree, split.aliases, split.files
            elif incremental is not None and hf_model is None:
                # A save that keeps its slots (a local snapshot) stages every stripe: its
                # unchanged ones are held files, linked by the job once staged.
                iplan = incremental(columns, stripes=stripes, prefix=prefix, metadata=metadata,
                                    block=engine.chunk_bytes, stage_all=hold_slots)
            if iplan is not None:
                files = iplan.files
            elif split is None and hf_model is None:
                files = plan_files(None, stripes, prefix=prefix, metadata=metadata, columns=columns)
            elif split is None:
                model, rest = hf.split(state_dict, tree, columns.flat(), aliases, hf_model)
                files = plan_files(model, stripes, prefix=hf.MODEL_PREFIX, metadata=metadata)
                hf_section = {"model_key": hf_model, "files": [f.name for f in files]}
                if rest:
                    files += plan_files(rest, stripes, prefix=hf.STATE_PREFIX, metadata=metadata)
            planes = []
            if compress:
                for f in files:
                    f.name = codec.stripe_name(f.name)
                planes = _compress.plane_runs(files)
            written = iplan.staged if iplan is not None else files  # held files too: linked or written by the job
            keepalive, segments, host_files, streams = _stage_sources(written)
            if iplan is not None:
                columns.sources = None  # the linked stripes' tensors are not staged: not held either
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            diagnose(state_dict)  # the clear error naming the key, if that is what failed
            raise
    job = engine.start_save([(os.path.join(directory, f.name), f.header, f.size) for f in written], segments,
                            keepalive, backend, queue_depth, copy_threads, direct, streams=streams,
                            hold_slots=hold_slots, host_files=host_files, hash_while_copying=_CALLER_WAITS.get(),
                            remote=remote,  # the target's native_files(): nfs://, straight to the server
                            held=held.specs(iplan) if iplan is not None else [], planes=planes)
    try:  # the job runs now: whatever stops this before its StripeWrite is handed on stops the job too
        pin_warned = bool(streams and engine.pin_error)
        if pin_warned:
            _warn_unpinned(engine.pin_error)
        stats = SaveStats(path=directory, bytes=sum(f.size for f in files), tensors=len(columns.keys),
                          stripes=len(files), pool_wait_s=job.pool_wait_s)
        stats.bytes_written = sum(f.size for f in written)
        sw = StripeWrite(engine, job, files, tree, aliases, metadata, stats, t0, direct)
        sw.hf_section = hf_section
        sw.pin_warned = pin_warned  # a GPU save pins on its own thread: a failure there is warned of once durable
        sw.compressed = bool(planes)
        if split is not None:  # raise mode: the replicas' digests compared once this rank's share is staged
            split.agree(job)
            split.record(sw)
        if iplan is not None:
            sw.incremental = iplan
            _incremental_stats(stats, iplan, planned=True)
    except BaseException:
        ignoring_sigint(lambda: stop_job(job), keep=False)  # a Ctrl-C here must not leave it writing
        raise
    return sw


def _incremental_stats(stats: SaveStats, iplan: Any, planned: bool = False) -> None:
    """What an incremental save wrote and linked (again once its held files are settled);
    ``planned``: also what its plan compared and watched."""
    stats.bytes_written, stats.bytes_linked = sum(f.size for f in iplan.written), iplan.linked_bytes
    stats.stripes_linked, stats.link_fallbacks = len(iplan.linked) + len(iplan.settled), iplan.fallbacks
    if planned:
        stats.compared_bytes, stats.watched_bytes = iplan.compared_bytes, iplan.watched_bytes
        stats.rechecked_bytes, stats.watch_misses = iplan.rechecked_bytes, iplan.watch_misses


def _stage_sources(files: list[PlannedFile]) -> tuple[list, list[tuple[int, int, int, int, int]], list[tuple],
                                                       list[tuple[int, int]]]:
    """(objects that own the bytes, [(address, nbytes, file, offset, device)], host files,
    [(device, stream)]) for the native stager. device is -1 for host memory; CUDA tensors
    are copied by the native engine on its own streams, ordered after the returned
    current streams. A file of host tensors only goes as its columns (see
    ``Engine.start_save``'s host_files), with no tuple per tensor.

    The keepalive list is held by the native job until staging ends, and the plan drops
    its sources, so callers may drop their references right after save_async returns.
    """
    keepalive: list = []
    segments: list[tuple[int, int, int, int, int]] = []
    host_files: list[tuple] = []
    devices: set[int] = set()
    on_gpu: list[_cuda.Item] = []
    gpu_at: list[int] = []  # where each of on_gpu is in segments (the job's checksums follow their order)
    for columns in {id(f.columns): f.columns for f in files}.values():
        srcs, ptrs, nbytes = columns.sources, columns.ptrs, columns.nbytes
        if srcs is None:
            raise RuntimeError("this plan was staged already")
        host = all(d == "cpu" for d in columns.devices)
        for fi, f in enumerate(files):
            if f.columns is not columns:
                continue
            if host:  # the common case, without a look at each tensor: per tensor of 100,000
                host_files.append((fi, f.members, f.offsets, ptrs, nbytes))
                continue
            for j, off in zip(f.members, f.offsets):
                src, dev = srcs[j], -1
                if columns.devices[j] == "cpu":
                    pass
                elif _cuda.uses_native(src):
                    dev = src.device.index if src.device.index is not None else torch.cuda.current_device()
                    devices.add(dev)
                elif src.is_meta:  # no bytes to copy (flatten.diagnose names the key)
                    raise TypeError(f"{columns.keys[j]}: a meta tensor has no data to store")
                else:
                    # No native path to this device: PyTorch copies it to host memory
                    # (synchronously, so the snapshot is exact).
                    src = srcs[j] = src.to("cpu")
                if nbytes[j]:
                    if dev >= 0:  # its address comes from the gather below; the order stays
                        on_gpu.append((src, nbytes[j], fi, off, dev))
                        gpu_at.append(len(segments))
                    segments.append((src.data_ptr(), nbytes[j], fi, off, dev))
        keepalive.append(srcs)
        columns.sources = None  # from here on only the job's keepalive holds them
    if on_gpu:
        _cuda.refuse_capture("a save of GPU tensors", {it[4] for it in on_gpu})
        # Small GPU tensors side by side in a stripe: gathered on the current stream
        # (before the streams below are read), one copy per chunk instead of one each.
        addresses, buffers = _cuda.gather(on_gpu, _defaults.GATHER_TENSOR_BYTES, _defaults.GATHER_RUN_BYTES)
        for at, addr in zip(gpu_at, addresses):
            segments[at] = (addr,) + segments[at][1:]
        keepalive.append(buffers)
    return keepalive, segments, host_files, _cuda.current_streams(devices) if devices else []


@functools.lru_cache(maxsize=None)
def _warn_unpinned(reason: str) -> None:
    log.warning("flashwrite: the staging pool could not be page-locked, GPU copies will be slower: %s", reason)


class StripeWrite:
    """Stripes of one state dict being staged and written (no commit)."""

    def __init__(self, engine: Any, job: Any, files: list[PlannedFile], tree: Any, aliases: dict,
                 metadata: dict | None, stats: SaveStats, t0: float, direct: bool):
        self.engine, self.job, self.files, self.tree = engine, job, files, tree
        self.aliases, self.metadata, self.stats, self.t0, self.direct = aliases, metadata, stats, t0, direct
        self.hf_section: dict | None = None  # which stripes Hugging Face's index lists (hf_model=)
        self.incremental: Any = None  # the incremental.Plan when some stripes are linked, not written
        self._manifest: dict | None = None
        self.compressed = False  # frames recorded once the job is done (wait_durable)
        self.on_durable: Callable[..., None] | None = None  # compress.observe: the target's rate
        self.replicas: dict | None = None  # the replica group's manifest section (replica_group=)

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
        stats.direct = native["files_buffered"] == 0 and self.direct
        stats.pool_bytes = self.engine.pool_bytes
        stats.pinned = self.engine.pool_pinned
        stats.pin_s = native["pin_s"]
        stats.staging_wait_s = native["staging_wait_s"]
        stats.staging_wait_reason = native["staging_wait_reason"]
        stats.unpinned_bytes = native["unpinned_bytes"]
        if stats.unpinned_bytes and native["device_bytes"] and not getattr(self, "pin_warned", True) and self.engine.pin_error:
            _warn_unpinned(self.engine.pin_error)
        stats.bytes_stored = native["bytes_stored"]
        if self.on_durable is not None:
            self.on_durable(native["bytes_stored"], native["done_s"], self.compressed, stats.bytes_written,
                            native["compress_s"])
        if self.compressed:
            stats.compress_s = native["compress_s"]
            stats.extra["compress_ratio"] = stats.bytes_written / max(1, native["bytes_stored"])
        if native["backend"] == "nfs":  # chunks sent again: a COMMIT came back under another write verifier
            stats.extra["nfs_rewrites"] = native["rewrites"]
            # WRITE payload bytes sent straight from the staging slots (flashwrite's own
            # connections), not copied by libnfs first (FLASHWRITE_NFS_WIRE=0: 0)
            stats.extra["nfs_bytes_sent_uncopied"] = native["bytes_sent_uncopied"]
        m = self.manifest()
        if self.compressed and m["files"] and "codec" not in m["files"][0]:
            for fe, frames in zip(m["files"], self.job.chunk_frames()):
                fe["codec"] = codec.entry(self.engine.chunk_bytes, frames)
            m["format_version"] = codec.COMPRESSED_SINCE
        return m

    def manifest(self) -> dict:
        """This write's manifest; valid once the job is checksummed (every byte staged).
        Made once: ``wait_durable`` returns the one ``early_manifest`` made."""
        if self._manifest is None:
            self._manifest = self._build_manifest()
        return self._manifest

    def early_manifest(self) -> dict | None:
        """The manifest as soon as every byte is checksummed, while the stripes are still
        being written and fsync'd (its CPU work then overlaps the I/O); None if the job
        failed or was cancelled first (``wait_durable`` raises why)."""
        self.job.wait_checksummed()
        if self.compressed:
            return None  # the frames are known only once written (wait_durable)
        return self.manifest() if self.job.checksummed else None

    def _build_manifest(self) -> dict:
        with gcpause.paused():
            incr = self.incremental
            sums = iter(self.job.checksums())  # one list per non-empty tensor, in plan order
            written = self.files if incr is None else incr.staged
            by_key = {p.key: (next(sums) if p.nbytes else []) for f in written for p in f.tensors}
            if incr is not None and incr.held:  # the job decided them before it was checksummed
                note = held.settle(incr, self.job.held_results(), by_key)
                _incremental_stats(self.stats, incr)
                if note:
                    self.stats.incremental = f"on: {note}"
            if incr is not None:
                by_key.update(incr.checksums)
            m = build_manifest(self.files, by_key, self.aliases, self.tree, self.engine.chunk_bytes,
                               _core.__version__, self.metadata, hf=self.hf_section)
            if incr is not None:
                annotate(m, incr)
            if self.replicas is not None:
                m["replicas"] = {"groups": [self.replicas]}
            return m

    def stop(self) -> None:
        """Cancel the writes still running and wait for the job to end (``stop_job``)."""
        stop_job(self.job)
