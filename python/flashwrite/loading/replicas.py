"""The load side of replica groups: each stored byte read once per replica group.

A multi-rank load with ``replica_group=`` finds the tensors every rank of its replica
group needs (the group's replicated state, wherever and however it was saved), gives
each stripe holding them to one rank of the group (balanced by bytes, as a save does),
reads with O_DIRECT only its share and its own tensors, and then the group exchanges
the shared tensors:

- ranks on one host (the group's members all see the same host, boot and /dev/shm):
  through shared memory (``shm_exchange.py``). Each rank reads its share's large
  tensors straight into a file in /dev/shm made before the read (a ``Board``) and
  copies in the rest; every rank maps its peers' files (removed once all have mapped
  them) and copies each tensor out, checking it against its checksum in the same pass:
  one copy per byte per receiving rank, as a read from a shared page cache costs, where
  TCP on loopback costs two and a checksum pass. ``FLASHWRITE_REPLICA_SHM=0`` turns it
  off; a rank that cannot make its file (no /dev/shm, ENOSPC) sends the whole group the
  other way.
- otherwise on the group's own gloo group (``system.replicas``): each rank broadcasts
  what it read, large tensors straight from their memory, small ones packed into
  buckets. Every piece is checked against its checksum where it lands (XXH3 while it
  is copied out of a bucket, or in place). A failure on any rank (a corrupt stripe, an I/O
error) is agreed on before the exchange, so every rank raises instead of waiting for
it; a peer that dies mid-exchange fails the others with ``DistributedLoadError`` at
once (its connections close) or after the group's timeout.

The exchange is on host memory: CUDA destinations (``map_location``) are filled from
the host tensors once exchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _core, defaults
from ..errors import ChecksumMismatchError, DistributedLoadError
from ..format import piece_ranges
from ..format.dtypes import dtype_from_name
from ..format.merge import select_rank
from ..state.flatten import flatten
from ..state.rebuild import unflatten
from ..system.replicas import ReplicaLayout, balance
from ..system import gcpause
from . import read_plan, shm_exchange
from .read import CheckpointDir, fill_into, tensor_placer

BUCKET_BYTES = 64 << 20   # small tensors go in buckets of up to this many bytes
DIRECT_BYTES = 16 << 20   # a tensor this large is broadcast from its own memory


def _agree(layout: ReplicaLayout, error: BaseException | None, what: str, doing: str = "read their share") -> None:
    """Every rank learns whether one failed; a failed rank raises its own error."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int64)
    flags = [torch.zeros_like(flag) for _ in range(layout.size)]
    try:
        dist.all_gather(flags, flag, group=layout.group)
    except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
        raise DistributedLoadError(f"{what}: lost a peer of the replica group (ranks {list(layout.members)}): "
                                   f"{type(e).__name__}: {e}") from (error or e)
    if error is not None:
        raise error
    failed = [layout.members[i] for i, f in enumerate(flags) if f.item()]
    if failed:
        raise DistributedLoadError(f"{what}: rank(s) {failed} of the replica group failed to {doing}; "
                                   "see their errors")


def load_replicated(path: Any, layout: ReplicaLayout, rank: int, size: int, *, map_location: Any, into: Any,
                    verify: bool, allow_pickle: bool, strict: bool, backend: str, direct: bool,
                    queue_depth: int, zero_copy: bool) -> Any:
    """This rank's state (as ``load_state(path, rank=(rank, size))`` returns it), reading
    only its share of what its replica group needs (see the module doc)."""
    stats: dict = {}
    with CheckpointDir(path) as ck:
        m0 = ck.manifest
        m, keys = select_rank(m0, rank, size, shown=ck.path)
        everything = set(m0.tensors)
        needs = [everything if keys is None else select_rank(m0, r, size, shown=ck.path)[1] for r in layout.members]
        mine_all = everything if keys is None else keys
        shared = set.intersection(*map(set, needs)) if layout.group is not None else set()
        sizes: dict[int, int] = {}
        for k in shared:
            e = m0.tensors[k]
            sizes[e.file] = sizes.get(e.file, 0) + e.nbytes
        owner = balance(sizes, layout.size)
        read_keys = {k for k in mine_all if k not in shared or owner[m0.tensors[k].file] == layout.index}
        what = f"load of {ck.path}"
        published, board = None, None
        if shared and shm_exchange.on_one_host(layout.group, layout.size, what):
            published, board = _board(layout, m0, shared, owner)
        try:
            error = None
            res = None
            try:
                res = ck.read(manifest=m, keys=read_keys, verify=verify, backend=backend, direct=direct,
                              queue_depth=queue_depth, zero_copy=False, owned_into=_read_into(board, published, m0,
                                                                                              layout.index))
            except Exception as e:  # noqa: BLE001 - agreed on with the group, then raised
                error = e
            if layout.group is not None:
                _agree(layout, error, what)
            elif error is not None:
                raise error
            assert res is not None
            if shared:
                bad = None
                try:
                    got = _exchange(layout, m0, shared, owner, res.tensors, verify, what, ck.path, board=board)
                except ChecksumMismatchError as e:  # what a peer sent differs from the manifest: every rank fails
                    bad, got = e, {}
                _agree(layout, bad, what, "check what they received")
                res.tensors.update(got)
        finally:
            if board is not None:
                board.remove()
        stats.update(read_bytes=sum(m0.tensors[k].nbytes for k in read_keys),
                     shared_bytes=sum(m0.tensors[k].nbytes for k in shared))
    wrap: Callable[[Any], Any] = (lambda x: x) if keys is None else (lambda x: {rank: x})
    if into is not None:
        return fill_into(res, into, flatten(wrap(into), allow_pickle=True), wrap, strict, allow_pickle)
    with gcpause.paused():
        return unflatten(m.tree, tensor_placer(res, map_location), allow_pickle=allow_pickle)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (what gloo sends)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _pieces(e: Any, base: int, verify: bool) -> list[tuple[int, int, int]]:
    """(offset in the tensor, length, expected XXH3) of each checksummed piece of entry e."""
    ranges = piece_ranges(e.offset, e.nbytes, base)
    sums = [int(h, 16) for h in e.checksums] if verify else [0] * len(ranges)
    return [(po - e.offset, n, h) for (po, n), h in zip(ranges, sums)]


