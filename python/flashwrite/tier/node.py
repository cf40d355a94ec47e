"""The node-local tier of one Writer: its pool file, its snapshots, its neighbour's copies.

``LocalTier`` is what a ``Writer`` made with ``local_snapshots=True`` holds, and what
the save life cycle (``session.py``) and the restore across tiers (``restore.py``) are
handed: the staging pool's file (``LocalPool``), the store of neighbour copies
(``neighbour.Store``, with ``neighbour_copies=True``), and the snapshots in its
``local_dir`` (scan, read, remove). The snapshot format itself is ``local.py``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

from . import snapshot as local, neighbour
from ..system.coord import Coordinator
from ..format import Manifest
from ..system.owner import this_owner

log = logging.getLogger("flashwrite")


class _Held:
    """A snapshot this process wrote: its header and the job whose slots hold its bytes."""

    def __init__(self, header: str, body: dict, job: Any):
        self.header, self.body, self.job = header, body, job
        self.released = False


class LocalPool:
    """The local tier of one Writer: names its pool file, writes and retires its headers."""

    def __init__(self, local_dir: str | os.PathLike | None):
        self.dir = os.path.abspath(os.fspath(local_dir) if local_dir is not None else local.default_dir())
        os.makedirs(self.dir, exist_ok=True)
        self.owner = this_owner()
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.pool_path = os.path.join(self.dir, f"{local.PREFIX}{self.token}{local.POOL_SUFFIX}")
        self._seq = 0
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self._said: set[str] = set()

    def say_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(msg, *args)

    def before_save(self) -> None:
        """The next save may reuse the slots of every finished save: their headers go first."""
        with self._lock:
            for h in [h for h in self._held if h.released]:
                local.unlink_quietly(h.header)
                self._held.remove(h)

    def seal(self, engine: Any, sw: Any, path: str, rank: tuple[int, int] | None = None) -> _Held | None:
        """Once ``sw`` (a StripeWrite started with hold_slots) is staged and checksummed,
        write its header. None when there is no whole image to point at."""
        job = sw.job
        if not job.holds_slots:
            self.say_once("bounded", "flashwrite: a save is larger than max_staging_bytes, so it has no local "
                          "snapshot (the pool reuses its slots within the save)")
            return None
        job.wait_checksummed()
        if not job.checksummed:
            return None  # failed or cancelled: the future says why
        slots = job.chunk_slots()
        if any(off < 0 for *_, off in slots):
            self.say_once("private", "flashwrite: %s is too small for the staging pool (%s); local snapshots are "
                          "off and the pool uses private memory", self.dir, engine.backing_error or "no room")
            return None
        with self._lock:
            self._seq += 1
            header = os.path.join(self.dir, f"{local.PREFIX}{self.token}-{self._seq:06d}{local.HEADER_SUFFIX}")
        body = {"format": local.FORMAT, "version": local.VERSION, "owner": self.owner, "pool": os.path.basename(self.pool_path),
                "path": path, "state": "staged", "created": time.time(), "chunk_bytes": engine.chunk_bytes,
                "chunks": [list(c) for c in slots], "manifest": sw.manifest()}
        if rank is not None:
            body["rank"], body["world_size"] = rank
        local.write_header(header, body)
        held = _Held(header, body, job)
        with self._lock:
            self._held.append(held)
        return held

    def mark(self, held: _Held, state: str) -> None:
        held.body["state"] = state
        local.write_header(held.header, held.body)

    def release(self, held: _Held | None, job: Any) -> None:
        """The save has ended: its slots go back to the pool (the header stays until
        the next save starts)."""
        job.release_slots()
        if held is not None:
            with self._lock:
                held.released = True

    def close(self, keep_newest: bool) -> bool:
        """Remove this pool's headers (keep_newest: all but the newest), except those of
        saves that never committed (the only copy). True when the pool file must stay."""
        with self._lock:
            held, self._held = self._held, []
        keep = held[-1:] if keep_newest else []
        for h in held:
            if h in keep:
                continue
            if h.body["state"] != "committed":
                log.warning("flashwrite: keeping local snapshot %s of %s: it never reached storage", h.header,
                            h.body["path"])
                keep.append(h)
                continue
            local.unlink_quietly(h.header)
        return bool(keep)


class LocalSave:
    """The local snapshot of one save, on both save paths: ``seal()`` once staged (from
    the caller and from the commit thread, whichever comes first), ``committed()``
    after the commit, ``end()`` when the save is over either way."""

    def __init__(self, pool: LocalPool, sw: Any, path: str, rank: tuple[int, int] | None = None):
        self.pool, self.sw, self.path, self.rank = pool, sw, path, rank
        self._lock = threading.Lock()
        self._sealed = False
        self.held: _Held | None = None

    def seal(self) -> None:
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
            try:
                self.held = self.pool.seal(self.sw.engine, self.sw, self.path, self.rank)
            except Exception as e:  # the snapshot is a bonus: never fail the save for it
                log.warning("flashwrite: no local snapshot of %s: %s", self.path, e)

    def snapshot(self) -> local.Snapshot | None:
        """The snapshot sealed for this save (after seal()), or None."""
        h = self.held
        return None if h is None else local.Snapshot.of(h.header, self.pool.pool_path, h.body)

    def committed(self) -> None:
        if self.held is not None:
            try:
                self.pool.mark(self.held, "committed")
            except OSError as e:
                log.warning("flashwrite: local snapshot of %s not marked committed: %s", self.path, e)

    def end(self) -> None:
        self.sw.job.wait()  # the slots go back only once no write uses them
        with self._lock:
            self._sealed = True  # too late for a header now
        self.pool.release(self.held, self.sw.job)


class LocalTier:
    """The local tier of one Writer: its pool, its neighbour store and the snapshots in its
    local_dir. Handed to whoever needs it (the save session, the manager's restore)."""

    def __init__(self, local_dir: str | os.PathLike | None = None, neighbour_copies: bool = False):
        self.pool = LocalPool(local_dir)
        # Copies of rank r-1's snapshots (multi-rank saves only); None without neighbour_copies.
        self.neighbours = neighbour.Store(self.pool) if neighbour_copies else None

    @property
    def dir(self) -> str:
        return self.pool.dir

    @property
    def pool_path(self) -> str:
        """The file the Writer's staging pool is mapped from."""
        return self.pool.pool_path

    # ------------------------------------------------------------- saving

    def before_save(self) -> None:
        self.pool.before_save()

    def local_save(self, sw: Any, path: str, rank: tuple[int, int] | None = None) -> LocalSave:
        """The snapshot of one save (``sw`` started with hold_slots)."""
        return LocalSave(self.pool, sw, path, rank)

    def exchange(self, coord: Coordinator, ls: LocalSave) -> None:
        """Neighbour copies of a multi-rank save (every rank, on the coordination thread)."""
        if self.neighbours is not None:
            neighbour.exchange(coord, ls.snapshot(), self.neighbours)

    def committed(self, ls: LocalSave, path: str) -> None:
        """The save of ``path`` committed: its snapshot, and the neighbour's copy of it, say so."""
        ls.committed()
        if self.neighbours is not None:
            self.neighbours.committed(path)

    def close(self, keep_newest: bool) -> bool:
        """Remove this tier's snapshots (keep_newest: all but the newest; never one that did not
        reach storage). True when the pool file must stay."""
        if self.neighbours is not None:
            self.neighbours.close(keep_newest=keep_newest)
        return self.pool.close(keep_newest=keep_newest)

    def remove_pool_file(self) -> None:
        local.unlink_quietly(self.pool.pool_path)

    # ------------------------------------------------------------- restoring

    def candidates(self, step_of: Callable[[str], int | None], rank: tuple[int, int] | None,
                   replicas: bool = False) -> dict[int, list[local.Snapshot]]:
        """Snapshots in local_dir by step (``step_of`` names a checkpoint path's step, or None for
        another root's), newest first per step: this rank's own, or (replicas) the copies it
        holds of rank r-1's."""
        whose = rank or (None, None)
        if replicas:
            if rank is None:
                return {}
            whose = ((rank[0] - 1) % rank[1], rank[1])
        out: dict[int, list[local.Snapshot]] = {}
        for snap in local.scan(self.dir):
            step = step_of(snap.path)
            mine = (snap.body.get("rank"), snap.body.get("world_size")) == whose
            if step is not None and mine and bool(snap.body.get("replica")) == replicas:
                out.setdefault(step, []).append(snap)
        return out

    def remove_dead(self, step_of: Callable[[str], int | None], rank: tuple[int, int] | None,
                    doomed: Callable[[int], bool]) -> list[str]:
        """Remove dead owners' snapshots (own and replicas) of the steps ``doomed`` picks (never
        the only copy of the newest step: callers pick only steps a committed one covers).
        Returns the header names removed."""
        removed = []
        for step, snaps in [*self.candidates(step_of, rank).items(), *self.candidates(step_of, rank, True).items()]:
            for snap in snaps:
                if doomed(step) and not snap.alive:
                    local.remove(snap)
                    log.info("removed local snapshot of step %d (%s): its process is gone", step, snap.header)
                    removed.append(os.path.basename(snap.header))
        return removed

    def read(self, snap: local.Snapshot, **options: Any) -> tuple[Manifest, dict]:
        """``local.read_snapshot``: (manifest, tensors), every piece verified."""
        return local.read_snapshot(snap, **options)

    def remove(self, snap: local.Snapshot) -> None:
        local.remove(snap)

    def remove_orphan_pools(self) -> None:
        local.remove_orphan_pools(self.dir)

    def fetch_store(self) -> neighbour.Store:
        """Where a snapshot fetched back from a neighbour at restore goes."""
        return self.neighbours if self.neighbours is not None else neighbour.Store(self.pool)
