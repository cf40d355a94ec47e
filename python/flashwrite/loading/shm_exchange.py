"""Ranks on one host exchange what they read through shared memory (/dev/shm).

A load that reads each stored byte once (replica groups: ``loading/replicas.py``; DCP's
read-once loads: ``integrations/dcp/read_once.py``) then hands each rank the tensors
other ranks read. Between processes of one host that is cheapest through shared
memory: each rank copies what it publishes into a file in /dev/shm
(``flashwrite-replicas-<pid>-<n>-<index>``, allocated up front so that a full /dev/shm
fails there and not in the copy), every rank maps its peers' files with their page
tables filled in at once (``MAP_POPULATE``), the files are removed as soon as every
rank has mapped them, and each rank copies out the tensors it wants, checking each
against its checksums in the same pass (the caller's ``receive``). That is one copy
per byte per receiving rank, what a read from a shared page cache costs; TCP on
loopback costs two copies in the kernel and a checksum pass.

``exchange`` returns None when a rank could not make its file or map its peers' (no
/dev/shm, ENOSPC): nothing is left behind, every rank still holds what it read, and
the caller exchanges another way (gloo). ``FLASHWRITE_REPLICA_SHM=0`` always does.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import socket
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import _core, defaults
from ..errors import DistributedLoadError

SHM_DIR = "/dev/shm"
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
    return os.path.join(SHM_DIR, f"flashwrite-replicas-{pid}-{n}-{index}")


def _publish(path: str, spans: list[tuple[int, int]], size: int) -> None:
    """A file of ``size`` bytes at ``path`` holding the (address, nbytes) spans in turn."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS in the copy
    finally:
        os.close(fd)
    with _mapped(path, size) as at:
        pieces = []
        for addr, n in spans:
            pieces.append((at, addr, n, 0))
            at += n
        _core.copy_verify(pieces, False, defaults.COPY_THREADS)


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


def exchange(group: Any, index: int, size: int, published: list[list[tuple[str, int]]],
             have: dict[str, torch.Tensor], wanted: dict[int, set[str]],
             receive: Callable[[str, int, int], torch.Tensor], what: str) -> dict[str, torch.Tensor] | None:
    """Collective over ``group`` (this rank is ``index`` of ``size``): rank r publishes
    ``published[r]``, [(key, nbytes)] in that order (every rank passes the same lists;
    rank r holds those keys in ``have``); this rank takes ``wanted[src]`` from each src,
    each through ``receive(key, src, address)``, which makes, fills and checks the
    tensor. The tensors received, or None (see the module doc)."""
    sizes = [sum(n for _, n in keys) for keys in published]
    n = next(_exchanges)
    mine = _name(os.getpid(), n, index)
    ok = 1
    views = contextlib.ExitStack()
    try:
        try:
            if sizes[index]:
                _publish(mine, [(have[k].data_ptr(), nb) for k, nb in published[index]], sizes[index])
        except OSError:
            ok = 0
        peers = _flags(group, size, [ok, os.getpid(), n], what)
        if not all(p[0] for p in peers):
            return None
        try:
            at = {src: views.enter_context(_mapped(_name(peers[src][1], peers[src][2], src), sizes[src]))
                  for src in sorted(wanted) if wanted[src] and src != index}
        except OSError:
            ok, at = 0, {}
            views.close()
        # Every rank has mapped its peers' files (or says it could not): they may go.
        if not all(p[0] for p in _flags(group, size, [ok], what)):
            views.close()
            return None
    finally:
        if os.path.exists(mine):
            os.unlink(mine)
    out: dict[str, torch.Tensor] = {}
    with views:
        for src, addr in at.items():
            for k, nb in published[src]:
                if k in wanted[src]:
                    out[k] = receive(k, src, addr)
                addr += nb
    return out
