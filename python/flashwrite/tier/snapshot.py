"""The node-local tier: staged snapshots that outlive the process.

With ``local_snapshots=True`` a ``Writer``'s staging pool is one file in
``local_dir`` (``/dev/shm`` by default: named shared memory), mapped shared, so
the bytes a save staged are still there after the process dies. Each save that
fits the pool keeps its slots (``hold_slots``) until it is committed, and once
every byte is staged and checksummed a small *header* file is written next to
the pool: the target path, the state (staged / committed), where every chunk of
every stripe lies in the pool file, and the save's manifest (with the checksums
the engine computed while staging). A header is written to a temporary name and
renamed into place, and carries a checksum of itself, so a snapshot is either
complete and checkable or not there at all; a save killed while staging never
wrote one. A header goes before its slots can be reused: when the next save of
its pool starts, once its own save has finished.

``read_snapshot`` maps the pool file and copies every piece out, checking it
against the manifest's checksum in the same pass (native, on several threads);
the manager rebuilds the state through the manifest's tree (the same code a load
from storage uses). A restart that finds a snapshot of a step storage also holds
*takes* it (``take``, the manager's default): large tensors become the pool file's
own pages, and the file is unlinked, so the restore copies nothing and faults in
no fresh memory. With ``adopt`` (``restore(zero_copy=True)``, for a snapshot that
must stay) they map the pool's pages copy-on-write instead. Locks keep these
apart: a Writer holds an exclusive flock on its pool file for as long as it may
write it, an adopting restore a shared one and a taking restore an exclusive one
for as long as their tensors live, so memory that restored tensors reference is
never overwritten by anyone else.

Files: ``flashwrite-<pid>-<nonce>.pool`` and ``flashwrite-<pid>-<nonce>-<seq>.snap``.
The owner (pid and start time) is in each header, so a restart can tell a dead
owner's files from a live one's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _core, defaults
from ..format import dtypes
from ..errors import ChecksumMismatchError, CorruptCheckpointError
from ..format import Manifest, parse_manifest, piece_ranges
from ..system.owner import owner_alive, start_ticks

log = logging.getLogger("flashwrite")

FORMAT = "flashwrite-snapshot"
VERSION = 1
PREFIX = "flashwrite-"
POOL_SUFFIX = ".pool"
HEADER_SUFFIX = ".snap"
MAX_HEADER_BYTES = 1 << 30
PAGE = 4096


def default_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def write_header(path: str, body: dict) -> None:
    """Write a snapshot header whole or not at all: encoded with a checksum of itself,
    to a temporary name, renamed into place (tmpfs: no fsync needed; the rename is what
    makes the header appear whole)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as fh:
        fh.write(b"%016x\n" % _core.checksum(data) + data)
    os.replace(tmp, path)


