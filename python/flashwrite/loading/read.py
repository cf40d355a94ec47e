"""Read (native, parallel, O_DIRECT) -> verify (native, overlapped) -> place.

``CheckpointDir`` opens a checkpoint directory once and reads everything through
that handle: its manifest is parsed once, and every read of its stripes uses the
same handle, so manifest and stripes come from the same checkpoint even if the
path is swapped by an overwrite (or renamed) meanwhile. ``load_state`` is the one
load behind ``flashwrite.load`` on one rank and many.

CPU tensors come back owning their memory, like ``torch.load``'s: each has a
storage of exactly its bytes at offset 0, allocated here and filled by the native
job, which reads through bounce buffers and copies each verified chunk out on its
own threads while later reads are in flight (no whole-stripe buffer is held). With
``zero_copy=True`` they are views of whole-stripe buffers instead (one buffer per
stripe, filled through the same bounce slots; one tensor keeps its whole stripe's
buffer alive). ``into=`` fills existing CPU tensors the same way where they are
contiguous and of the stored dtype (others get a copy). Tensors bound for CUDA devices
are read into pinned bounce buffers and copied host-to-device by the native
engine chunk by chunk, each chunk verified first (see ``cuda.py``); other
devices get a copy.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator

import torch

from .. import _core, defaults
from ..format import dtypes
from . import foreign, read_plan
from ..system import gcpause
from ..system import cuda as _cuda
from ..errors import CorruptCheckpointError
from ..state.flatten import FlatTensor, flatten, unflatten
from ..format import Manifest, TensorEntry, read_manifest, select_rank
from ..format.hints import not_a_checkpoint
from ..format.codec import is_compressed
from ..future import reap_later
from .read_plan import stored_dtype
from ..targets.locate import Located
from ..targets.target import local_path

__all__ = ["LoadResult", "CheckpointDir", "read_tensors", "load_state", "tensor_placer"]


def _read_chunk(block: int) -> int:
    # A multiple of the checksum block, so every checksummed piece lies inside one read.
    return block * max(1, defaults.READ_CHUNK_BYTES // block)


def _device_for(entry_device: str, map_location: Any) -> torch.device:
    if map_location is None:
        return torch.device(entry_device)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(entry_device, entry_device))
    if callable(map_location):
        # torch.load's convention: map_location(storage, location) returns the storage where
        # it is to live, or None for where it was saved. Asked with an empty CPU storage,
        # once per saved device (the callers cache the answer): where that storage lives.
        moved = map_location(torch.UntypedStorage(0), entry_device)
        if moved is None:
            return torch.device(entry_device)
        dev = getattr(moved, "device", moved)
        return torch.device(dev)
    return torch.device(map_location)


class LoadResult:
    """Tensors of one checkpoint, keyed by stored name, plus the manifest."""

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], elapsed_s: float, backend: str,
                 direct: bool, received_uncopied: int = 0):
        self.manifest = manifest
        self.tensors = tensors
        self.elapsed_s = elapsed_s
        self.backend = backend
        self.direct = direct
        # nfs://: bytes the READ replies put straight into slots and tensors (nfs_wire.hpp)
        self.received_uncopied = received_uncopied


class CheckpointDir:
    """A checkpoint directory opened once: ``manifest`` is parsed on opening, and
    ``read`` reads stripes through the same directory handle (any number of times)."""

    def __init__(self, path: str | os.PathLike | Located,
                 describe: Callable[[str, str], Manifest] | None = None, what: str = "load"):
        """describe(base, shown): the manifest of the directory opened at ``base`` (messages
        name ``shown``); by default its flashwrite.json, or e.g. ``foreign.describe``.
        ``path`` may be a ``Located`` (``targets.locate``): on a target whose paths are not
        this machine's, the manifest is read through it and the stripes by their names
        there, through its ``native_files()``."""
        self._fd = -1
        self.files: object | None = None  # what the load job reads the stripes through (None: local files)
        self.target = None
        if isinstance(path, Located) and not path.target.os_paths:
            self.path, self.base, self.target = path.given, path.path, path.target
            self.files = path.target.native_files()
            self.manifest = describe(self.base, self.path) if describe else path.read_manifest(what)
            return
        describe = describe or (lambda base, shown: read_manifest(base, shown=shown))
        self.path = local_path(path, "read")
        if not os.path.isdir(self.path):
            raise not_a_checkpoint(self.path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.base = f"/proc/self/fd/{self._fd}"
        try:
            if not os.path.isdir(self.base):  # no /proc: fall back to the path itself
                self.base = self.path
            with self._user_paths():
                self.manifest = describe(self.base, self.path)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def _user_paths(self) -> Iterator[None]:
        """OS errors name the user's path, not the handle."""
        try:
            yield
        except OSError as e:
            base = self.base
            if base != self.path and isinstance(e.filename, str) and e.filename.startswith(base + "/"):
                e.filename = self.path + e.filename[len(base):]
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def read(self, *, manifest: Manifest | None = None, keys: set[str] | None = None, verify: bool = True,
             backend: str = "auto", direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH,
             device_targets: dict[str, torch.Tensor] | None = None, zero_copy: bool = True,
             host_targets: dict[str, torch.Tensor] | None = None,
             owned_into: dict[str, torch.Tensor] | None = None) -> LoadResult:
        """Read and verify the stripes holding ``keys`` (default: every tensor); return CPU
        tensors that view whole-stripe read buffers (zero_copy) or own their bytes (filled
        by the native job out of its bounce buffers).

        manifest: what the result carries as its manifest (default ``self.manifest``; a
        view of it such as ``select_rank``'s). device_targets may name, per key, a
        contiguous CUDA tensor of the stored dtype and size to receive that tensor's
        bytes: they are then copied there by the native engine through pinned bounce
        buffers (verified chunk by chunk before the copy) and never held in host memory
        as a whole. host_targets may name, per key, a contiguous CPU tensor of the stored
        dtype and size that the native job fills in place (``load(into=)``): each verified
        chunk is copied there from its bounce slot, so no second buffer or pass is made.
        The destinations must not overlap one another. owned_into (not with zero_copy):
        for keys read straight into their memory (``read_plan.reads_direct``), the tensors
        to read into and return (``read_plan.place_owned``).
        """
        with self._user_paths():
            return self._read(manifest or self.manifest, keys, verify, backend, direct, queue_depth,
                              device_targets or {}, zero_copy, host_targets or {}, owned_into)

    def _read(self, shown_manifest: Manifest, keys: set[str] | None, verify: bool, backend: str, direct: bool,
              queue_depth: int, device_targets: dict[str, torch.Tensor], zero_copy: bool,
              host_targets: dict[str, torch.Tensor], owned_into: dict[str, torch.Tensor] | None = None) -> LoadResult:
        with gcpause.paused():  # per-tensor work on both sides of the wait: see gcpause
            m = self.manifest
            wanted = set(m.tensors) if keys is None else keys
            file_ids = sorted({m.tensors[k].file for k in wanted}) if keys is not None else list(range(len(m.files)))
            slot = {fi: i for i, fi in enumerate(file_ids)}
            specs = read_plan.stripe_specs(m, file_ids, self.base, self.path, self.target)
            pieces, owners = read_plan.checksum_pieces(m, wanted, slot) if verify else ([], [])
            targets = {k: t for k, t in device_targets.items() if k in wanted}
            hosted = {k: t for k, t in host_targets.items() if k in wanted and k not in targets}
            scatter, placements = read_plan.target_placements(m, slot, targets, hosted)
            gpu = scatter.placements  # the device placements come first
            streams = _cuda.current_streams(p[3] for p in gpu) if gpu else []
            # Owned CPU tensors, and each stripe's header (checked against the manifest below),
            # are placed too: a stripe whose every byte is placed is never held whole.
            owned: dict[str, torch.Tensor] = {}
            headers: dict[int, torch.Tensor] = {}
            stripes: dict[int, torch.Tensor] = {}
            # A compressed stripe is read chunk by chunk as it was framed (chunk = checksum block).
            frames = [list(m.files[fi].frames) for fi in file_ids] if is_compressed(m) else []
            if zero_copy:
                read_plan.place_stripes(m, file_ids, slot, placements, stripes)
            else:
                # Large tensors are read straight into their own memory: no copy out of a bounce slot
                # (nfs://: the READ replies are copied there, not to a slot first).
                read_plan.place_owned(m, wanted, file_ids, slot, targets, hosted, placements, owned, headers,
                                      direct=not frames, owned_into=owned_into)
            t0 = time.perf_counter()
            # The job holds `targets`, `hosted`, `owned`, `headers` and `stripes` (the destinations) until it
            # is joined, whatever order an interrupted frame frees its locals in.
            job = _core.start_load(specs, pieces, backend, queue_depth,
                                   m.block_bytes if frames else _read_chunk(m.block_bytes),
                                   defaults.VERIFY_THREADS, direct, placements=placements,
                                   streams=streams, remote=self.files,  # the target's native_files()
                                   keepalive=(targets, hosted, owned, headers, stripes), frames=frames)
        try:
            job.wait()
        except BaseException:
            # Interrupted: the wait raised once no destination is written any more, but
            # reads may still be in flight into the job's own buffers. A thread joins the
            # job (and only then lets go of it and of the destinations it holds), so the
            # caller need not wait for them; the interpreter's exit waits for that thread.
            reap_later(job)
            raise
        with gcpause.paused():
            job.rethrow()
            bad = job.mismatches()
            if bad:
                raise read_plan.mismatch(m, file_ids, pieces, owners, bad)
            bases = read_plan.checked_bases(m, file_ids, job.buffers(), headers, stripes)
            backend_used, direct_used = job.backend, job.files_direct == len(file_ids)
            uncopied = job.received_uncopied
            del job  # from here the bases own the read buffers
            tensors = {}
            scatter.finish()
            for k, t in (*targets.items(), *hosted.items()):
                _cuda.mark_written(t)
                tensors[k] = t
            for k in wanted:
                if k in targets or k in hosted:
                    continue
                t = owned.get(k)
                if t is None:
                    e = m.tensors[k]
                    raw = bases[e.file][e.offset:e.offset + e.nbytes] if e.nbytes else torch.empty(0, dtype=torch.uint8)
                    t = raw.view(stored_dtype(e.dtype)).view(e.shape)
                tensors[k] = t
        return LoadResult(shown_manifest, tensors, time.perf_counter() - t0, backend_used, direct_used, uncopied)


