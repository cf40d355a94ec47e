"""Neighbour copies: each rank also keeps one neighbour's snapshot in its memory.

With ``local_snapshots=True`` and ``neighbour_copies=True`` (``Writer`` or
``CheckpointManager``) in a multi-rank run, rank r sends each snapshot it seals to
rank r+1 (mod the world size), and keeps the one rank r-1 sends it as a *replica*:
a pool file and a header in its own ``local_dir``, like a snapshot, whose header
says whose it is (``"replica": true``, the sender's rank and world size). When a
node is lost, its ranks restart elsewhere with nothing in memory; the ranks after
them still hold their snapshots, so no step is lost and no rank reads storage.

The transfer runs on flashwrite's coordination group (gloo, never the training
group), on its thread, after the save is staged and while its stripes are being
written: it adds nothing to the stall, and nothing to the time to durable while
it is faster than the storage. Every rank takes part in every exchange, also one
whose save failed or has no snapshot (it then sends nothing), so the ranks' point-
to-point messages always pair up. A holder keeps one replica file and refills it in
place (its pages are reused, like the staging pool's): the saves of a group run in
order on that thread and each is committed (or has failed) before the next one's
copies go out, so the copy being replaced is never the only one of its step.

At a multi-rank ``restore()`` every rank offers the steps it can restore itself
and those whose replica it holds for rank r-1; the ranks agree on the newest step
that every rank can get from some tier, and a rank without its own snapshot of
that step receives it from the holder into its own local tier, then restores it
as its own (verified against the manifest's checksums, like any snapshot).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from . import snapshot as local
from ..system.coord import Coordinator, PeerLost

log = logging.getLogger("flashwrite")

PAGE = local.PAGE


def _wait(works: list, what: str) -> None:
    try:
        for w in works:
            w.wait()
    except Exception as e:  # gloo reports a closed connection or a timeout as RuntimeError
        raise PeerLost(f"{what}: {type(e).__name__}: {e}") from e


def _map_pool(path: str, writable: bool) -> torch.Tensor:
    """A uint8 tensor over a whole pool file, mapped shared (unmapped when the last view goes)."""
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        return local.map_fd(fd, os.fstat(fd).st_size, writable)[1]
    finally:
        os.close(fd)


def _allocate(path: str, nbytes: int) -> None:
    """A pool file of exactly nbytes, every page allocated (tmpfs: ENOSPC now, never
    SIGBUS later while a receive writes into the mapping). Pages it already has are kept."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        local.unlink_quietly(path)
        raise
    os.close(fd)