def unlink_quietly(path: str) -> None:
    """Remove a file of the tier; one already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _decode(raw: bytes, shown: str) -> dict:
    head, _, data = raw.partition(b"\n")
    try:
        ok = int(head, 16) == _core.checksum(data)
    except ValueError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"snapshot header {shown} is damaged (checksum)", file=shown)
    try:
        body = json.loads(data)
    except ValueError as e:
        raise CorruptCheckpointError(f"snapshot header {shown} is not JSON: {e}"[:300], file=shown) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CorruptCheckpointError(f"{shown} is not a flashwrite snapshot header of version {VERSION}", file=shown)
    return body


@dataclass
class Snapshot:
    """A header found in a local_dir."""

    header: str           # path of the header file
    pool: str             # path of the pool file it points into
    path: str             # the checkpoint directory it is a snapshot of
    state: str            # "staged" or "committed"
    owner: dict
    created: float
    body: dict

    @property
    def alive(self) -> bool:
        return owner_alive(self.owner)

    @classmethod
    def of(cls, header: str, pool: str, body: dict) -> Snapshot:
        return cls(header, pool, str(body["path"]), str(body["state"]), body.get("owner") or {},
                   float(body.get("created", 0)), body)


def scan(local_dir: str) -> list[Snapshot]:
    """Every readable header in local_dir, newest first (damaged ones are logged and left out)."""
    out = []
    try:
        names = os.listdir(local_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(HEADER_SUFFIX)):
            continue
        hp = os.path.join(local_dir, name)
        try:
            with open(hp, "rb") as fh:
                raw = fh.read(MAX_HEADER_BYTES + 1)
            body = _decode(raw, hp)
            pool = body["pool"]
            if not isinstance(pool, str) or os.sep in pool or not pool.endswith(POOL_SUFFIX):
                raise CorruptCheckpointError(f"snapshot header {hp}: bad pool name", file=hp)
            out.append(Snapshot.of(hp, os.path.join(local_dir, pool), body))
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, CorruptCheckpointError, KeyError, TypeError, ValueError) as e:
            log.warning("flashwrite: ignoring local snapshot header %s: %s", hp, e)
    out.sort(key=lambda s: s.created, reverse=True)
    return out


def remove(snap: Snapshot) -> None:
    """Remove a header, and its pool file once no other header points into it."""
    try:
        os.unlink(snap.header)
    except FileNotFoundError:
        pass
    d = os.path.dirname(snap.header)
    if not any(s.pool == snap.pool for s in scan(d)):
        try:
            os.unlink(snap.pool)
        except FileNotFoundError:
            pass


def remove_orphan_pools(local_dir: str) -> None:
    """Pool files of dead owners that no header points into (a crash before any snapshot),
    and their half-written headers."""
    try:
        names = os.listdir(local_dir)
    except FileNotFoundError:
        return
    used = {s.pool for s in scan(local_dir)}
    for name in names:
        # A pool, or a header that was being written when its process died.
        if not (name.startswith(PREFIX) and (name.endswith(POOL_SUFFIX) or f"{HEADER_SUFFIX}.tmp-" in name)):
            continue
        p = os.path.join(local_dir, name)
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if p in used or start_ticks(pid) is not None:
            continue  # in use, or its pid runs (perhaps recycled: leave it, it is only memory)
        try:
            os.unlink(p)
            log.info("removed stale local snapshot pool %s", p)
        except OSError:
            pass


# ---------------------------------------------------------------------- restore


# A tensor smaller than this is copied even when adopting (one mapping per tensor
# costs a VMA or more; the kernel allows ~65k per process).
ADOPT_MIN_BYTES = 1 << 20
ADOPT_MAX_SEGMENTS = 16384


def _try_lock(fd: int, how: int) -> bool:
    """flock without waiting. A Writer holds LOCK_EX on its pool file for as long as it may
    write there; a restore that adopts a pool holds LOCK_SH while its mappings live, and one
    that takes a pool holds LOCK_EX; a dead process holds nothing."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def map_fd(fd: int, size: int, writable: bool = False) -> tuple[mmap.mmap | None, torch.Tensor]:
    """(mapping, uint8 tensor over it) of the first size bytes of a pool file, shared; the
    tensor keeps the mapping alive (None and an empty tensor when size is 0)."""
    if not size:
        return None, torch.empty(0, dtype=torch.uint8)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable": a read-only mapping is only ever read
        return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _shares_pool(snap: Snapshot) -> bool:
    """Whether another header points into snap's pool file (that snapshot would go with it)."""
    return any(s.pool == snap.pool and s.header != snap.header for s in scan(os.path.dirname(snap.header)))


def _open_pool(snap: Snapshot, take: bool) -> tuple[int, bool]:
    if take:
        try:
            return os.open(snap.pool, os.O_RDWR | os.O_CLOEXEC), True
        except PermissionError:
            pass  # another user's file: read it
    return os.open(snap.pool, os.O_RDONLY | os.O_CLOEXEC), False