def read_tensors(path: str | os.PathLike, *, keys: set[str] | None = None, verify: bool = True,
                 backend: str = "auto", direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH,
                 device_targets: Callable[[Manifest], dict[str, torch.Tensor]] | None = None,
                 zero_copy: bool = True) -> LoadResult:
    """Open ``path`` and read (a subset of) its tensors once: ``CheckpointDir.read``, with
    device_targets computed from the checkpoint's manifest."""
    with CheckpointDir(path) as ck:
        return ck.read(keys=keys, verify=verify, backend=backend, direct=direct, queue_depth=queue_depth,
                       device_targets=device_targets(ck.manifest) if device_targets else None, zero_copy=zero_copy)


def load_state(path: str | os.PathLike, *, rank: tuple[int, int] | None = None, map_location: Any = "cpu",
               into: Any = None, verify: bool = True, allow_pickle: bool = False, strict: bool = True,
               backend: str = "auto", direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH,
               zero_copy: bool = False) -> Any:
    """The nested structure saved at ``path`` (see ``flashwrite.load``); with ``rank`` =
    (rank, group size), that rank's state of a multi-rank checkpoint, reading only its
    stripes. One manifest read, through the directory handle the stripes are read by."""
    with CheckpointDir(path) as ck:
        m, keys = ck.manifest, None
        if rank is not None:
            m, keys = select_rank(m, rank[0], rank[1], shown=ck.path)
        # A rank's tensors were stored under the keys of {rank: state}: match `into` by those.
        wrap: Callable[[Any], Any] = (lambda x: x) if keys is None else (lambda x: {rank[0]: x})
        into_flat = flatten(wrap(into), allow_pickle=True) if into is not None else None
        hosted: dict[str, torch.Tensor] = {}
        if into_flat is not None:
            targets = _into_targets(into_flat[1], m, keys)
            hosted = _into_host_targets(into_flat[1], m, keys)
        else:
            targets = _map_targets([m.tensors[k] for k in (m.tensors if keys is None else sorted(keys))], map_location)
        # into=: the destinations that can take the bytes are filled by the native job;
        # the rest (other dtypes, strided) come as owned tensors that fill_into copies,
        # so no stripe is held whole.
        res = ck.read(manifest=m, keys=keys, verify=verify, backend=backend, direct=direct, queue_depth=queue_depth,
                      device_targets=targets, zero_copy=zero_copy, host_targets=hosted)
    if into_flat is not None:
        return fill_into(res, into, into_flat, wrap, strict, allow_pickle)
    with gcpause.paused():
        return unflatten(m.tree, tensor_placer(res, map_location), allow_pickle=allow_pickle)


