"""Multi-rank checkpoints on torch.distributed.

Every rank stages and writes its own stripes (``model-rank00003-00001-of-00004.safetensors``)
into one shared temporary directory, at the same time. flashwrite's own gloo
group, never the training group, then carries the coordination, on one
background thread per group so the caller's collectives are never blocked or
interleaved with ours:

1. status rounds: every ``POLL_S`` while writing, each rank contributes
   (failed, still writing) to an all_reduce. A failure anywhere ends the save on
   every rank; when no rank is still writing, all are durable. Because a rank
   that is still writing keeps answering rounds, the timeout never has to cover
   the write itself, only the silence of a peer.
2. the local manifests are gathered to group rank 0, which merges them, writes
   the index and the manifest last, and renames the directory into place
   (``commit.finalize``); the outcome is broadcast and completes every rank's
   future.

Agreeing on the temporary directory costs no collective per save: when the
group is created, rank 0 broadcasts a random nonce once; the n-th save on that
group uses ``.<name>.flashwrite-tmp-<nonce>-s<n>``, identical on every rank
because every rank saves in the same order (collectives require that anyway).

Failure bound (``timeout``, default ``DEFAULT_TIMEOUT_S``): a rank that raises,
hits ENOSPC or is cancelled fails the next round, so peers fail within
``POLL_S``; a rank that dies closes its gloo connections and its peers fail at
once; a rank that stops responding fails its peers after ``timeout`` seconds
(the gloo group's timeout, which bounds each coordination step). In every case
nothing is committed, the temporary directory is removed, and the previous
checkpoint stays the latest complete one. After a peer is lost the group is
unusable; later saves on it raise at once (restart the job, as torchrun does).

On disk a multi-rank checkpoint is a format-version-1 checkpoint whose tree is
``{rank: state}`` (so ``flashwrite.load(path)`` in one process returns every
rank's state) plus a ``ranks`` section: ``{"world_size": N, "files": [[first,
count], ...]}`` saying which stripes each rank wrote, so ``load(path,
process_group=pg)`` reads only its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from . import commit
from .errors import CorruptCheckpointError, FlashwriteError
from .format import build_index, parse_manifest, read_manifest
from .load import DEFAULT_READ_QUEUE_DEPTH, _load_into, read_tensors, tensor_placer
from .flatten import referenced_keys, unflatten

log = logging.getLogger("flashwrite")

DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.1  # how often a rank that is still writing answers a status round

__all__ = ["DistributedSaveError", "DEFAULT_TIMEOUT_S", "coordinator", "save_async", "load"]


class DistributedSaveError(FlashwriteError):
    """A multi-rank save failed on another rank (or contact with a peer was lost).

    ``failures`` maps each failed rank of the group to its error text; it is empty
    when a peer was lost without a word (killed, or silent past the timeout)."""

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = failures or {}


class _Coordinator:
    """flashwrite's gloo group over the ranks of one process group, and the single
    thread that issues every collective on it, in submission order."""

    def __init__(self, group: Any, timeout_s: float | None, nonce: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.nonce = nonce
        self.seq = 0
        self.broken: str | None = None
        self.lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flashwrite-coord")

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def next_seq(self) -> int:
        with self.lock:
            if self.broken:
                raise DistributedSaveError(f"flashwrite's coordination group is unusable since a peer was lost "
                                           f"({self.broken}); restart the job")
            self.seq += 1
            return self.seq

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.executor.submit(fn, *args, **kwargs)

    def lost(self, e: BaseException) -> None:
        with self.lock:
            if not self.broken:
                self.broken = f"{type(e).__name__}: {e}"[:500]


_coordinators: dict[tuple, _Coordinator] = {}
_coordinators_lock = threading.Lock()


def coordinator(process_group: Any = None, timeout: float | None = None,
                coordination_group: Any = None) -> _Coordinator:
    """The cached coordination group for ``process_group`` (None: the default group).

    Created on first use, collectively (every rank of the default group must call
    this in the same order, which the first multi-rank save does). For a subgroup
    pass ``coordination_group``: a gloo group over the same ranks that nothing but
    flashwrite uses, created by every rank (``dist.new_group`` is collective over
    the default group).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs torch.distributed to be initialized (init_process_group)")
    if coordination_group is not None:
        if dist.get_backend(coordination_group) != "gloo":
            raise ValueError("coordination_group must be a gloo group")
        key: tuple = ("given", id(coordination_group))
        group, timeout_s = coordination_group, None
    else:
        pg = process_group if process_group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        if len(ranks) != dist.get_world_size():
            raise ValueError("process_group is a subgroup: create a gloo group over its ranks on every rank "
                             "(dist.new_group(ranks, backend='gloo', timeout=...)) and pass it as coordination_group")
        timeout_s = float(DEFAULT_TIMEOUT_S if timeout is None else timeout)
        if timeout_s <= 0:
            raise ValueError("timeout must be positive")
        key, group = (ranks, timeout_s), None
    with _coordinators_lock:
        c = _coordinators.get(key)
        if c is not None:
            return c
        if group is None:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        box = [uuid.uuid4().hex[:12] if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        c = _coordinators[key] = _Coordinator(group, timeout_s, box[0])
        return c


def temp_dir(final: str, coord: _Coordinator, seq: int) -> str:
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}{commit.TMP_MARK}{coord.nonce}-s{seq}")