def read_snapshot(snap: Snapshot, *, verify: bool = True, threads: int | None = None,
                  targets: dict[str, torch.Tensor] | None = None, adopt: bool = False, take: bool = False,
                  timings: dict | None = None) -> tuple[Manifest, dict]:
    """(manifest, {key: CPU tensor owning its bytes}) of a snapshot, every piece checked
    against the manifest's checksum. Raises CorruptCheckpointError (naming the tensor).

    By default each tensor is fresh memory (storage of exactly its bytes, offset 0) and
    the bytes are copied and checksummed in one native pass on ``threads`` threads.

    targets: existing CPU tensors to fill instead, by key (used where contiguous, of the
    stored dtype and shape; returned as themselves). If a piece fails its check, the
    targets may already hold some new bytes.

    take: this process takes the pool file for itself, when nothing else holds it (no
    Writer, no adopting restore) and no other header points into it. Tensors of at least
    ADOPT_MIN_BYTES are then the file's own pages, mapped shared: no copy, no fresh memory,
    and nothing deferred (later writes land in those pages). Once every piece verified,
    the header and the pool file are unlinked, and the pages no taken tensor maps are
    freed, so the snapshot costs exactly its tensors' pages until they die. The snapshot
    is gone afterwards, also when a piece did not verify: take only a snapshot whose step
    storage also holds.

    adopt: where not taken, tensors of at least ADOPT_MIN_BYTES map the snapshot's pages
    copy-on-write instead (no copy, no fresh memory; a page is copied when first written),
    when no Writer holds the pool file (a live process's pool is copied). The snapshot
    stays, and its shared memory lives as long as those tensors do, even after its file
    is removed.

    Either way each tensor owns a storage of exactly its bytes (not resizable, like
    ``torch.load(mmap=True)``'s).

    timings: filled with seconds per phase (map, allocate, copy_verify)."""
    t0 = time.perf_counter()
    m = _manifest_of(snap)
    fd, take = _open_pool(snap, take)
    try:
        size = os.fstat(fd).st_size
        where = _chunk_table(snap, m.block_bytes, size)
        take, adopt = _lock_policy(snap, fd, take, adopt)
        # Not populated here: the copy threads fault in the pages of their own pieces.
        mm, pool = map_fd(fd, size)
        t1 = time.perf_counter()
        plan = _plan_pieces(snap, m, where, size, fd, pool.data_ptr(), targets or {}, take, adopt)
        t2 = time.perf_counter()
        workers = threads or defaults.COPY_THREADS
        # `pool` (and `mm` under it) and every destination stay alive for the call.
        bad = _core.copy_verify(plan.pieces, verify, workers)
        t3 = time.perf_counter()
        del pool
        if mm is not None:
            mm.close()
        if take:
            _give_up_taken(snap, fd, [] if bad else plan.kept, size)
    finally:
        # The lock stays while any mapping lives: each holds the open file it was made from.
        os.close(fd)
    if timings is not None:
        timings.update(map=t1 - t0, allocate=t2 - t1, copy_verify=t3 - t2)
    if bad:
        raise _mismatch(snap, m, plan.owners, bad)
    return m, plan.tensors


def _manifest_of(snap: Snapshot) -> Manifest:
    """The snapshot's manifest, checked as hostile input; its chunk size must be the checksum block."""
    m = parse_manifest(json.dumps(snap.body["manifest"]).encode())
    if snap.body.get("chunk_bytes") != m.block_bytes or m.block_bytes % PAGE:
        raise CorruptCheckpointError(f"snapshot {snap.header}: chunk size is not the checksum block", file=snap.header)
    return m


def _chunk_table(snap: Snapshot, block: int, size: int) -> dict[tuple[int, int], tuple[int, int]]:
    """{(stripe, offset in it): (offset in the pool file, length)}, every chunk inside the pool file."""
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for c in snap.body["chunks"]:
        f, off, n, pool_off = (int(x) for x in c)
        if pool_off < 0 or pool_off % PAGE or pool_off + n > size or off % block or n > block:
            raise CorruptCheckpointError(f"snapshot {snap.header}: chunk at {off} of stripe {f} lies outside "
                                         f"{snap.pool}", file=snap.header)
        where[(f, off)] = (pool_off, n)
    return where


def _lock_policy(snap: Snapshot, fd: int, take: bool, adopt: bool) -> tuple[bool, bool]:
    """(take, adopt) as the locks allow: a pool in use, or holding other snapshots, is not
    taken; one a live writer holds is copied, not adopted."""
    if take and (_shares_pool(snap) or not _try_lock(fd, fcntl.LOCK_EX)):
        log.info("flashwrite: %s is in use or holds other snapshots; not taking it", snap.pool)
        take = False
    if not take and adopt and not _try_lock(fd, fcntl.LOCK_SH):
        log.info("flashwrite: %s is in use by a live writer; copying the snapshot instead of adopting it", snap.pool)
        adopt = False
    if not (take or adopt):
        _try_lock(fd, fcntl.LOCK_SH)  # while copying, keeps a restore in another process from taking it
    return take, adopt