def load_foreign(path: str | Located, *, map_location: Any = "cpu", backend: str = "auto", direct: bool = True,
                 queue_depth: int = defaults.READ_QUEUE_DEPTH) -> dict[str, torch.Tensor]:
    """The flat {name: tensor} of plain safetensors at ``path`` (see ``foreign``), like
    ``safetensors.torch.load_file``'s merged across shards. No checksums to verify; each
    tensor's bytes are copied out by the native job (its data may sit at any offset) or
    placed on its GPU."""
    if isinstance(path, Located):  # a directory on a target whose paths are not this machine's
        where: Any = path
        describe = lambda base, shown: foreign.describe_on(path.target, base, shown)  # noqa: E731
    else:
        where, names = foreign.locate(path)
        from_index = foreign.indexed_dir(path) is not None
        describe = lambda base, shown: foreign.describe(base, shown, names, from_index)  # noqa: E731
    with CheckpointDir(where, describe) as ck:
        m = ck.manifest
        res = ck.read(verify=False, backend=backend, direct=direct, queue_depth=queue_depth, zero_copy=False,
                      device_targets=_map_targets(list(m.tensors.values()), map_location))
    place = tensor_placer(res, map_location)
    return {k: place(k) for k in m.tensors}


def tensor_placer(res: LoadResult, map_location: Any = "cpu") -> Callable[[str], torch.Tensor]:
    """The tree's tensor lookup: each stored tensor on the device map_location picks for
    it (moved once, so tied weights stay one tensor); unknown keys are corruption."""
    placed: dict[str, torch.Tensor] = {}
    devices: dict[str, torch.device] = {}  # stored device name -> where it goes

    def tensor_for(key: str) -> torch.Tensor:
        t = placed.get(key)
        if t is not None:
            return t
        t = res.tensors.get(key)
        if t is None:
            raise CorruptCheckpointError(f"manifest tree refers to unknown tensor {key!r}", file="flashwrite.json",
                                         tensor=key)
        stored = res.manifest.tensors[key].device
        dev = devices.get(stored)
        if dev is None:
            dev = devices[stored] = _device_for(stored, map_location)
        placed[key] = t = t if dev.type == "cpu" else t.to(dev)
        return t

    return tensor_for


