"""Load: read (native, parallel, O_DIRECT) -> verify (native, overlapped) -> place.

CPU tensors come back owning their memory, like ``torch.load``'s: each has a
storage of exactly its bytes at offset 0 (copied out of the page-aligned read
buffers one stripe at a time, each buffer freed once copied out). With
``zero_copy=True`` they are views of the read buffers instead (no second copy, but
one tensor keeps its whole stripe's buffer alive). ``into=`` copies into existing tensors. Tensors bound for CUDA devices
are read into pinned bounce buffers and copied host-to-device by the native
engine chunk by chunk, each chunk verified first (see ``cuda.py``); other
devices get a copy.
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
import time
from typing import Any, Callable

import torch

from . import _core, defaults, dtypes, foreign
from . import cuda as _cuda
from .errors import ChecksumMismatchError, CorruptCheckpointError, UnsafeCheckpointError
from .flatten import flatten, unflatten
from .format import Manifest, check_stripe_header, piece_ranges, read_manifest

DEFAULT_READ_CHUNK = defaults.READ_CHUNK_BYTES
DEFAULT_READ_QUEUE_DEPTH = defaults.READ_QUEUE_DEPTH


def _read_chunk(block: int) -> int:
    # A multiple of the checksum block, so every checksummed piece lies inside one read.
    return block * max(1, DEFAULT_READ_CHUNK // block)


def _device_for(entry_device: str, map_location: Any) -> torch.device:
    if map_location is None:
        return torch.device(entry_device)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(entry_device, entry_device))
    return torch.device(map_location)


class LoadResult:
    """Tensors of one checkpoint, keyed by stored name, plus the manifest."""

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], elapsed_s: float, backend: str,
                 direct: bool):
        self.manifest = manifest
        self.tensors = tensors
        self.elapsed_s = elapsed_s
        self.backend = backend
        self.direct = direct


def read_tensors(path: str | os.PathLike, **options: Any) -> LoadResult:
    """Read and verify every stripe; return CPU tensors that view the read buffers.

    Options: verify, backend, direct, queue_depth, keys (a subset to read), and
    device_targets(manifest), which may name, per key, a contiguous CUDA tensor of the
    stored dtype and size to receive that tensor's bytes: they are then copied there by
    the native engine through pinned bounce buffers (verified chunk by chunk before the
    copy) and never held in host memory as a whole.

    The directory is opened once and everything is read through that handle, so the
    manifest and the stripes come from the same checkpoint even if the path is swapped
    by an overwrite (or renamed) while the load runs.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(2, "checkpoint directory not found", path)
    dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    base = f"/proc/self/fd/{dirfd}"
    try:
        if not os.path.isdir(base):  # no /proc: fall back to the path itself
            base = path
        return _read_tensors(path, base, **options)
    except OSError as e:
        if base != path and isinstance(e.filename, str) and e.filename.startswith(base + "/"):
            e.filename = path + e.filename[len(base):]  # name the user's path, not the handle
        raise
    finally:
        os.close(dirfd)


def _read_tensors(path: str, base: str, **options: Any) -> LoadResult:
    return read_described(path, base, read_manifest(base, shown=path), **options)


