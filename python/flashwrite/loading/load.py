"""Load: the public ``load``, ``load_async`` and ``verify``.

``load`` reads on one rank, or (``process_group=``) this rank's part of a
multi-rank checkpoint; both go through ``read.load_state`` (see ``read.py`` for
the data path).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any

from .. import defaults
from . import foreign
from ..system import gcpause
from ..errors import CorruptCheckpointError
from ..state.flatten import referenced_keys
from ..format import MANIFEST_NAME
from ..future import LoadFuture, LoadStats, launch_load
from ..system.replicas import layout_for_load
from .replicas import load_replicated
from .read import CheckpointDir, LoadResult, load_foreign, load_state, read_tensors
from ..targets.locate import Located, kind_of, locate
from ..targets.target import shown

__all__ = ["load", "load_async", "verify", "read_tensors", "LoadResult", "LoadFuture", "LoadStats"]


def load(path: str | os.PathLike, map_location: Any = "cpu", into: Any = None, verify: bool = True, *,
         allow_pickle: bool = False, strict: bool = True, backend: str = "auto", direct: bool = True,
         queue_depth: int = defaults.READ_QUEUE_DEPTH, process_group: Any = None, zero_copy: bool = False,
         replica_group: Any = None, timeout: float | None = None) -> Any:
    """Load a checkpoint and return the nested structure that was saved.

    ``path`` may also be plain safetensors that flashwrite did not write: a
    ``.safetensors`` file, a directory with a Hugging Face ``*.safetensors.index.json``
    (or that index file itself: the shards it lists), or a directory of ``*.safetensors``
    files. A flashwrite checkpoint's own ``model.safetensors.index.json`` stands for its
    directory. That returns the flat ``{name: tensor}``
    dict ``safetensors.torch.load_file`` would (merged across shards), read by the same
    engine (to CPU, or straight to a GPU with map_location).

    map_location: "cpu" (default), a device, a {saved_device: device} dict, None
    for the devices they were saved from, or a callable as torch.load takes:
    ``map_location(storage, location)`` returning the storage moved where it is to
    live (or None: where it was saved), asked once per saved device.
    zero_copy: CPU tensors are views of one buffer per stripe file instead of
    owning their memory: fewer allocations, but any one tensor keeps its whole stripe
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
    replica_group: the ranks whose state is identical to this rank's (implies a
    multi-rank load, on process_group or the world): each stored byte the group needs
    is read from storage once, by one of its ranks, and exchanged over flashwrite's own
    gloo group for it, verified where it lands (``loading/replicas.py``). Works for any
    multi-rank checkpoint, whatever replica layout saved it. timeout: with replica_group,
    how long a rank waits for a silent peer (default ``DEFAULT_TIMEOUT_S``).
    """
    where = path if isinstance(path, Located) else locate(path, "load")  # the one check of the path
    options = dict(map_location=map_location, into=into, verify=verify, allow_pickle=allow_pickle, strict=strict,
                   backend=backend, direct=direct, queue_depth=queue_depth, zero_copy=zero_copy)
    # One pause of the collector for the whole load (one collection after it, not one
    # per stage): a state of 100,000 tensors is 100,000s of new objects (see gcpause).
    with gcpause.paused():
        if replica_group is not None:
            return load_rank(where if not where.target.os_paths else where.given, process_group=process_group,
                             replica_group=replica_group, timeout=timeout, **options)
        if timeout is not None:
            raise ValueError("timeout= applies to loads with replica_group=")
        return _load(where, process_group, options)


def _load(where: Located, process_group: Any, options: dict) -> Any:
    map_location, into, backend, direct, queue_depth = (options[k] for k in ("map_location", "into", "backend",
                                                                                "direct", "queue_depth"))
    if not where.target.os_paths:  # read through its target
        if foreign.is_foreign_on(where.target, where.path):
            if into is not None or process_group is not None:
                raise ValueError(f"{where.given} is plain safetensors, not a flashwrite checkpoint: load it without "
                                 "into= or process_group=")
            return load_foreign(where, map_location=map_location, backend=backend, direct=direct,
                                queue_depth=queue_depth)
        if process_group is not None:
            return load_rank(where, process_group=process_group, **options)
        return load_state(where, **options)
    path = where.given
    indexed = foreign.indexed_dir(os.fspath(path))
    if indexed is not None and os.path.lexists(os.path.join(indexed, MANIFEST_NAME)):
        path = indexed  # a flashwrite checkpoint's index file: the checkpoint it belongs to
    if foreign.is_foreign(os.fspath(path)):
        if into is not None or process_group is not None:
            raise ValueError(f"{os.fspath(path)} is plain safetensors, not a flashwrite checkpoint: load it without "
                             "into= or process_group=")
        return load_foreign(os.fspath(path), map_location=map_location, backend=backend, direct=direct,
                            queue_depth=queue_depth)
    if process_group is not None:
        return load_rank(path, process_group=process_group, **options)
    return load_state(path, **options)


def load_rank(path: str | os.PathLike, *, process_group: Any, map_location: Any = "cpu", into: Any = None,
              verify: bool = True, allow_pickle: bool = False, strict: bool = True, backend: str = "auto",
              direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH, zero_copy: bool = False,
              replica_group: Any = None, timeout: float | None = None) -> Any:
    """This rank's state of a multi-rank checkpoint, reading only its own stripes
    (with ``replica_group``: its share of them, the rest exchanged; ``loading/replicas.py``).

    The group must have the world size the checkpoint was saved with (to
    reshard, save through ``flashwrite.dcp``). A single-process checkpoint is
    loaded whole on every rank. No collective is issued.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs torch.distributed to be initialized (init_process_group)")
    pg = process_group if process_group is not None else dist.group.WORLD
    if replica_group is not None:  # read once per replica group, exchanged (loading/replicas.py)
        layout = layout_for_load(pg, replica_group, timeout)
        return load_replicated(path, layout, dist.get_rank(pg), dist.get_world_size(pg), map_location=map_location,
                               into=into, verify=verify, allow_pickle=allow_pickle, strict=strict, backend=backend,
                               direct=direct, queue_depth=queue_depth, zero_copy=zero_copy)
    return load_state(path, rank=(dist.get_rank(pg), dist.get_world_size(pg)), map_location=map_location, into=into,
                      verify=verify, allow_pickle=allow_pickle, strict=strict, backend=backend, direct=direct,
                      queue_depth=queue_depth, zero_copy=zero_copy)


