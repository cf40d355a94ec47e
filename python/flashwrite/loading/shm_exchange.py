"""Ranks on one host exchange what they read through shared memory (/dev/shm).

A load that reads each stored byte once (replica groups: ``loading/replicas.py``; DCP's
read-once loads: ``integrations/dcp/read_once.py``) then hands each rank the tensors
other ranks read. Between processes of one host that is cheapest through shared
memory. Each rank publishes its tensors in a file in /dev/shm (a ``Board``:
``flashwrite-replicas-<pid>-<n>-<index>``, allocated up front so that a full /dev/shm
fails there and not in a copy), each tensor in pages of its own at the offset within
its page it has in its stripe, so the load reads the large ones with O_DIRECT straight
into the file (``Board.tensor``: the tensor the load returns on this rank, mapping
just its own pages) and copies in only the others. Every rank maps its peers' files
with their page tables filled in at once (``MAP_POPULATE``), the files are removed as
soon as every rank has mapped them, and each rank copies out the tensors it wants,
checking each against its checksums in the same pass (the caller's ``receive``). That
is one copy per byte per receiving rank, what a read from a shared page cache costs;
TCP on loopback costs two copies in the kernel and a checksum pass.

``exchange`` returns None when a rank could not make its file or map its peers' (no
/dev/shm, ENOSPC): nothing is left behind, every rank still holds what it read, and
the caller exchanges another way (gloo). ``FLASHWRITE_REPLICA_SHM=0`` always does.

A rank killed before its file is removed (kill -9, the OOM killer) cannot remove it, and
/dev/shm is memory. So each rank holds an flock on its file for as long as the file is
its, and every new board first removes the files no process holds (``sweep``): the lock
goes with the process, whatever its pid namespace, so a live rank's file is never taken.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import logging
import mmap
import os
import socket
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import _core, defaults
from ..errors import DistributedLoadError

SHM_DIR = "/dev/shm"
PREFIX = "flashwrite-replicas-"
# A file younger than this is left to its maker, which locks it right after making it.
STALE_AFTER_S = 5.0
log = logging.getLogger("flashwrite")
_exchanges = itertools.count()
_one_host: dict[int, bool] = {}  # id(group) -> whether its ranks share a host (asked once)


def _host_key() -> str:
    """What ranks on one host (one kernel, one /dev/shm) have alike; "" without /dev/shm."""
    try:
        dev = os.stat(SHM_DIR).st_dev
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}|{boot}|{dev}"


def _lost(e: BaseException, what: str) -> DistributedLoadError:
    return DistributedLoadError(f"{what}: lost a peer during the exchange of what each rank read: "
                                f"{type(e).__name__}: {e}")


def on_one_host(group: Any, size: int, what: str) -> bool:
    """Whether every rank of ``group`` runs on this host (collective on first use)."""
    if os.environ.get("FLASHWRITE_REPLICA_SHM", "1") == "0":
        return False
    got = _one_host.get(id(group))
    if got is None:
        keys: list = [None] * size
        try:
            dist.all_gather_object(keys, _host_key(), group=group)
        except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
            raise _lost(e, what) from e
        got = _one_host[id(group)] = bool(keys[0]) and all(k == keys[0] for k in keys)
    return got


def _flags(group: Any, size: int, values: list[int], what: str) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(size)]
    try:
        dist.all_gather(out, t, group=group)
    except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
        raise _lost(e, what) from e
    return [o.tolist() for o in out]


def _name(pid: int, n: int, index: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{pid}-{n}-{index}")


def sweep() -> int:
    """Remove the boards left by processes that died holding them (no lock held, not
    made in the last STALE_AFTER_S seconds); the bytes freed. Never raises."""
    freed = 0
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if time.time() - st.st_ctime < STALE_AFTER_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # EWOULDBLOCK: its process lives
            if os.stat(path).st_ino == st.st_ino:
                os.unlink(path)
                freed += st.st_blocks * 512
                log.warning("flashwrite: removed %s (%d MiB), left in shared memory by a load whose "
                            "process died", path, st.st_blocks * 512 >> 20)
        except OSError:
            continue
        finally:
            os.close(fd)
    return freed


@contextlib.contextmanager
def _mapped(path: str, size: int) -> Iterator[int]:
    """The address of a file in /dev/shm, mapped shared with its page tables filled in at
    once (MAP_POPULATE: far cheaper than a fault per 4 KiB page as it is touched)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    try:
        head = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(head)
        del head  # the mapping's buffer is not exported while it is used by address
        yield addr
    finally:
        mm.close()