def stripe_prefix(rank: int) -> str:
    return f"model-rank{rank:05d}"


# --------------------------------------------------------------------------- save


def save_async(writer: Any, state_dict: Any, path: str | os.PathLike, *, process_group: Any = None,
               coordination_group: Any = None, timeout: float | None = None, overwrite: bool = False,
               block: bool = True, allow_pickle: bool = False, metadata: dict[str, str] | None = None) -> Any:
    """``Writer.save_async`` for one rank of a multi-rank save (see the module doc).

    Every rank of ``process_group`` must call it with the same path, in the same
    order relative to its other flashwrite saves on that group.
    """
    from .save import SaveFuture

    coord = coordinator(process_group, timeout, coordination_group)
    seq = coord.next_seq()
    t0 = time.perf_counter()
    final = os.path.abspath(os.fspath(path))
    tmp = temp_dir(final, coord, seq)
    rank = coord.rank
    try:
        commit.check_target(final, overwrite)
        os.makedirs(tmp, exist_ok=True)  # every rank: the name is agreed, so whoever comes first creates it
        sw = writer.write_stripes({rank: state_dict}, tmp, t0, prefix=stripe_prefix(rank), allow_pickle=allow_pickle,
                                  metadata=metadata)
    except BaseException as e:
        # Tell the peers now instead of letting them wait for the timeout.
        coord.run(_coordinate, coord, final, tmp, None, e, overwrite, t0, None)
        raise
    sw.stats.path = final
    sw.stats.extra.update(rank=rank, world_size=coord.size)
    fut = SaveFuture(final, sw.job, sw.stats, t0)
    try:
        if block:
            fut.wait_staged()
    except BaseException as e:
        sw.job.cancel()
        sw.job.wait()
        coord.run(_coordinate, coord, final, tmp, None, e, overwrite, t0, None)
        raise
    fut._future.set_running_or_notify_cancel()
    coord.run(_coordinate, coord, final, tmp, sw, None, overwrite, t0, fut)
    sw.stats.stall_s = time.perf_counter() - t0
    return fut


def _coordinate(coord: _Coordinator, final: str, tmp: str, sw: Any, error: BaseException | None, overwrite: bool,
                t0: float, fut: Any) -> None:
    """One save's coordination, on the group's thread. Completes ``fut`` (if any)."""
    try:
        stats = _agree_and_commit(coord, final, tmp, sw, error, overwrite, t0, fut)
    except BaseException as e:
        if fut is not None:
            fut._future.set_exception(e)
        elif error is None:
            log.warning("flashwrite: coordination of %s failed: %s", final, e)
        return
    if fut is not None:
        fut._future.set_result(stats)


class _PeerLost(Exception):
    """A collective on the coordination group failed: a peer died or went silent."""