def _device_empty(e: TensorEntry, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for stored entry ``e`` on ``device``, allocated as bytes and
    viewed as its dtype, so dtypes with no CUDA kernels (bits8, uint3, ...) work too."""
    raw = torch.empty(e.nbytes, dtype=torch.uint8, device=device)
    return raw.view(dtypes.dtype_from_name(e.dtype)).view(e.shape)


def _map_targets(entries: list[TensorEntry], map_location: Any) -> dict[str, torch.Tensor]:
    """New tensors for every stored tensor (of those read) that map_location sends to a CUDA device."""
    devices: dict[str, torch.device] = {}  # saved device -> where it goes (a callable is asked once)
    sent: list[tuple[TensorEntry, torch.device]] = []
    for e in entries:  # empty ones too: no dtype kernel is needed to make them
        dev = devices.get(e.device)
        if dev is None:
            dev = devices[e.device] = _device_for(e.device, map_location)
        if _cuda.uses_native(dev):
            sent.append((e, dev))
    return run_targets(sent, defaults.GATHER_TENSOR_BYTES, defaults.GATHER_RUN_BYTES)


def run_targets(sent: list[tuple[TensorEntry, torch.device]], max_tensor: int, max_run: int) -> dict[str, torch.Tensor]:
    """New tensors for ``sent`` (entry, device): small ones that lie back to back in a
    stripe (the gather's runs) are views of one allocation laid out as the stripe is, so
    the load places each run straight into it (``Scatter`` sees them contiguous) instead
    of through a gather buffer as large beside them; every other one is its own."""
    out: dict[str, torch.Tensor] = {}
    ids: dict[torch.device, int] = {}  # the gather's device key: one per device as given
    items = [(None, e.nbytes, e.file, e.offset, ids.setdefault(dev, len(ids))) for e, dev in sent if e.nbytes]
    big = [(e, dev) for e, dev in sent if e.nbytes]
    for group in _cuda.gather_runs(items, max_tensor, max_run) if items else []:
        if len(group) < 2:
            continue
        first, dev = big[group[0]]
        total = sum(big[i][0].nbytes for i in group)
        try:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError:
            continue  # each on its own, below
        for i in group:
            e = big[i][0]
            at = e.offset - first.offset
            dt = dtypes.dtype_from_name(e.dtype)
            if at % max(1, dtypes.itemsize(dt)) == 0:
                out[e.key] = buf[at:at + e.nbytes].view(dt).view(e.shape)
    for e, dev in sent:
        if e.key not in out:
            out[e.key] = _device_empty(e, dev)
    return out


def _into_targets(dst_flat: list[FlatTensor], m: Manifest, keys: set[str] | None) -> dict[str, torch.Tensor]:
    """The CUDA tensors of ``into`` that the native engine fills in place: the destination
    itself where it is contiguous with the stored dtype, else a new tensor of the stored
    dtype on its device that ``fill_into`` copies (and converts) from on the GPU."""
    out = {}
    for ft in dst_flat:
        e, d = m.tensors.get(ft.key), ft.tensor
        if e is None or (keys is not None and ft.key not in keys) or not e.nbytes or not _cuda.uses_native(d):
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


def _into_host_targets(dst_flat: list[FlatTensor], m: Manifest, keys: set[str] | None) -> dict[str, torch.Tensor]:
    """The CPU tensors of ``into`` that the native job fills in place: contiguous, of the
    stored dtype and shape, and sharing no bytes with another destination (those, like
    the rest, are filled by ``fill_into``'s copies, in order)."""
    out, spans = {}, []
    for ft in dst_flat:
        e, d = m.tensors.get(ft.key), ft.tensor
        if e is None or (keys is not None and ft.key not in keys) or d.device.type != "cpu":
            continue
        if tuple(d.shape) != tuple(e.shape):  # before any byte moves
            raise ValueError(f"load(into=...): {ft.key} has shape {tuple(e.shape)} in the checkpoint, "
                             f"{tuple(d.shape)} in the destination")
        if (not e.nbytes or d.dtype != stored_dtype(e.dtype) or not d.is_contiguous() or d.is_conj()
                or d.is_neg() or type(d) not in (torch.Tensor, torch.nn.Parameter)):
            continue
        out[ft.key] = d
        spans.append((d.data_ptr(), d.data_ptr() + e.nbytes, ft.key))
    spans.sort()
    end, prev = -1, None
    for a, b, k in spans:  # destinations that overlap another: copied in Python instead
        if a < end:
            out.pop(k, None)
            if prev is not None:
                out.pop(prev, None)
        if b > end:
            end, prev = b, k
    return out


def fill_into(res: LoadResult, into: Any, into_flat: tuple, wrap: Callable[[Any], Any], strict: bool,
              allow_pickle: bool) -> Any:
    """Copy what was read into ``into`` (whose flattening, of ``wrap(into)``, is ``into_flat``)."""
    m = res.manifest
    # As read (CPU views, or GPU destinations filled in place): the copies below place them.
    saved = unflatten(m.tree, tensor_placer(res, "cpu"), allow_pickle=allow_pickle)
    _, dst_flat, dst_alias = into_flat
    _, src_flat, src_alias = flatten(wrap(saved), allow_pickle=True)
    dst = {ft.key: ft.tensor for ft in dst_flat}
    src = {ft.key: ft.tensor for ft in src_flat}
    missing = sorted(set(src) - set(dst) - set(dst_alias))
    if strict and missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise KeyError(f"load(into=...): {len(missing)} tensor(s) of the checkpoint have no destination in into: "
                       f"{missing[:10]}{more}; pass strict=False to load the others and leave these out")
    for k, s in src.items():
        d = dst.get(k)
        if d is None:
            continue
        if s is d or (s.data_ptr() == d.data_ptr() and s.dtype == d.dtype and s.shape == d.shape
                      and s.stride() == d.stride() and s.device == d.device):
            continue  # filled in place by the native engine
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