def _by_src(m: Any, shared: set[str], owner: dict[int, int], size: int) -> list[list[str]]:
    """The shared keys with bytes that each rank of the group reads, in stripe order."""
    order = sorted(shared, key=lambda k: (m.tensors[k].file, m.tensors[k].offset, k))
    return [[k for k in order if owner[m.tensors[k].file] == src and m.tensors[k].nbytes] for src in range(size)]


def _board(layout: ReplicaLayout, m: Any, shared: set[str], owner: dict[int, int]) -> tuple[list, Any]:
    """What each rank publishes in /dev/shm, [(key, nbytes, offset in its first page)]
    (a tensor the load reads straight into its memory keeps its offset in the stripe's
    page), and this rank's ``Board``."""
    published = [[(k, m.tensors[k].nbytes, m.tensors[k].offset % shm_exchange.PAGE
                   if read_plan.reads_direct(m.tensors[k]) else 0) for k in keys]
                 for keys in _by_src(m, shared, owner, layout.size)]
    return published, shm_exchange.Board(layout.index, published)


def _read_into(board: Any, published: list | None, m: Any, index: int) -> dict[str, torch.Tensor] | None:
    """This rank's large published tensors, made on its board for the load to read into."""
    if board is None or published is None:
        return None
    into: dict[str, torch.Tensor] = {}
    for k, n, _ in published[index]:
        e = m.tensors[k]
        if read_plan.reads_direct(e):
            t = board.tensor(k, n, read_plan.stored_dtype(e.dtype), e.shape)
            if t is None:  # the board failed: these keys get memory of their own
                break
            into[k] = t
    return into


def _exchange(layout: ReplicaLayout, m: Any, shared: set[str], owner: dict[int, int], have: dict[str, torch.Tensor],
              verify: bool, what: str, shown: str, board: Any = None) -> dict[str, torch.Tensor]:
    """The shared tensors this rank did not read, from the ranks that did (verified):
    through shared memory on one host (``board``: this rank's, made before the read),
    else over gloo (see the module doc)."""
    out: dict[str, torch.Tensor] = {}
    for k in shared:  # empty tensors: nothing to send
        if not m.tensors[k].nbytes and k not in have:
            e = m.tensors[k]
            out[k] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    by_src = _by_src(m, shared, owner, layout.size)
    got = None
    if board is not None:
        def receive(k: str, src: int, addr: int) -> torch.Tensor:
            e = m.tensors[k]
            t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
            if verify:
                verify_received(m, k, t, dist.get_global_rank(layout.group, src), shown, src_ptr=addr)
            else:
                _core.copy_verify([(t.data_ptr(), addr, e.nbytes, 0)], False, _threads())
            return t
        wanted = {src: set(keys) for src, keys in enumerate(by_src) if src != layout.index}
        got = shm_exchange.exchange(layout.group, layout.index, layout.size, board, have, wanted, receive, what)
    if got is None:
        got = _exchange_gloo(layout, m, by_src, have, verify, what, shown)
    out.update(got)
    return out


