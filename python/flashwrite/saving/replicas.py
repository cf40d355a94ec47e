"""The save side of replica groups: each replicated byte written once, replicas checked.

Every rank of a replica group plans the replicated part of its state identically
(stored under the group leader's keys, in stripes ``model-group<leader>-*``), takes the
digest (XXH3) of every checksummed piece of it before ``save_async`` returns, and the
group all-gathers the digests on its own gloo group: only digests cross, never data.
Each stripe goes to one rank of the group (balanced by bytes), which stages and writes
only its share: 1/R of the bytes, 1/R of the staging pool.

- ``on_divergence="raise"`` (default): the shares are fixed by the plan, so each rank
  starts staging its share at once, and its staging copy takes those digests as it
  copies (one pass over the bytes, as a save without replicas does); meanwhile the
  caller's thread hashes the rest in place (the other ranks' shares: (R-1)/R, on the
  copy threads, GIL released). ``Split.agree`` then compares, still inside the call;
  a disagreement stops the staging and raises ``DivergedReplicasError`` on every rank,
  and the group's failure removes the temporary directory: nothing is committed.
- ``"warn"``: which rank writes a stripe depends on the bytes (a rank that holds the
  majority's, or the most common ones where there is no majority), so every piece is
  hashed in place and compared before anything is staged; the disagreement goes into
  the manifest's ``replicas`` section and ``SaveStats.diverged``.

Rank-local leaves (``rank_local=``: key prefixes such as ``"rng"``) are stored per rank
under the rank's own keys (``model-rank<r>-*``) and never compared. Each rank's tree
still says ``{rank: state}``; its replicated tensors name the leader's keys, so any
reader, an earlier flashwrite's included, gets each rank's whole state back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .. import _core
from ..errors import DistributedSaveError, DivergedReplicasError
from ..format.manifest import piece_ranges
from ..format.tree import tensor_nodes
from ..layout.plan import PlannedFile, plan_files, rank_prefix
from ..state.flatten import Columns
from ..system.coord import PeerLost, collective
from ..system.replicas import ReplicaLayout, balance

log = logging.getLogger("flashwrite")

ON_DIVERGENCE = ("raise", "warn")
MAX_NAMED = 8  # disagreeing pieces named in an error's message (all are in .divergence)


def group_prefix(leader: int) -> str:
    """The stripe-name prefix of a replica group's replicated stripes."""
    return f"model-group{leader:05d}"


def check_options(rank_local: Any, on_divergence: str) -> tuple[str, ...]:
    if on_divergence not in ON_DIVERGENCE:
        raise ValueError(f"on_divergence must be one of {ON_DIVERGENCE}, got {on_divergence!r}")
    if rank_local is None:
        return ()
    if isinstance(rank_local, str):
        rank_local = (rank_local,)
    out = tuple(rank_local)
    if not all(isinstance(p, str) and p for p in out):
        raise TypeError(f"rank_local must be key prefixes (non-empty strings such as 'rng'), got {rank_local!r}")
    return out