_load_pool: concurrent.futures.ThreadPoolExecutor | None = None
_load_pool_lock = threading.Lock()


def load_async(path: str | os.PathLike, **kwargs: Any) -> LoadFuture:
    """``load(path, **kwargs)`` on a background thread (two loads run at once, more wait
    their turn). Returns a ``LoadFuture``: a ``concurrent.futures.Future`` of the same
    family as ``save_async``'s (``result()``, ``done()``, ``wait()``, ``stats``).
    A path that can never load (an unsupported URL) raises here, not through the future."""
    global _load_pool
    kind_of(path, "load_async")  # a path that can never load raises here (nothing is reached yet)
    with _load_pool_lock:
        if _load_pool is None:
            _load_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="flashwrite-load")
        pool = _load_pool
    path = shown(path)  # a relative path resolved at the call: an os.chdir before the load's thread runs changes nothing
    return launch_load(path, lambda: load(path, **kwargs), pool.submit)


def verify(path: str | os.PathLike, progress: Any = None) -> dict:
    """Check a checkpoint offline: manifest, stripe sizes and headers, every checksum.
    Raises CorruptCheckpointError (naming file and tensor) or returns a summary.

    One stripe at a time, so memory holds one stripe, not the checkpoint. progress:
    told of each stripe checked (``start(total_bytes, what)``, ``advance(n)``,
    ``finish()``), as ``flashwrite verify``'s bar is."""
    t0 = time.perf_counter()
    where = locate(path, "verify")
    with CheckpointDir(where if not where.target.os_paths else where.given, what="verify") as ck:
        m = ck.manifest
        unknown = referenced_keys(m.tree) - set(m.tensors)  # what load would refuse, checksums or not
        if unknown:
            raise CorruptCheckpointError(f"manifest tree refers to {len(unknown)} unknown tensor(s), e.g. "
                                         f"{sorted(unknown)[0]!r}: load would refuse this checkpoint",
                                         file=MANIFEST_NAME)
        by_file: dict[int, set[str]] = {}
        for k, e in m.tensors.items():
            by_file.setdefault(e.file, set()).add(k)
        if progress is not None:
            progress.start(sum(f.size for f in m.files), f"verify {os.path.basename(os.path.normpath(path))}")
        try:
            for fi, fe in enumerate(m.files):
                if fi in by_file:
                    ck.read(keys=by_file[fi], verify=True)  # raises on any mismatch; buffers freed at once
                if progress is not None:
                    progress.advance(fe.size)
        finally:
            if progress is not None:
                progress.finish()
    return {"path": os.fspath(path), "files": len(m.files), "tensors": len(m.tensors),
            "bytes": sum(f.size for f in m.files), "writer_version": m.writer_version,
            "seconds": time.perf_counter() - t0}
