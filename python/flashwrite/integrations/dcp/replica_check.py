"""The DCP writer's replica check (``FlashwriteStorageWriter(check_replicas=True)``).

DCP's planner deduplicates an item several ranks hold (a DDP model's tensors, HSDP's
replicated shards): one of them writes it, the others' copies are never looked at. With
the check on, every rank hashes each piece of every item it holds that another rank
also holds (XXH3 on the copy threads, GIL released, from the rank's own tensors), the
ranks all-gather only the digests, and a disagreement fails the save on every rank with
``DivergedReplicasError`` (tensor, byte range, which ranks hold which digest, the
majority) before anything is written or committed. Off by default: it costs a hash of
the replicated bytes on every holder and one collective.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from ... import defaults
from ...errors import DivergedReplicasError
from ...saving.replicas import describe_divergence, digests_of_spans
from .section import item_key

__all__ = ["replicated_keys", "check"]

PIECE_BYTES = 16 << 20  # a disagreement is named to this many bytes


def replicated_keys(keys_per_rank: list[list[str]]) -> set[str]:
    """The item keys more than one rank holds."""
    seen = Counter(k for keys in keys_per_rank for k in set(keys))
    return {k for k, n in seen.items() if n > 1}


def _digests(t: torch.Tensor) -> tuple[int, list[int]]:
    host = t.detach()
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu").contiguous()  # a CUDA item or a strided view: hashed from a host copy
    n = host.numel() * host.element_size()
    base = host.data_ptr()
    spans = [(base + o, min(PIECE_BYTES, n - o)) for o in range(0, n, PIECE_BYTES)]
    return n, digests_of_spans(spans, defaults.COPY_THREADS)


def check(items: list, planner: Any, compare: set[str], gather: Callable[[Any], list], ranks: list[int]) -> None:
    """Hash this rank's items whose keys are in ``compare``, gather every rank's digests
    (``gather``: an all-gather of one object per rank, ``ranks[i]`` the global rank of the
    i-th) and raise ``DivergedReplicasError`` on every rank where holders disagree."""
    mine = {}
    for it in items:
        key = item_key(it.index)
        if key in compare and it.tensor_data is not None:
            mine[key] = _digests(planner.resolve_data(it))
    table = gather(mine)
    diverged = []
    for key in sorted(compare):
        held = [(ranks[i], d[key][1]) for i, d in enumerate(table) if key in d]
        if len(held) < 2 or all(h == held[0][1] for _, h in held):
            continue
        nbytes = max(d[key][0] for d in table if key in d)
        for p in range(max(len(h) for _, h in held)):
            col = [(r, h[p] if p < len(h) else None) for r, h in held]
            if all(v == col[0][1] for _, v in col):
                continue
            by: dict[str, list[int]] = {}
            for r, v in col:
                by.setdefault("%016x" % v if v is not None else "missing", []).append(r)
            top = max(by, key=lambda h: len(by[h]))
            diverged.append({"tensor": key, "piece": [p * PIECE_BYTES, min((p + 1) * PIECE_BYTES, nbytes)], "digests": by,
                             "majority": top if 2 * len(by[top]) > len(col) else None})
    if diverged:
        raise DivergedReplicasError(f"DCP save: ranks hold different bytes for items DCP would have written once "
                                    f"(silent data corruption or nondeterminism): {describe_divergence(diverged)}; "
                                    "nothing was written", diverged)