def read_described(path: str, base: str, m: Manifest, *, verify: bool = True, backend: str = "auto",
                   direct: bool = True, queue_depth: int = DEFAULT_READ_QUEUE_DEPTH, keys: set[str] | None = None,
                   device_targets: Callable[[Manifest], dict[str, torch.Tensor]] | None = None,
                   zero_copy: bool = True, check_headers: bool = True) -> LoadResult:
    """Read the stripes that ``m`` describes from ``base`` (messages name ``path``).
    check_headers: cross-check each stripe's safetensors header with ``m`` (off for
    foreign files, whose headers ``m`` was made from; their tensors may sit at any
    offset, so they are always copied out: zero_copy must be False)."""
    wanted = set(m.tensors) if keys is None else keys
    file_ids = sorted({m.tensors[k].file for k in wanted}) if keys is not None else list(range(len(m.files)))
    slot = {fi: i for i, fi in enumerate(file_ids)}
    specs = []
    for fi in file_ids:
        fe = m.files[fi]
        full = os.path.join(base, fe.name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"stripe {fe.name} is missing from {path}", file=fe.name) from None
        if not stat.S_ISREG(st.st_mode):  # a symlink may lead out of the checkpoint; a directory is no stripe
            raise UnsafeCheckpointError(f"stripe {fe.name} in {path} is not a regular file", file=fe.name)
        size = st.st_size
        if size != fe.size:
            what = "truncated" if size < fe.size else "longer than recorded"
            raise CorruptCheckpointError(f"stripe {fe.name} is {size} bytes, the manifest says {fe.size} ({what})",
                                         file=fe.name)
        specs.append((full, fe.size))
    pieces: list[tuple[int, int, int, int]] = []
    owners: list[str] = []
    if verify:
        for k in wanted:
            e = m.tensors[k]
            for (off, n), h in zip(piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums):
                pieces.append((slot[e.file], off, n, int(h, 16)))
                owners.append(k)
    targets = {k: t for k, t in (device_targets(m) if device_targets else {}).items() if k in wanted}
    placements: list[tuple[int, int, int, int, int]] = []
    for k, t in targets.items():
        e = m.tensors[k]
        if t.device.type != "cuda" or not t.is_contiguous() or t.numel() * t.element_size() != e.nbytes:
            raise ValueError(f"device target for {k!r} must be a contiguous CUDA tensor of {e.nbytes} bytes")
        if e.nbytes:
            placements.append((slot[e.file], e.offset, e.nbytes, t.device.index, t.data_ptr()))
    streams = _cuda.current_streams(p[3] for p in placements) if placements else []
    t0 = time.perf_counter()
    # `targets` keeps the destinations alive until the job is done.
    job = _core.start_load(specs, pieces, backend, queue_depth, _read_chunk(m.block_bytes),
                           max(1, min(4, len(os.sched_getaffinity(0)))), direct, placements=placements,
                           streams=streams)
    job.wait()
    job.rethrow()
    bad = job.mismatches()
    if bad:
        pi, actual = bad[0]
        fi, off, n, expected = pieces[pi]
        key = owners[pi]
        fe = m.files[file_ids[fi]]
        e = m.tensors[key]
        more = f" ({len(bad) - 1} more damaged pieces)" if len(bad) > 1 else ""
        raise ChecksumMismatchError(
            f"checksum mismatch in {fe.name}, tensor {key!r}, bytes {off - e.offset}..{off - e.offset + n} of the "
            f"tensor (file offset {off}): expected {expected:016x}, got {actual:016x}{more}",
            file=fe.name, tensor=key, offset=off, expected=f"{expected:016x}", actual=f"{actual:016x}")
    buffers = job.buffers()
    bases = {}
    for i, fi in enumerate(file_ids):
        buf = buffers[i]
        fe = m.files[fi]
        if check_headers:
            check_stripe_header(memoryview(buf)[: fe.header_bytes], fe,
                                [e for e in m.tensors.values() if e.file == fi])
        bases[fi] = torch.frombuffer(buf, dtype=torch.uint8)
    tensors = {}
    for k, t in targets.items():
        _cuda.mark_written(t)
        tensors[k] = t
    by_file: dict[int, list[str]] = {}
    for k in wanted:
        e = m.tensors[k]
        if k in targets:
            continue
        if e.nbytes == 0:
            tensors[k] = torch.empty(0, dtype=torch.uint8).view(dtypes.dtype_from_name(e.dtype)).reshape(e.shape)
        else:
            by_file.setdefault(e.file, []).append(k)
    backend_used, direct_used = job.backend, job.files_direct == len(file_ids)
    del job, buffers  # from here the bases own the read buffers
    for fi, keys_in_file in by_file.items():
        stripe = bases.pop(fi)
        for k in keys_in_file:
            e = m.tensors[k]
            raw = stripe[e.offset:e.offset + e.nbytes]
            if not zero_copy:
                raw = torch.empty(e.nbytes, dtype=torch.uint8).copy_(raw)
            tensors[k] = raw.view(dtypes.dtype_from_name(e.dtype)).view(e.shape)
        del stripe  # copied out: its buffer goes now, not at the end of the load
    return LoadResult(m, tensors, time.perf_counter() - t0, backend_used, direct_used)