def _collective(fn: Any, *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # gloo reports a closed connection or a timeout as RuntimeError
        raise _PeerLost(f"{type(e).__name__}: {e}") from e


def _stop(sw: Any) -> None:
    if sw is not None and not sw.job.done:
        sw.job.cancel()
        sw.job.wait()


def _agree_and_commit(coord: _Coordinator, final: str, tmp: str, sw: Any, error: BaseException | None,
                      overwrite: bool, t0: float, fut: Any) -> Any:
    group = coord.group
    manifest = None
    try:
        # 1. status rounds until someone failed or nobody is still writing.
        while True:
            if error is None and sw is not None and manifest is None:
                done = sw.job.done or sw.job.wait(POLL_S)
                if fut is not None:
                    fut._release_sources()
                if done:
                    try:
                        manifest = sw.wait_durable()
                    except BaseException as e:  # noqa: BLE001 - reported to every rank below
                        error = e
            failed = error is not None
            status = torch.tensor([int(failed), int(not failed and manifest is None)], dtype=torch.int64)
            _collective(dist.all_reduce, status, group=group)
            if status[0] > 0 or status[1] == 0:
                break

        if status[0] > 0:
            # 2a. someone failed: stop our own writes, learn who failed and why; rank 0
            # removes the directory once the gather shows that every rank has stopped.
            _stop(sw)
            mine = None if error is None else f"{type(error).__name__}: {error}"[:2000]
            texts: list = [None] * coord.size
            _collective(dist.all_gather_object, texts, mine, group=group)
            if coord.rank == 0:
                commit.discard(tmp)
            failures = {r: t for r, t in enumerate(texts) if t is not None}
            summary = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
            if error is not None:
                if hasattr(error, "add_note"):
                    error.add_note(f"flashwrite: multi-rank save to {final} failed ({summary}); nothing was committed")
                raise error
            raise DistributedSaveError(f"multi-rank save to {final} failed on {summary}; nothing was committed",
                                       failures)

        # 2b. everyone is durable: gather manifests, rank 0 commits, everyone learns the outcome.
        manifests = [None] * coord.size if coord.rank == 0 else None
        _collective(dist.gather_object, manifest, manifests, dst=coord.global_rank(0), group=group)
        outcome: list = [None]
        if coord.rank == 0:
            try:
                merged = merge_manifests(manifests, tmp)
                parse_manifest(json.dumps(merged).encode())  # what a reader will check, before it is visible
                commit.finalize(tmp, final, merged, build_index(merged), overwrite)
                outcome[0] = ("ok", sum(f["size"] for f in merged["files"]))
            except BaseException as e:  # noqa: BLE001 - broadcast, then raised on every rank
                commit.discard(tmp)
                outcome[0] = ("error", f"{type(e).__name__}: {e}"[:2000])
                error = e
        _collective(dist.broadcast_object_list, outcome, src=coord.global_rank(0), group=group)
    except _PeerLost as e:
        _stop(sw)
        coord.lost(e)
        commit.discard(tmp)
        raise DistributedSaveError(
            f"multi-rank save to {final}: lost contact with a peer (it died, or was silent for longer than the "
            f"timeout of {coord.timeout_s} s); nothing was committed. {e}") from (error or e.__cause__)
    kind, value = outcome[0]
    if kind != "ok":
        if error is not None:
            raise error
        raise DistributedSaveError(f"multi-rank save to {final}: the commit on rank 0 failed: {value}", {0: value})
    stats = sw.stats
    stats.total_s = time.perf_counter() - t0
    stats.extra["global_bytes"] = value
    return stats


def merge_manifests(manifests: list[dict], tmp: str) -> dict:
    """One global manifest from the per-rank manifests (each with tree ``{rank: state}``)."""
    first = manifests[0]
    merged = {k: v for k, v in first.items() if k not in ("files", "tensors", "aliases", "tree")}
    files: list[dict] = []
    tensors: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    items: list = []
    spans = []
    for r, m in enumerate(manifests):
        for field in ("format_version", "writer_version", "checksum"):
            if m[field] != first[field]:
                raise FlashwriteError(f"rank {r} wrote with {field} {m[field]!r}, rank 0 with {first[field]!r}: "
                                      "every rank must use the same flashwrite version and chunk_bytes")
        tree = m["tree"]
        if tree.get("t") != "dict" or len(tree["items"]) != 1 or tree["items"][0][0] != {"t": "int", "v": r}:
            raise FlashwriteError(f"rank {r}'s manifest is not a rank-{r} state (saves issued in different orders?)")
        base = len(files)
        spans.append([base, len(m["files"])])
        files.extend(m["files"])
        for k, t in m["tensors"].items():
            if k in tensors:
                raise FlashwriteError(f"tensor {k!r} written by two ranks")
            tensors[k] = dict(t, file=t["file"] + base)
        aliases.update(m["aliases"])
        items.extend(tree["items"])
    for f in files:
        if not os.path.exists(os.path.join(tmp, f["name"])):
            raise FlashwriteError(f"stripe {f['name']} is not visible in {tmp} from rank 0: every rank must write to "
                                  "the same shared file system")
    merged.update(files=files, tensors=tensors, aliases=aliases, tree={"t": "dict", "items": items},
                  ranks={"world_size": len(manifests), "files": spans})
    return merged


# --------------------------------------------------------------------------- load


def rank_section(raw: dict) -> dict | None:
    """The validated ``ranks`` section of a manifest, or None for a single-process checkpoint."""
    ranks = raw.get("ranks")
    if ranks is None:
        return None
    bad = lambda msg: CorruptCheckpointError(f"manifest: ranks: {msg}", file="flashwrite.json")  # noqa: E731
    if not isinstance(ranks, dict):
        raise bad("not an object")
    n = ranks.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1 << 20:
        raise bad("world_size must be a positive integer")
    return ranks


def _rank_subtree(tree: Any, rank: int) -> Any:
    if not isinstance(tree, dict) or tree.get("t") != "dict" or not isinstance(tree.get("items"), list):
        raise CorruptCheckpointError("manifest: a multi-rank tree must be a dict of ranks", file="flashwrite.json")
    for it in tree["items"]:
        if isinstance(it, list) and len(it) == 2 and it[0] == {"t": "int", "v": rank}:
            return it[1]
    raise CorruptCheckpointError(f"manifest: no state for rank {rank}", file="flashwrite.json")


def load(path: str | os.PathLike, *, process_group: Any, map_location: Any = "cpu", into: Any = None,
         verify: bool = True, allow_pickle: bool = False, strict: bool = True, backend: str = "auto",
         direct: bool = True, queue_depth: int = DEFAULT_READ_QUEUE_DEPTH, zero_copy: bool = False) -> Any:
    """This rank's state of a multi-rank checkpoint, reading only its own stripes.

    The group must have the world size the checkpoint was saved with (to
    reshard, save through ``flashwrite.dcp``). A single-process checkpoint is
    loaded whole on every rank. No collective is issued.
    """
    from .load import load as load_all

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs torch.distributed to be initialized (init_process_group)")
    pg = process_group if process_group is not None else dist.group.WORLD
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    m = read_manifest(path)
    ranks = rank_section(m.raw)
    if ranks is None:
        return load_all(path, map_location=map_location, into=into, verify=verify, allow_pickle=allow_pickle,
                        strict=strict, backend=backend, direct=direct, queue_depth=queue_depth, zero_copy=zero_copy)
    if ranks["world_size"] != size:
        raise ValueError(f"{os.fspath(path)} was saved by {ranks['world_size']} ranks and this group has {size}: "
                         "load it in one process with flashwrite.load(path), which returns {rank: state}, or save "
                         "through flashwrite.dcp to reshard on load")
    subtree = _rank_subtree(m.tree, rank)
    keys = referenced_keys(subtree)
    unknown = keys - set(m.tensors)
    if unknown:
        raise CorruptCheckpointError(f"manifest tree refers to unknown tensor {sorted(unknown)[0]!r}",
                                     file="flashwrite.json")
    res = read_tensors(path, verify=verify, backend=backend, direct=direct, queue_depth=queue_depth, keys=keys,
                       zero_copy=zero_copy or into is not None)
    res.manifest = dataclasses.replace(res.manifest, tree=subtree)
    if into is not None:
        return _load_into(res, into, strict, allow_pickle)
    return unflatten(subtree, tensor_placer(res, map_location), allow_pickle=allow_pickle)
