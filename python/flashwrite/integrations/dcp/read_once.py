"""DCP loads that read each stored stripe once (``FlashwriteStorageReader(read_once=True)``).

When several ranks' load plans need bytes of the same stripe (a DDP model saved through
DCP and loaded by every rank, an HSDP restart, a reshard), the coordinator's
``prepare_global_plan`` gives each stripe one reader among the ranks that need it,
balanced by bytes (``system.replicas.balance``, as replica-group loads do), and cuts the
stripes into rounds of at most ``max_read_bytes``. Every rank's plan carries that
schedule. In ``read_data`` each rank reads with O_DIRECT only the stripes given to it
(verified as they are read), the ranks agree on any failure before they exchange, and
each reader hands every other needer the tensors it needs from that stripe: through
shared memory when the load's ranks are on one host (``loading/shm_exchange.py``: each
reader publishes once what any needer wants of its stripes, each needer copies out its
own), else packed, on a gloo group of the load's ranks (point to point). What a rank
receives is checked against the manifest's checksums while it is copied out. A peer
lost mid-exchange fails the load with ``DistributedLoadError``.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ... import _core, defaults
from ...errors import DistributedLoadError
from ...format.dtypes import dtype_from_name
from ...loading import shm_exchange
from ...loading.replicas import as_bytes, verify_received
from ...system.coord import DEFAULT_TIMEOUT_S
from ...system.replicas import balance
from .section import StoredChunk

__all__ = ["PLAN_KEY", "schedule", "exchange_group", "agree", "exchange"]

PLAN_KEY = "flashwrite.read_once"  # a LoadPlan's storage_data when the load reads once

_groups: dict[tuple, Any] = {}
_lock = threading.Lock()


def schedule(plans: list, storage_data: dict, aliases: dict[str, str], sizes: dict[str, int],
             max_bytes: int) -> list:
    """The coordinator's plans with each rank's read schedule, or ``plans`` unchanged when
    no stripe is needed by more than one rank."""
    needs: dict[str, dict[int, set[str]]] = {}
    for i, plan in enumerate(plans):
        for req in plan.items:
            sd = storage_data.get(req.storage_index)
            if isinstance(sd, StoredChunk):
                needs.setdefault(sd.file, {}).setdefault(i, set()).add(aliases.get(sd.key, sd.key))
    if all(len(by_rank) == 1 for by_rank in needs.values()):
        return plans
    names = sorted(needs)
    owner = balance({fi: sizes[n] for fi, n in enumerate(names)}, len(plans),
                    prefer={fi: sorted(needs[n]) for fi, n in enumerate(names)})
    rounds: list[list[str]] = [[]]
    held = 0
    for n in names:
        if rounds[-1] and held + sizes[n] > max_bytes:
            rounds.append([])
            held = 0
        rounds[-1].append(n)
        held += sizes[n]
    shared = {"reader": {n: owner[fi] for fi, n in enumerate(names)}, "rounds": rounds,
              "needs": {n: {r: sorted(keys) for r, keys in by_rank.items()} for n, by_rank in needs.items()}}
    return [dataclasses.replace(p, storage_data={PLAN_KEY: dict(shared, me=i)}) for i, p in enumerate(plans)]


def exchange_group(process_group: Any, timeout: float | None) -> Any:
    """A gloo group over the load's ranks (made by them alone, once per set of ranks)."""
    ranks = tuple(dist.get_process_group_ranks(process_group))
    t = float(timeout or DEFAULT_TIMEOUT_S)
    with _lock:
        got = _groups.get((ranks, t))
    if got is None:
        got = dist.new_group(list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=t),
                             use_local_synchronization=True)
        with _lock:
            got = _groups.setdefault((ranks, t), got)
    return got


def _lost(group: Any, e: BaseException, what: str) -> DistributedLoadError:
    return DistributedLoadError(f"{what}: lost a peer of the load's ranks {dist.get_process_group_ranks(group)} "
                                f"during the exchange of what each rank read: {type(e).__name__}: {e}")