def load(path: str | os.PathLike, map_location: Any = "cpu", into: Any = None, verify: bool = True, *,
         allow_pickle: bool = False, strict: bool = True, backend: str = "auto", direct: bool = True,
         queue_depth: int = DEFAULT_READ_QUEUE_DEPTH, process_group: Any = None, zero_copy: bool = False) -> Any:
    """Load a checkpoint and return the nested structure that was saved.

    ``path`` may also be plain safetensors that flashwrite did not write: a
    ``.safetensors`` file, a directory with a Hugging Face ``*.safetensors.index.json``,
    or a directory of ``*.safetensors`` files. That returns the flat ``{name: tensor}``
    dict ``safetensors.torch.load_file`` would (merged across shards), read by the same
    engine (to CPU, or straight to a GPU with map_location).

    map_location: "cpu" (default), a device, a {saved_device: device} dict, or None
    for the devices they were saved from.
    zero_copy: CPU tensors are views of the page-aligned read buffers instead of
    owning their memory: no second copy, but any one tensor keeps its whole stripe
    file's buffer alive, and offset views upset APIs that ignore storage offsets
    (``torch.set_rng_state``). For inference-style loads that keep the whole state.
    into: an existing (nested) state dict; its tensors are filled in place and it is
    returned. strict: with into, every saved tensor must have a destination.
    CUDA destinations are filled chunk by chunk, each chunk verified before it is
    copied: if the load fails part way (a damaged chunk, an I/O error), some GPU
    destinations may already hold the new values while others keep the old ones.
    verify: check every byte against the save-time checksums.
    allow_pickle: unpickle objects saved with allow_pickle=True (executes code:
    only for trusted checkpoints).
    process_group: return this rank's state of a checkpoint saved by every rank of
    a group of the same size (reading only its stripes). Without it, a multi-rank
    checkpoint loads as ``{rank: state}``.
    """
    if foreign.is_foreign(os.fspath(path)):
        if into is not None or process_group is not None:
            raise ValueError(f"{os.fspath(path)} is plain safetensors (not a flashwrite checkpoint): load it without "
                             "into= or process_group=")
        return _load_foreign(os.fspath(path), map_location, verify=verify, backend=backend, direct=direct,
                             queue_depth=queue_depth)
    if process_group is not None:
        from . import distributed
        return distributed.load(path, process_group=process_group, map_location=map_location, into=into,
                                verify=verify, allow_pickle=allow_pickle, strict=strict, backend=backend,
                                direct=direct, queue_depth=queue_depth, zero_copy=zero_copy)
    res = read_tensors(path, verify=verify, backend=backend, direct=direct, queue_depth=queue_depth,
                       device_targets=_into_targets(into) if into is not None else _map_targets(map_location),
                       zero_copy=zero_copy or into is not None)
    if into is not None:
        return _load_into(res, into, strict, allow_pickle)
    return unflatten(res.manifest.tree, tensor_placer(res, map_location), allow_pickle=allow_pickle)


def _load_foreign(path: str, map_location: Any, *, verify: bool, **read_options: Any) -> dict:
    """The flat {name: tensor} of plain safetensors files, like safetensors.torch.load_file's
    (merged across shards). They carry no checksums: verify has nothing to check."""
    directory, m = foreign.describe(path)
    dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        base = f"/proc/self/fd/{dirfd}"
        res = read_described(path, base if os.path.isdir(base) else directory, m, verify=False,
                             check_headers=False, zero_copy=False, device_targets=_map_targets(map_location),
                             **read_options)
    finally:
        os.close(dirfd)
    place = tensor_placer(res, map_location)
    return {k: place(k) for k in m.tensors}


def tensor_placer(res: LoadResult, map_location: Any = "cpu") -> Callable[[str], torch.Tensor]:
    """The tree's tensor lookup: each stored tensor on the device map_location picks for
    it (moved once, so tied weights stay one tensor); unknown keys are corruption."""
    placed: dict[str, torch.Tensor] = {}

    def tensor_for(key: str) -> torch.Tensor:
        if key not in res.tensors:
            raise CorruptCheckpointError(f"manifest tree refers to unknown tensor {key!r}", file="flashwrite.json",
                                         tensor=key)
        if key not in placed:
            t = res.tensors[key]
            dev = _device_for(res.manifest.tensors[key].device, map_location)
            placed[key] = t if dev.type == "cpu" else t.to(dev)
        return placed[key]

    return tensor_for


