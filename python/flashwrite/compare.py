"""The compare pass of an incremental save: which tensors of the state still hold what the
base checkpoint holds (``incremental.plan`` then links the stripes whose tensors all do).

Content is compared straight from the source tensors, before ``save_async`` returns, on
the copy threads with the GIL released: XXH3 of each checksummed piece against the base
manifest's checksums. Pass 1 hashes each tensor's smallest piece, so a stripe with a
changed tensor costs little to reject; pass 2 hashes the rest of the stripes that passed.
A piece that the kernel saw no write to since a save hashed it is not hashed again
(``write_watch``): a frozen base model then costs a page-table scan, not a pass over its
bytes. Every ``write_watch.recheck_every()``-th pass over a piece hashes it again anyway; a
piece the watch vouched for whose bytes had changed counts as changed, and the save warns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from . import _core, dtypes, write_watch
from .flatten import Columns
from .format import Manifest, piece_ranges


def candidates(columns: Columns, m: Manifest, by_file: list[list[Any]], where: dict[str, int],
               recheck: bool) -> tuple[list[int], list[int]]:
    """Base stripes whose tensors are all in the state alike (same dtype, shape and size),
    as (those all in host memory: compared here, those with some on a GPU: held files,
    ``held``); stripes marked hot last time only when ``recheck``."""
    hot_files = {f.get("name") for f in m.raw.get("files", []) if isinstance(f, dict) and f.get("hot")}
    host: list[int] = []
    device: list[int] = []
    for fi, entries in enumerate(by_file):
        if not entries or (m.files[fi].name in hot_files and not recheck):
            continue
        ok, on_gpu = True, False
        for te in entries:
            j = where.get(te.key)
            if (j is None or columns.nbytes[j] != te.nbytes or dtypes.dtype_name(columns.dtypes[j]) != te.dtype
                    or columns.shapes[j] != ",".join(map(str, te.shape))):
                ok = False
                break
            on_gpu = on_gpu or columns.devices[j] != "cpu"
        if ok:
            (device if on_gpu else host).append(fi)
    return host, device


@dataclass
class Outcome:
    """What a compare pass found."""
    changed: set[str]          # keys whose content differs from the base
    compared: int              # bytes hashed
    unchanged: list[int]       # candidate stripes with no changed tensor
    watched: int               # bytes the write watch vouched for (not hashed)
    rechecked: int = 0         # bytes the watch would have vouched for, hashed again (write_watch.recheck_every)
    misses: list[str] = field(default_factory=list)  # tensors whose re-hash found a write the watch missed


def changed(columns: Columns, m: Manifest, by_file: list[list[Any]], where: dict[str, int], cands: list[int],
            threads: int) -> Outcome:
    """Which tensors of the candidate stripes ``cands`` changed. A piece no write reached
    since a save hashed it has that save's checksum (``write_watch``); the others are
    hashed: pass 1 each tensor's smallest such piece, pass 2 the rest of the stripes that
    passed it."""
    sources = columns.sources
    pieces_of: list[tuple[int, str, list[tuple[int, int, int]]]] = []  # (stripe, key, [(address, n, expected)])
    for fi in cands:
        for te in by_file[fi]:
            j = where[te.key]
            pieces_of.append((fi, te.key, [(columns.ptrs[j] + off - te.offset, n, int(h, 16)) for (off, n), h in
                                           zip(piece_ranges(te.offset, te.nbytes, m.block_bytes), te.checksums)]))
    watched = [(a, n) for fi, key, ps in pieces_of if ps and write_watch.eligible(
        ps[0][0], sum(p[1] for p in ps), sources[where[key]] if sources is not None else None) for a, n, _ in ps]
    changed: set[str] = set()
    missed: list[str] = []
    first: list[tuple[tuple[int, int, int], str]] = []
    rest: dict[int, list[tuple[tuple[int, int, int], str]]] = {}
    with write_watch.compare_pass(watched) as watch:
        for fi, key, ps in pieces_of:
            unknown = []
            for p in ps:
                h = watch.known(p[:2])
                if h is None:
                    unknown.append(p)
                elif h != p[2]:
                    changed.add(key)
            if key in changed or not unknown:
                continue
            k = min(range(len(unknown)), key=lambda i: unknown[i][1])
            first.append((unknown[k], key))
            rest.setdefault(fi, []).extend((p, key) for i, p in enumerate(unknown) if i != k)
        compared = 0
        for group in (first, None):
            if group is None:  # pass 2: the rest of the stripes with no changed tensor yet
                group = [pk for fi in cands if not any(te.key in changed for te in by_file[fi])
                         for pk in rest.get(fi, [])]
            bad = dict(_core.copy_verify([(0, a, n, e) for (a, n, e), _ in group], True, threads))
            for i, ((a, n, e), key) in enumerate(group):
                if watch.record((a, n), bad.get(i, e)):  # hashed after the watch protected it
                    missed.append(key)  # a re-hash of a piece the watch vouched for: it had changed
                if i in bad:
                    changed.add(key)
            compared += sum(p[1] for p, _ in group)
    unchanged = [fi for fi in cands if not any(te.key in changed for te in by_file[fi])]
    missed = list(dict.fromkeys(missed))
    if missed:
        warnings.warn(f"flashwrite: the write watch missed a write to {len(missed)} tensors ({', '.join(missed[:5])}"
                      f"{', ...' if len(missed) > 5 else ''}), found by the periodic re-hash "
                      f"({write_watch.RECHECK_ENV}): their stripes are written, not linked", RuntimeWarning,
                      stacklevel=2)
    return Outcome(changed, compared, unchanged, watch.watched_bytes, watch.rechecked_bytes, missed)