PAGE = 4096


def places(published: list[list[tuple[str, int, int]]]) -> list[tuple[int, dict[str, int]]]:
    """Each rank's file for ``published[r]``, [(key, nbytes, align)] in order: its size,
    and where each key's first byte is (in pages of its own, at ``align`` in its first
    page). The same on every rank."""
    out = []
    for keys in published:
        at, where = 0, {}
        for k, n, align in keys:
            where[k] = at + align
            at += -(-(align + n) // PAGE) * PAGE
        out.append((at, where))
    return out


class Board:
    """This rank's file of published tensors in /dev/shm (see the module doc); ``ok``
    False when it could not be made (then nothing is left, and ``tensor`` gives None)."""

    def __init__(self, index: int, published: list[list[tuple[str, int, int]]]):
        """published: what every rank publishes (see ``places``); this rank is ``index``."""
        self.n, self.index, self.published = next(_exchanges), index, published
        self.lay = places(published)
        size, self.where = self.lay[index]
        self.path, self.size = _name(os.getpid(), self.n, index), size
        self.made: dict[str, int] = {}  # key -> address of the tensor made on the file
        self.ok = True
        self._lock = -1  # held (flock) while the file is this rank's; see ``sweep``
        if size:
            sweep()
            try:
                self._lock = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._lock, fcntl.LOCK_EX)
                os.posix_fallocate(self._lock, 0, size)  # ENOSPC here, not SIGBUS in a copy
            except OSError:
                self.ok = False
                self.remove()

    def tensor(self, key: str, nbytes: int, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """A tensor of exactly ``key``'s bytes in the file, on a mapping of its own pages
        (kept alive by the tensor, after the file is gone); None if the board failed."""
        if not self.ok:
            return None
        at = self.where[key]
        start = at // PAGE * PAGE
        length = -(-(at + nbytes) // PAGE) * PAGE - start
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, offset=start)
            finally:
                os.close(fd)
        except OSError:
            self.ok = False
            return None
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=at - start)
        self.made[key] = t.data_ptr()
        return t.view(dtype).view(shape)

    def fill(self, keys: list[tuple[str, int, int]], have: dict[str, torch.Tensor]) -> None:
        """Copy into the file each of ``keys`` not already read into it."""
        with _mapped(self.path, self.size) as base:
            pieces = [(base + self.where[k], have[k].data_ptr(), n, 0) for k, n, _ in keys
                      if self.made.get(k) != have[k].data_ptr()]
            if pieces:
                _core.copy_verify(pieces, False, defaults.COPY_THREADS)

    def remove(self) -> None:
        """Remove the file (idempotent); tensors made on it keep their mappings."""
        if self._lock >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._lock)
            self._lock = -1


def exchange(group: Any, index: int, size: int, board: Board, have: dict[str, torch.Tensor],
             wanted: dict[int, set[str]], receive: Callable[[str, int, int], torch.Tensor],
             what: str) -> dict[str, torch.Tensor] | None:
    """Collective over ``group`` (this rank is ``index`` of ``size``): rank r publishes
    ``board.published[r]`` (every rank's board made from the same lists; rank r holds
    those keys in ``have``, some maybe read into its board already); this rank takes
    ``wanted[src]`` from each src, each through ``receive(key, src, address)``, which
    makes, fills and checks the tensor. The tensors received, or None (see the module
    doc). The board's file is gone when this returns."""
    published, lay = board.published, board.lay
    ok = board.ok
    views = contextlib.ExitStack()
    try:
        try:
            if ok and board.size:
                board.fill(published[index], have)
        except OSError:
            ok = False
        peers = _flags(group, size, [int(ok), os.getpid(), board.n], what)
        if not all(p[0] for p in peers):
            return None
        try:
            at = {src: views.enter_context(_mapped(_name(peers[src][1], peers[src][2], src), lay[src][0]))
                  for src in sorted(wanted) if wanted[src] and src != index}
        except OSError:
            ok, at = False, {}
            views.close()
        # Every rank has mapped its peers' files (or says it could not): they may go.
        if not all(p[0] for p in _flags(group, size, [int(ok)], what)):
            views.close()
            return None
    finally:
        board.remove()
    out: dict[str, torch.Tensor] = {}
    with views:
        for src, base in at.items():
            for k in wanted[src]:
                out[k] = receive(k, src, base + lay[src][1][k])
    return out