@dataclass
class _Pieces:
    """What one native copy_verify pass does, and for whom."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)  # (dst, src or 0 in place, n, checksum)
    owners: list[tuple[str, int, str]] = field(default_factory=list)       # (key, offset, expected) per piece
    kept: list[tuple[int, int]] = field(default_factory=list)              # the pool's pages taken tensors map


def _plan_pieces(snap: Snapshot, m: Manifest, where: dict, size: int, fd: int, pool_addr: int,
                 targets: dict[str, torch.Tensor], take: bool, adopt: bool) -> _Pieces:
    """Each tensor's destination (a target, the pool's own pages, or fresh memory) and the
    pieces to copy (or, in place, only to check) against the manifest's checksums."""
    block = m.block_bytes
    plan = _Pieces()
    segments_left = ADOPT_MAX_SEGMENTS
    for key, e in m.tensors.items():
        dt = dtypes.dtype_from_name(e.dtype)
        dst, raw, in_place = _target_bytes(targets.get(key), dt, e), None, False
        if dst is not None:
            raw = dst.detach().reshape(-1).view(torch.uint8)
        elif (take or adopt) and e.nbytes >= ADOPT_MIN_BYTES:
            segs = _segments(snap, where, block, size, key, e.file, e.offset, e.nbytes)
            if len(segs) <= segments_left:
                segments_left -= len(segs)
                mapping = _core.SnapshotMapping(fd, segs, e.offset % PAGE, e.nbytes, shared=take)
                raw, in_place = torch.frombuffer(mapping, dtype=torch.uint8), True
                if take:
                    plan.kept += segs
        if raw is None:
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
        base_addr = raw.data_ptr() if e.nbytes else 0
        for (pos, n), expected in zip(piece_ranges(e.offset, e.nbytes, block), e.checksums):
            base = pos - pos % block
            loc = where.get((e.file, base))
            if loc is None or pos - base + n > loc[1]:
                raise CorruptCheckpointError(f"snapshot {snap.header}: no chunk holds {key!r} at {pos}",
                                             file=snap.header, tensor=key)
            src = pool_addr + loc[0] + pos - base
            plan.pieces.append((0, base_addr + pos - e.offset, n, int(expected, 16)) if in_place
                               else (base_addr + pos - e.offset, src, n, int(expected, 16)))
            plan.owners.append((key, pos, expected))
        plan.tensors[key] = dst if dst is not None else raw.view(dt).view(e.shape)
    return plan


def _target_bytes(dst: torch.Tensor | None, dt: torch.dtype, e: Any) -> torch.Tensor | None:
    """The caller's tensor for an entry, where it can take the bytes as they are stored."""
    if (dst is not None and dst.device.type == "cpu" and dst.dtype == dt and tuple(dst.shape) == e.shape
            and dst.is_contiguous() and e.nbytes):
        return dst
    return None


def _give_up_taken(snap: Snapshot, fd: int, kept: list[tuple[int, int]], size: int) -> None:
    """A taken pool is ours alone now: its files go (a damaged one too: storage holds the
    step), and the pages no taken tensor maps are freed."""
    unlink_quietly(snap.header)
    unlink_quietly(snap.pool)
    try:
        _core.punch_holes(fd, kept, size)
    except OSError as e:
        log.warning("flashwrite: the unused pages of %s stay allocated while its tensors live: %s", snap.pool, e)


def _mismatch(snap: Snapshot, m: Manifest, owners: list, bad: list) -> ChecksumMismatchError:
    i, actual = bad[0]
    key, pos, expected = owners[i]
    e = m.tensors[key]
    return ChecksumMismatchError(f"local snapshot {snap.header}: tensor {key!r} at offset {pos} of "
                                 f"{m.files[e.file].name} does not match its checksum",
                                 file=snap.header, tensor=key, offset=pos, expected=expected,
                                 actual=f"{actual:016x}")


def _segments(snap: Snapshot, where: dict, block: int, size: int, key: str, file: int, offset: int,
              nbytes: int) -> list[tuple[int, int]]:
    """The pool file's whole pages that hold stripe bytes [offset, offset + nbytes), in
    order: (pool offset, length), contiguous runs merged."""
    a, end = offset - offset % PAGE, -(-(offset + nbytes) // PAGE) * PAGE
    out: list[list[int]] = []
    while a < end:
        c = a - a % block
        loc = where.get((file, c))
        b = min(end, c + block)
        if loc is None or loc[0] + b - c > size:
            raise CorruptCheckpointError(f"snapshot {snap.header}: no chunk holds {key!r} at {a}",
                                         file=snap.header, tensor=key)
        off = loc[0] + a - c
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += b - a
        else:
            out.append([off, b - a])
        a = b
    return [(o, n) for o, n in out]