def _device_empty(e: Any, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for stored entry ``e`` on ``device``, allocated as bytes and
    viewed as its dtype, so dtypes with no CUDA kernels (bits8, uint3, ...) work too."""
    raw = torch.empty(e.nbytes, dtype=torch.uint8, device=device)
    return raw.view(dtypes.dtype_from_name(e.dtype)).view(e.shape)


def _map_targets(map_location: Any) -> Callable[[Manifest], dict[str, torch.Tensor]]:
    """New tensors for every stored tensor that map_location sends to a CUDA device."""

    def targets(m: Manifest) -> dict[str, torch.Tensor]:
        out = {}
        for k, e in m.tensors.items():  # empty ones too: no dtype kernel is needed to make them
            dev = _device_for(e.device, map_location)
            if _cuda.uses_native(dev):
                out[k] = _device_empty(e, dev)
        return out

    return targets


def _into_targets(into: Any) -> Callable[[Manifest], dict[str, torch.Tensor]]:
    """The CUDA tensors of ``into`` that the native engine fills in place: the destination
    itself where it is contiguous with the stored dtype, else a new tensor of the stored
    dtype on its device that ``_load_into`` copies (and converts) from on the GPU."""

    def targets(m: Manifest) -> dict[str, torch.Tensor]:
        _, dst_flat, _ = flatten(into, allow_pickle=True)
        out = {}
        for ft in dst_flat:
            e, d = m.tensors.get(ft.key), ft.tensor
            if e is None or not e.nbytes or not _cuda.uses_native(d):
                continue
            if tuple(d.shape) != tuple(e.shape):  # before any byte moves
                raise ValueError(f"load(into=...): {ft.key} has shape {tuple(e.shape)} in the checkpoint, "
                                 f"{tuple(d.shape)} in the destination")
            dt = dtypes.dtype_from_name(e.dtype)
            if d.dtype == dt and d.is_contiguous() and not d.is_conj() and not d.is_neg():
                out[ft.key] = d
            else:
                out[ft.key] = _device_empty(e, d.device)
        return out

    return targets


def _load_into(res: LoadResult, into: Any, strict: bool, allow_pickle: bool) -> Any:
    m = res.manifest
    # As read (CPU views, or GPU destinations filled in place): the copies below place them.
    saved = unflatten(m.tree, tensor_placer(res, "cpu"), allow_pickle=allow_pickle)
    _, dst_flat, dst_alias = flatten(into, allow_pickle=True)
    _, src_flat, src_alias = flatten(saved, allow_pickle=True)
    dst = {ft.key: ft.tensor for ft in dst_flat}
    src = {ft.key: ft.tensor for ft in src_flat}
    missing = sorted(set(src) - set(dst) - set(dst_alias))
    if strict and missing:
        raise KeyError(f"load(into=...): the checkpoint has tensors with no destination: {missing[:10]}")
    for k, s in src.items():
        d = dst.get(k)
        if d is None:
            continue
        if s is d:
            continue  # filled in place by the native engine (a GPU destination)
        if d.shape != s.shape:
            raise ValueError(f"load(into=...): {k} has shape {tuple(s.shape)} in the checkpoint, "
                             f"{tuple(d.shape)} in the destination")
        with torch.no_grad():
            d.copy_(s)
    _copy_leaves(saved, into)
    return into


def _copy_leaves(src: Any, dst: Any) -> None:
    """Non-tensor leaves (step counters, hyper-parameters) are assigned into mutable containers."""
    if isinstance(src, dict) and isinstance(dst, dict):
        for k, v in src.items():
            if k in dst and isinstance(dst[k], (dict, list)):
                _copy_leaves(v, dst[k])
            elif not isinstance(v, (torch.Tensor, dict, list, tuple)):
                dst[k] = v
    elif isinstance(src, list) and isinstance(dst, list):
        for i, v in enumerate(src[: len(dst)]):
            if isinstance(dst[i], (dict, list)):
                _copy_leaves(v, dst[i])
            elif not isinstance(v, (torch.Tensor, dict, list, tuple)):
                dst[i] = v


_load_pool: concurrent.futures.ThreadPoolExecutor | None = None
_load_pool_lock = threading.Lock()


def load_async(path: str | os.PathLike, **kwargs: Any) -> concurrent.futures.Future:
    """``load`` on a background thread; returns a concurrent.futures.Future."""
    global _load_pool
    with _load_pool_lock:
        if _load_pool is None:
            _load_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="flashwrite-load")
    return _load_pool.submit(load, path, **kwargs)


def verify(path: str | os.PathLike) -> dict:
    """Check a checkpoint offline: manifest, stripe sizes and headers, every checksum.
    Raises CorruptCheckpointError (naming file and tensor) or returns a summary."""
    res = read_tensors(path, verify=True)
    m = res.manifest
    return {"path": os.fspath(path), "files": len(m.files), "tensors": len(m.tensors),
            "bytes": sum(f.size for f in m.files), "writer_version": m.writer_version, "seconds": res.elapsed_s}
