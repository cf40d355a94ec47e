"""Held stripes of an incremental save: GPU tensors linked when they did not change.

Host tensors are compared before staging, straight from their memory (``compare``). GPU
tensors are not: their bytes reach the host only through the staging copy. So a stripe
of the base checkpoint whose tensors are all in the state alike (same dtype, shape and
size) but some of them on a GPU is planned as a *held* file that mirrors the base
stripe exactly (its header, its tensors at the same offsets), with the base's per-piece
checksums. The native save job (csrc/write/save_held.cpp) stages it like any other file
(D2H on its streams, checksums as always) but holds back its writes: once all its
chunks are staged, equal checksums hard-link the base stripe to its name (nothing is
written, its slots go back), any difference writes it. A refused link (EXDEV, EPERM,
a base deleted meanwhile) writes it too, counted in ``SaveStats.link_fallbacks``.

A save with a local snapshot (the memory tier keeps the staging pool's copy of the whole
state) plans every candidate stripe so, host tensors too: its bytes are staged for the
snapshot either way, and a linked file's slots stay with the snapshot.

The links are made by the job's copy threads before it reports itself durable, so the
directory fsync before the manifest covers them (``commit.finalize``). The stall does
not grow: the staging is what a full save does. Holding needs the staging pool to hold
every slot of the save at once (then no copy waits for a held slot); a bounded pool
smaller than that writes the held files as it stages them. Local targets only: on
nfs:// GPU stripes are written (``Planner.note`` says so).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from ..format import Manifest, piece_ranges

# Tests only: plan host tensors' candidate stripes as held files too, instead of comparing
# them before staging, so that the held path runs end to end on a machine with no GPU.
HOLD_HOST = False

# SaveJob.held_results outcomes (csrc/write/save_job.hpp, HeldOutcome).
NOT_HELD, LINKED, CHANGED, REFUSED, POOL_TOO_SMALL, UNDECIDED = range(6)


@dataclass
class HeldFile:
    """A held file of an incremental plan: the base stripe it mirrors and what its
    tensors held there."""
    src: str                              # the base stripe (linked from when unchanged)
    expected: list[tuple[int, int, int]]  # (offset, bytes, checksum) of every piece
    sums: dict[str, list[int]]            # the base's checksums per tensor
    changed: list[str] | None = None      # once written for a change: the tensors that changed


def held_file(src: str, entries: list[Any], block: int) -> HeldFile:
    """The held file mirroring base stripe ``src`` with tensors ``entries``: every
    checksummed piece's (offset in the stripe, bytes, checksum), what its pieces must
    hash to."""
    out, sums = [], {}
    for te in entries:
        sums[te.key] = [int(h, 16) for h in te.checksums]
        out.extend((off, n, h) for (off, n), h in zip(piece_ranges(te.offset, te.nbytes, block), sums[te.key]))
    return HeldFile(src, out, sums)


def stable_hints(m: Manifest) -> set[str]:
    """Tensors of the base that a held file found unchanged beside a changed one (its
    stripe was written, marked hot, with the changed ones listed): "unchanged at the
    last save", so planned into stable stripes, which the next save can link whole."""
    files = m.raw.get("files")
    if not isinstance(files, list):
        return set()
    lists = {fi: set(f["changed"]) for fi, f in enumerate(files[:len(m.files)])
             if isinstance(f, dict) and f.get("hot") and isinstance(f.get("changed"), list)
             and all(isinstance(k, str) for k in f["changed"])}
    if not lists:
        return set()
    return {te.key for te in m.tensors.values() if te.file in lists and te.key not in lists[te.file]}


def specs(p: Any) -> list[tuple[int, str, list[tuple[int, int, int]]]]:
    """Engine.start_save's ``held=`` for the incremental plan ``p``: indices into the
    files it stages (``p.staged``)."""
    if not p.held:
        return []
    pos = {i: k for k, i in enumerate(i for i in range(len(p.files)) if i not in p.linked)}
    return [(pos[i], h.src, h.expected) for i, h in sorted(p.held.items())]


def settle(p: Any, results: list[tuple[int, int]], sums: dict[str, list[int]]) -> str | None:
    """Record in the incremental plan ``p`` what became of its held files (the job's
    ``held_results``, one per staged file; ``sums``: the save's checksums per tensor):
    linked ones join ``p.settled``, changed ones ``p.hot`` with the tensors that changed,
    refused links count as fallbacks. Once per plan. Returns what SaveStats.incremental
    should add, if anything."""
    if p.held_settled or not p.held:
        return None
    p.held_settled = True
    unheld = 0
    staged = [i for i in range(len(p.files)) if i not in p.linked]
    for i, (outcome, err) in zip(staged, results):
        if i not in p.held:
            continue
        if outcome == LINKED:
            p.settled.add(i)
        elif outcome == CHANGED:
            p.hot.add(i)
            h = p.held[i]
            h.changed = sorted(k for k, base in h.sums.items() if sums.get(k, []) != base)
        elif outcome == REFUSED:
            p.fallbacks += 1
            if not p.fallback_reason:
                src = p.held[i].src
                p.fallback_reason = f"{errno.errorcode.get(err, err)}: linking {src} was refused"
        elif outcome == POOL_TOO_SMALL:
            unheld += 1
    if unheld:
        return (f"{unheld} stripes not compared (GPU tensors): written, the staging pool cannot hold the "
                "whole save at once (max_staging_bytes)")
    return None