def agree(group: Any, error: BaseException | None, what: str, doing: str = "read their share of the stripes") -> None:
    """Every rank learns whether one failed to read its share (or to check what it
    received: ``doing``); a failed rank raises its own error."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int64)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(flags, flag, group=group)
    except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
        raise _lost(group, e, what) from (error or e)
    if error is not None:
        raise error
    failed = [dist.get_global_rank(group, i) for i, f in enumerate(flags) if f.item()]
    if failed:
        raise DistributedLoadError(f"{what}: rank(s) {failed} failed to {doing}; see their errors")


def _pack(keys: list[str], have: dict[str, torch.Tensor]) -> torch.Tensor:
    buf = torch.empty(sum(have[k].nbytes for k in keys), dtype=torch.uint8)
    at = 0
    for k in keys:
        n = have[k].nbytes
        buf[at:at + n].copy_(as_bytes(have[k]))
        at += n
    return buf


def exchange(group: Any, sched: dict, files: list[str], m: Any, have: dict[str, torch.Tensor],
             verify: bool, what: str, shown: str) -> dict[str, torch.Tensor]:
    """Send what this rank read of ``files`` to every other rank that needs it and receive
    what it needs from theirs; the received tensors, verified against ``m``."""
    me, works, inbound = sched["me"], [], []
    size = dist.get_world_size(group)
    if shm_exchange.on_one_host(group, size, what):
        got = _exchange_shm(group, size, sched, files, m, have, verify, what, shown)
        if got is not None:
            return got
    packed: dict[tuple, torch.Tensor] = {}
    try:
        for name in files:
            src = sched["reader"][name]
            for dst, keys in sorted(sched["needs"][name].items()):
                keys = [k for k in keys if m.tensors[k].nbytes]
                if dst == src or not keys or me not in (src, dst):
                    continue
                if me == src:
                    if tuple(keys) not in packed:  # DDP: every needer wants the same keys, packed once
                        packed[tuple(keys)] = _pack(keys, have)
                    buf = packed[tuple(keys)]
                    works.append(dist.isend(buf, dst=dist.get_global_rank(group, dst), group=group))
                else:
                    buf = torch.empty(sum(m.tensors[k].nbytes for k in keys), dtype=torch.uint8)
                    works.append(dist.irecv(buf, src=dist.get_global_rank(group, src), group=group))
                    inbound.append((keys, buf, src))
        for w in works:
            w.wait()
    except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
        raise _lost(group, e, what) from e
    return _unpack(inbound, m, group, verify, shown)


def _exchange_shm(group: Any, size: int, sched: dict, files: list[str], m: Any, have: dict[str, torch.Tensor],
                  verify: bool, what: str, shown: str) -> dict[str, torch.Tensor] | None:
    """``exchange`` through shared memory: each reader publishes, once, every key another
    rank needs of its stripes; each rank copies out what it needs (None: the gloo way)."""
    me = sched["me"]
    published: list[list[tuple[str, int, int]]] = [[] for _ in range(size)]
    seen: list[set[str]] = [set() for _ in range(size)]
    wanted: dict[int, set[str]] = {}
    for name in files:  # the same order on every rank
        src = sched["reader"][name]
        for dst, keys in sorted(sched["needs"][name].items()):
            keys = [k for k in keys if m.tensors[k].nbytes]
            if dst == src or not keys:
                continue
            for k in keys:
                if k not in seen[src]:
                    seen[src].add(k)
                    published[src].append((k, m.tensors[k].nbytes, 0))
            if dst == me:
                wanted.setdefault(src, set()).update(keys)

    def receive(k: str, src: int, addr: int) -> torch.Tensor:
        e = m.tensors[k]
        t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        if verify:
            verify_received(m, k, t, dist.get_global_rank(group, src), shown, src_ptr=addr)
        else:
            _core.copy_verify([(t.data_ptr(), addr, e.nbytes, 0)], False, defaults.COPY_THREADS)
        return t

    return shm_exchange.exchange(group, me, size, shm_exchange.Board(me, published), have, wanted, receive, what)


def _unpack(inbound: list, m: Any, group: Any, verify: bool, shown: str) -> dict[str, torch.Tensor]:
    """Each received tensor copied out of its packed buffer, checked as it is copied."""
    out: dict[str, torch.Tensor] = {}
    for keys, buf, src in inbound:
        at = 0
        for k in keys:
            e = m.tensors[k]
            t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
            if verify:
                verify_received(m, k, t, dist.get_global_rank(group, src), shown, src_ptr=buf.data_ptr() + at)
            else:
                as_bytes(t).copy_(buf[at:at + e.nbytes])
            out[k] = t
            at += e.nbytes
    return out


def empty_tensors(keys: set[str], m: Any) -> dict[str, torch.Tensor]:
    """Tensors of no bytes: nothing to read or send, made where they are needed."""
    return {k: torch.empty(m.tensors[k].shape, dtype=dtype_from_name(m.tensors[k].dtype))
            for k in keys if not m.tensors[k].nbytes}