def is_local(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


@dataclass
class Split:
    """What one rank writes of a replica-group save, and what the group found."""
    tree: Any
    aliases: dict[str, str]
    files: list[PlannedFile]          # this rank's share of the group's stripes, then its rank-local ones
    section: dict                     # the manifest's ``replicas`` entry for this group
    diverged: list[dict] = field(default_factory=list)
    hashed_bytes: int = 0
    hash_s: float = 0.0
    exchange_s: float = 0.0
    replicated_bytes: int = 0
    pending: _Pieces | None = None  # raise mode: compared by ``agree`` once the share is staging  # raise mode: compared by ``agree`` once the share is staged

    def agree(self, job: Any) -> None:
        """Raise mode, with this rank's share staging on ``job``: hash the other ranks'
        shares in place, take this rank's digests from the staging, and compare with the
        group (``DivergedReplicasError`` on a disagreement). A job that ended before it
        had checksummed everything (it failed) is reported to the group, which then
        skips the comparison: the save fails in its commit rounds instead."""
        p, self.pending = self.pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        others = [i for i, w in enumerate(p.where) if w[0] not in p.mine]
        digests = [0] * len(p.spans)
        for i, d in zip(others, digests_of_spans([p.spans[i] for i in others], p.threads)):
            digests[i] = d
        p.hold.clear()
        job.wait_checksummed()
        staged = bool(job.checksummed)
        if staged:
            sums = iter(job.checksums())  # one list per non-empty tensor of the staged files, in plan order
            per_tensor = {(fi, j): next(sums) for fi in sorted(p.mine) for j in p.files[fi].members
                          if p.columns.nbytes[j]}
            seen: Counter = Counter()
            for i, (fi, j, _, _) in enumerate(p.where):
                if fi in p.mine:
                    digests[i] = per_tensor[(fi, j)][seen[(fi, j)]]
                    seen[(fi, j)] += 1
        self.hashed_bytes = sum(p.spans[i][1] for i in others)
        t1 = time.perf_counter()
        diverged, _ = p.compare(digests, staged)
        self.hash_s, self.exchange_s = t1 - t0, time.perf_counter() - t1
        if diverged:
            self.section["diverged"] = diverged
            raise p.diverged_error(diverged)

    def record(self, sw: Any) -> None:
        """Into a ``StripeWrite``: the manifest's section, and what SaveStats reports."""
        sw.replicas = self.section
        sw.stats.diverged = self.diverged
        sw.stats.extra.update(replicated_bytes=self.replicated_bytes, replica_hashed_bytes=self.hashed_bytes,
                              replica_hash_s=self.hash_s, replica_exchange_s=self.exchange_s)


def _subset(columns: Columns, idx: list[int], keys: list[str]) -> Columns:
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return Columns(keys, pick(columns.sources), pick(columns.dtypes), pick(columns.shapes), pick(columns.nbytes),
                   pick(columns.ptrs), pick(columns.devices))


def _fingerprint(files: list[PlannedFile]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(json.dumps([f.name, f.size, [[p.key, str(p.dtype), p.shape, p.offset] for p in f.tensors]]).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def _pieces(files: list[PlannedFile], columns: Columns, block: int,
            staged: set[int]) -> tuple[list[tuple[int, int, int, int]], list, list]:
    """Every checksummed piece of the replicated stripes, in plan order: ((file, tensor
    index, start in tensor, end), ...), the (address, length) to hash, and host copies
    of device tensors (kept alive for the hash). staged: stripes whose digests the
    staging takes (their device tensors get no host copy: their spans are never hashed)."""
    where: list = []
    spans: list[tuple[int, int]] = []
    hold: list = []
    for fi, f in enumerate(files):
        for j, off in zip(f.members, f.offsets):
            n = columns.nbytes[j]
            if not n:
                continue
            base = columns.ptrs[j]
            if columns.devices[j] != "cpu" and fi not in staged:  # no native hash of device memory: a host copy
                host = columns.sources[j].to("cpu")
                hold.append(host)
                base = host.data_ptr()
            for po, pn in piece_ranges(off, n, block):
                where.append((fi, j, po - off, po - off + pn))
                spans.append((base + po - off, pn))
    return where, spans, hold


def digests_of_spans(spans: list[tuple[int, int]], threads: int) -> list[int]:
    """XXH3 of each span (``copy_verify`` in place against 0: it reports every actual
    digest but a zero one, which is then 0)."""
    out = [0] * len(spans)
    for i, actual in _core.copy_verify([(0, a, n, 0) for a, n in spans], True, max(1, threads)):
        out[i] = actual
    return out


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _gather(layout: ReplicaLayout, values: list[int]) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64)
    if layout.group is None:
        return [values]
    out = [torch.empty_like(t) for _ in range(layout.size)]
    collective(dist.all_gather, out, t, group=layout.group)
    return [o.tolist() for o in out]


@dataclass
class _Pieces:
    """The replicated pieces of one rank's save and what comparing them needs."""
    layout: ReplicaLayout
    ranks: list[int]                  # the group's global ranks
    files: list[PlannedFile]          # the group's replicated stripes
    columns: Columns
    where: list[tuple[int, int, int, int]]
    spans: list[tuple[int, int]]
    hold: list                        # host copies of device tensors, while they are hashed
    mine: set[int]                    # the stripes this rank stages (raise mode), whose digests the staging takes
    threads: int
    shown: str

    def compare(self, digests: list[int], staged: bool = True) -> tuple[list[dict], dict[int, list[int]]]:
        """All-gather the group's digests and compare (see ``_compare``); raises
        ``DivergedReplicasError`` if the ranks hold different tensors. staged: False if
        this rank's digests are incomplete (its job failed): then nobody compares."""
        try:
            shapes = _gather(self.layout, [_fingerprint(self.files), len(digests), int(staged)])
            if any(s[:2] != shapes[0][:2] for s in shapes):
                odd = [self.ranks[i] for i, s in enumerate(shapes) if s[:2] != shapes[0][:2]]
                raise DivergedReplicasError(
                    f"save to {self.shown}: ranks {self.ranks} were declared replicas (replica_group=) but rank(s) "
                    f"{odd} hold other tensors than rank {self.ranks[0]} (names, dtypes or shapes differ); nothing was "
                    "committed. Declare per-rank leaves with rank_local=", [])
            if not all(s[2] for s in shapes):
                return [], {}
            table = _gather(self.layout, [_signed(d) for d in digests])
        except PeerLost as e:
            raise DistributedSaveError(f"save to {self.shown}: lost a peer of the replica group {self.ranks} while "
                                       f"comparing digests; nothing was committed. {e}") from e
        return _compare(table, self.where, self.files, self.columns, self.ranks)

    def diverged_error(self, diverged: list[dict]) -> DivergedReplicasError:
        return DivergedReplicasError(
            f"save to {self.shown}: the replicas of ranks {self.ranks} disagree on {len(diverged)} piece(s), nothing "
            f"was committed: {describe_divergence(diverged)}. This is silent data corruption or nondeterminism on a "
            "rank (on_divergence='warn' commits the majority's bytes)", diverged)


def split(layout: ReplicaLayout, rank: int, tree: Any, aliases: dict[str, str], columns: Columns, *, stripes: int,
          metadata: dict[str, str] | None, block: int, threads: int, rank_local: tuple[str, ...],
          on_divergence: str, shown: str, global_rank: Any) -> Split:
    """Plan, and hash and agree in warn mode (see the module doc; in raise mode
    ``Split.agree`` does the rest once the share is staging). ``columns``: the
    flattening of ``{rank: state}``; global_rank(r): the global rank of coordination-group rank r."""
    mine, lead = f"{rank}.", f"{layout.leader}."
    rep_idx, loc_idx, rename = [], [], {}
    for j, k in enumerate(columns.keys):
        path = k[len(mine):]
        if is_local(path, rank_local):
            loc_idx.append(j)
        else:
            rep_idx.append(j)
            rename[k] = lead + path
    for n in tensor_nodes(tree):
        n["k"] = rename.get(n["k"], n["k"])
    aliases = {(lead + a[len(mine):] if t in rename else a): rename.get(t, t) for a, t in aliases.items()}
    rep = _subset(columns, rep_idx, [rename[columns.keys[j]] for j in rep_idx])
    files = plan_files(None, max(stripes, layout.size), prefix=group_prefix(layout.leader), metadata=metadata,
                       columns=rep) if rep_idx else []
    local = plan_files(None, 1, prefix=rank_prefix(rank), metadata=metadata,
                       columns=_subset(columns, loc_idx, [columns.keys[j] for j in loc_idx])) if loc_idx else []
    sizes = {fi: f.size for fi, f in enumerate(files)}
    section = {"ranks": [global_rank(m) for m in layout.members], "rank_local": list(rank_local)}
    replicated = sum(sizes.values())
    owner = balance(sizes, layout.size)
    own = {fi for fi in owner if owner[fi] == layout.index} if on_divergence == "raise" else set()
    where, spans, hold = _pieces(files, rep, block, own)
    pieces = _Pieces(layout, section["ranks"], files, rep, where, spans, hold, own, threads, shown)
    if on_divergence == "raise":
        share = [f for fi, f in enumerate(files) if fi in own]
        return Split(tree, aliases, share + local, section, replicated_bytes=replicated, pending=pieces)
    # Hash every replicated piece before the call returns (the caller may change its tensors after).
    t0 = time.perf_counter()
    digests = digests_of_spans(spans, threads)
    hold.clear()
    t1 = time.perf_counter()
    diverged, prefer = pieces.compare(digests)
    t2 = time.perf_counter()
    if diverged:
        section["diverged"] = diverged
        log.warning("flashwrite: save to %s: replicas disagree on %d piece(s); the majority's bytes are committed: %s",
                    shown, len(diverged), describe_divergence(diverged))
    owner = balance(sizes, layout.size, prefer)
    share = [f for fi, f in enumerate(files) if owner[fi] == layout.index]
    return Split(tree, aliases, share + local, section, diverged, sum(n for _, n in spans), t1 - t0, t2 - t1,
                 replicated)


def _compare(table: list[list[int]], where: list, files: list[PlannedFile], rep: Columns,
             ranks: list[int]) -> tuple[list[dict], dict[int, list[int]]]:
    """The disagreeing pieces, and for each stripe holding one, the ranks (indices) that
    hold the chosen bytes of all of its disagreeing pieces."""
    diverged: list[dict] = []
    chosen_by_file: dict[int, list[list[int]]] = {}
    first = table[0]
    size = len(table)
    for i in range(len(first)):
        col = [row[i] for row in table]
        if all(v == col[0] for v in col):
            continue
        counts = Counter(col)
        top, n = max(counts.items(), key=lambda kv: (kv[1], -col.index(kv[0])))
        majority = top if 2 * n > size else None
        fi, j, start, end = where[i]
        hexd = lambda v: "%016x" % (v & ((1 << 64) - 1))  # noqa: E731
        held: dict[str, list[int]] = {}
        for r, v in enumerate(col):
            held.setdefault(hexd(v), []).append(ranks[r])
        key = rep.keys[j]
        diverged.append({"tensor": key.split(".", 1)[1], "key": key, "file": files[fi].name, "piece": [start, end],
                         "digests": held, "majority": hexd(majority) if majority is not None else None})
        chosen_by_file.setdefault(fi, []).append([r for r, v in enumerate(col) if v == top])
    prefer: dict[int, list[int]] = {}
    for fi, sets in chosen_by_file.items():
        every = set(sets[0]).intersection(*sets[1:])
        prefer[fi] = sorted(every) if every else sets[0]
    return diverged, prefer


def describe_divergence(diverged: list[dict]) -> str:
    parts = []
    for d in diverged[:MAX_NAMED]:
        who = "; ".join(f"ranks {rs} hold {h}" for h, rs in d["digests"].items())
        maj = f"majority {d['majority']}" if d["majority"] else "no majority"
        parts.append(f"{d['tensor']} bytes [{d['piece'][0]}, {d['piece'][1]}): {who} ({maj})")
    more = f"; and {len(diverged) - MAX_NAMED} more" if len(diverged) > MAX_NAMED else ""
    return "; ".join(parts) + more