def _exchange_gloo(layout: ReplicaLayout, m: Any, by_src: list[list[str]], have: dict[str, torch.Tensor],
                   verify: bool, what: str, shown: str) -> dict[str, torch.Tensor]:
    """Broadcast every shared tensor from the rank that read it; the tensors this rank
    received, verified."""
    block = m.block_bytes
    out: dict[str, torch.Tensor] = {}
    bad: ChecksumMismatchError | None = None
    for src in range(layout.size):
        keys = by_src[src]
        src_rank = dist.get_global_rank(layout.group, src)
        bucket: list[str] = []
        filled = 0
        for k in keys + [None]:  # type: ignore[list-item]
            n = m.tensors[k].nbytes if k is not None else 0
            if k is None or (bucket and filled + n > BUCKET_BYTES) or (k is not None and n >= DIRECT_BYTES):
                if bucket:
                    try:
                        _send_bucket(layout, m, bucket, src, src_rank, have, out, verify, block, what, shown)
                    except ChecksumMismatchError as e:
                        bad = bad or e
                bucket, filled = [], 0
            if k is None:
                break
            if n >= DIRECT_BYTES:
                try:
                    _send_one(layout, m, k, src, src_rank, have, out, verify, block, what, shown)
                except ChecksumMismatchError as e:  # the first is raised once every broadcast is done
                    bad = bad or e
            else:
                bucket.append(k)
                filled += n
    if bad is not None:
        raise bad
    return out


def _broadcast(layout: ReplicaLayout, t: torch.Tensor, src_rank: int, what: str) -> None:
    try:
        dist.broadcast(t, src=src_rank, group=layout.group)
    except Exception as e:  # noqa: BLE001 - gloo: a closed connection or a timeout
        raise DistributedLoadError(f"{what}: lost a peer of the replica group (ranks {list(layout.members)}) during "
                                   f"the exchange of what each rank read: {type(e).__name__}: {e}") from e


def _check(bad: list, m: Any, key: str, pieces: list, src_rank: int, shown: str) -> None:
    if bad:
        i, actual = bad[0]
        e = m.tensors[key]
        off, n, h = pieces[i]
        raise ChecksumMismatchError(
            f"{shown}: tensor {key!r} bytes [{off}, {off + n}) received from rank {src_rank} hash to {actual:016x}, "
            f"the manifest says {h:016x} (file {m.files[e.file].name}, offset {e.offset + off})",
            file=m.files[e.file].name, tensor=key, offset=e.offset + off, expected=f"{h:016x}", actual=f"{actual:016x}")


def _send_one(layout: ReplicaLayout, m: Any, k: str, src: int, src_rank: int, have: dict, out: dict, verify: bool,
              block: int, what: str, shown: str) -> None:
    if src == layout.index:
        _broadcast(layout, as_bytes(have[k]), src_rank, what)
        return
    e = m.tensors[k]
    t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    _broadcast(layout, as_bytes(t), src_rank, what)
    if verify:
        verify_received(m, k, t, src_rank, shown)
    out[k] = t


def verify_received(m: Any, key: str, t: torch.Tensor, src_rank: int, shown: str, src_ptr: int | None = None) -> None:
    """Check a tensor received whole from ``src_rank`` against the manifest's checksums of
    ``key``: in place, or while it is copied into ``t`` from ``src_ptr`` (one pass).
    ``ChecksumMismatchError`` names the piece, file and offset."""
    pieces = _pieces(m.tensors[key], m.block_bytes, True)
    base = t.data_ptr()
    spans = [(0, base + o, n, h) if src_ptr is None else (base + o, src_ptr + o, n, h) for o, n, h in pieces]
    _check(_core.copy_verify(spans, True, _threads()), m, key, pieces, src_rank, shown)


def _send_bucket(layout: ReplicaLayout, m: Any, keys: list[str], src: int, src_rank: int, have: dict, out: dict,
                 verify: bool, block: int, what: str, shown: str) -> None:
    sizes = [m.tensors[k].nbytes for k in keys]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    if src == layout.index:
        at = 0
        for k, n in zip(keys, sizes):
            buf[at:at + n].copy_(as_bytes(have[k]))
            at += n
        _broadcast(layout, buf, src_rank, what)
        return
    _broadcast(layout, buf, src_rank, what)
    at, base = 0, buf.data_ptr()
    for k, n in zip(keys, sizes):
        e = m.tensors[k]
        t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        pieces = _pieces(e, block, verify)
        bad = _core.copy_verify([(t.data_ptr() + o, base + at + o, pn, h) for o, pn, h in pieces], verify, _threads())
        _check(bad, m, k, pieces, src_rank, shown)
        out[k] = t
        at += n


def _threads() -> int:
    return defaults.COPY_THREADS