class Store:
    """Where the snapshots one rank receives go: its local_dir, named after its LocalPool.

    replica=True: the copy of rank r-1's newest snapshot, in one file refilled in
    place. replica=False: a snapshot of this rank's own state fetched back from its
    holder at restore, stored as this process's own."""

    def __init__(self, pool: Any):
        self.pool = pool  # the tier's LocalPool: its dir, token (file names) and owner
        self._fetched = 0
        self.newest: local.Snapshot | None = None  # the copy this process holds

    def _names(self, replica: bool) -> tuple[str, str]:
        if replica:
            stem = "replica"
        else:
            self._fetched += 1
            stem = f"fetched{self._fetched:06d}"
        base = os.path.join(self.pool.dir, f"{local.PREFIX}{self.pool.token}-{stem}")
        return base + local.POOL_SUFFIX, base + local.HEADER_SUFFIX

    def begin(self, body: dict, replica: bool) -> tuple[str, str, list[list[int]]] | None:
        """Make room for a snapshot: (pool path, header path, chunks as they will lie in
        the new pool). None (logged) when local_dir has no room."""
        pool_path, header = self._names(replica)
        local.unlink_quietly(header)  # the copy this file held goes first (its step is committed, or failed)
        chunks, at = [], 0
        for f, off, n, _ in body["chunks"]:
            chunks.append([int(f), int(off), int(n), at])
            at += -(-int(n) // PAGE) * PAGE
        try:
            _allocate(pool_path, at)
        except OSError as e:
            self.pool.say_once("replica-room", "flashwrite: no room in %s for a neighbour's snapshot (%s); "
                               "neighbour copies are skipped while it lasts", self.pool.dir, e)
            return None
        return pool_path, header, chunks

    def finish(self, body: dict, pool_path: str, header: str, chunks: list, replica: bool) -> local.Snapshot:
        body = dict(body, pool=os.path.basename(pool_path), chunks=chunks, owner=self.pool.owner,
                    created=time.time())
        body.pop("replica", None)
        if replica:
            body["replica"] = True
        local.write_header(header, body)
        snap = local.Snapshot.of(header, pool_path, body)
        if replica:
            self.newest = snap
        return snap

    def committed(self, path: str) -> None:
        """The save of ``path`` committed: so did the newest replica, if it is of that save."""
        snap = self.newest
        if snap is not None and snap.path == path and snap.state != "committed" and os.path.exists(snap.header):
            snap.state = snap.body["state"] = "committed"
            local.write_header(snap.header, snap.body)

    def close(self, keep_newest: bool) -> None:
        """Remove this process's copy (keep_newest: keep it)."""
        if not keep_newest:
            for p in self._names(replica=True):
                local.unlink_quietly(p)


def swap(coord: Coordinator, send_to: int | None, snap: local.Snapshot | None, recv_from: int | None,
         store: Store | None, replica: bool) -> local.Snapshot | None:
    """Send ``snap`` (None: nothing) to group rank ``send_to`` and receive one from
    ``recv_from`` into ``store``, both at once; either side may be None (no peer).
    Returns the snapshot received, or None (none sent, or no room here). Both peers
    of each pair must call it at the same point of their coordination sequence."""
    g, glob = coord.group, coord.global_rank
    out_json = b""
    if snap is not None:  # the receiver names its own owner
        out_json = json.dumps({k: v for k, v in snap.body.items() if k != "owner"}, separators=(",", ":")).encode()
    works, meta_in = [], torch.zeros(1, dtype=torch.int64)
    # 1. the header's size (0: nothing to send)
    if send_to is not None:
        works.append(dist.isend(torch.tensor([len(out_json)], dtype=torch.int64), glob(send_to), group=g))
    if recv_from is not None:
        works.append(dist.irecv(meta_in, glob(recv_from), group=g))
    _wait(works, "neighbour copy: sizes (if no peer died: does every rank set neighbour_copies alike?)")
    in_json = int(meta_in[0]) if recv_from is not None else 0
    # 2. the header (manifest, checksums, chunk table)
    works, body_in = [], torch.empty(in_json, dtype=torch.uint8)
    if send_to is not None and out_json:
        works.append(dist.isend(torch.frombuffer(bytearray(out_json), dtype=torch.uint8), glob(send_to), group=g))
    if in_json:
        works.append(dist.irecv(body_in, glob(recv_from), group=g))
    _wait(works, "neighbour copy: header")
    # 3. the receiver says whether it has room
    room = None
    if in_json:
        body = json.loads(body_in.numpy().tobytes())
        room = store.begin(body, replica) if store is not None else None
    works, accept_in = [], torch.zeros(1, dtype=torch.int64)
    if in_json:
        works.append(dist.isend(torch.tensor([int(room is not None)], dtype=torch.int64), glob(recv_from), group=g))
    if send_to is not None and out_json:
        works.append(dist.irecv(accept_in, glob(send_to), group=g))
    _wait(works, "neighbour copy: room")
    # 4. the chunks, straight from the sender's pool into the receiver's
    works = []
    if send_to is not None and out_json and int(accept_in[0]):
        src = _map_pool(snap.pool, writable=False)
        for _f, _off, n, at in snap.body["chunks"]:
            works.append(dist.isend(src[int(at):int(at) + int(n)], glob(send_to), group=g))
    if room is not None:
        pool_path, header, chunks = room
        dst = _map_pool(pool_path, writable=True)
        for _f, _off, n, at in chunks:
            works.append(dist.irecv(dst[at:at + n], glob(recv_from), group=g))
    _wait(works, "neighbour copy: data")
    if room is None:
        return None
    return store.finish(body, *room, replica=replica)


def exchange(coord: Coordinator, snap: local.Snapshot | None, store: Store | None) -> None:
    """At a save, on the coordination thread, on every rank: send this rank's snapshot
    of it (None: it has none) to rank r+1 and keep rank r-1's."""
    n = coord.size
    if n < 2:
        return
    t0 = time.perf_counter()
    got = swap(coord, (coord.rank + 1) % n, snap, (coord.rank - 1) % n, store, replica=True)
    if got is not None:
        log.debug("flashwrite: kept rank %d's snapshot of %s (%.3f s)", (coord.rank - 1) % n, got.path,
                  time.perf_counter() - t0)

