"""``flashwrite inspect CKPT``: what a checkpoint holds, from its manifest alone."""

from __future__ import annotations

import fnmatch
import os
import re
from typing import Any

from ..format.codec import CODEC_NAME, LABEL, is_compressed

from ..format import Manifest
from ..targets.locate import locate
from ..targets.target import shown
from ..incremental.link import SECTION, byte_counts
from . import tree as _tree
from .common import UsageError


def key_matcher(pattern: str | None):
    if not pattern:
        return lambda _k: True
    if pattern.startswith("re:"):
        try:
            rx = re.compile(pattern[3:])
        except re.error as e:
            raise UsageError(f"--tensors {pattern!r} is not a regular expression ({e}); write re:REGEX with a "
                             "valid one, or a glob such as '*.weight'") from None
        return lambda k: rx.search(k) is not None
    if not any(c in pattern for c in "*?["):
        return lambda k: k == pattern or k.startswith(pattern + ".") or pattern in k
    return lambda k: fnmatch.fnmatchcase(k, pattern)


def inspect(path: str, pattern: str | None = None) -> dict[str, Any]:
    """The manifest as a report: tensors (filtered by ``pattern``: a glob, a substring,
    or ``re:REGEX``), totals by top-level key and dtype, leaves, stripes, writer."""
    m: Manifest = locate(path, "inspect").read_manifest("inspect")  # nfs://: fetched from the server
    match = key_matcher(pattern)
    tensors = []
    by_top: dict[str, list[int]] = {}
    by_dtype: dict[str, list[int]] = {}
    for k, e in m.tensors.items():
        if not match(k):
            continue
        tensors.append({"key": k, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes,
                        "file": m.files[e.file].name, "offset": e.offset, "device": e.device})
        for table, name in ((by_top, k.split(".", 1)[0]), (by_dtype, e.dtype)):
            row = table.setdefault(name, [0, 0])
            row[0] += 1
            row[1] += e.nbytes
    aliases = {a: c for a, c in m.aliases.items() if match(a)}
    leaves = {p: v for p, v in _tree.leaves(m.tree).items() if match(p)}
    raw = m.raw
    written, linked = byte_counts(raw)
    ranks = raw.get("ranks") if isinstance(raw.get("ranks"), dict) else None
    return {
        "path": shown(path),
        "format_version": raw.get("format_version"),
        "writer_version": m.writer_version,
        "created_unix": raw.get("created_unix") if isinstance(raw.get("created_unix"), (int, float)) else None,
        "checksum": {"algorithm": raw["checksum"]["algorithm"], "block_bytes": m.block_bytes},
        # What the manifest records of the writer's settings: the stripe count and its
        # chunk size (the checksum block is the write chunk). Queue depth is not recorded.
        "settings": {"stripes": len(m.files), "chunk_bytes": m.block_bytes,
                     "world_size": ranks.get("world_size") if ranks else 1},
        "metadata": m.metadata,
        "stripes": [{"name": f.name, "bytes": f.size, "header_bytes": f.header_bytes} for f in m.files],
        "compression": compression(m, path),
        "totals": {"tensors": len(m.tensors), "bytes": sum(e.nbytes for e in m.tensors.values()),
                   "file_bytes": sum(f.size for f in m.files), "aliases": len(m.aliases),
                   # incremental saves: of file_bytes, written by its save / hard-linked from base
                   "written_bytes": written, "linked_bytes": linked,
                   "base": raw[SECTION].get("base") if isinstance(raw.get(SECTION), dict) else None},
        # replica_group= saves: each replica group's ranks, rank-local prefixes and disagreements
        "replicas": raw.get("replicas") if isinstance(raw.get("replicas"), dict) else None,
        "filter": pattern,
        "by_top_level": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(by_top.items())},
        "by_dtype": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(by_dtype.items())},
        "tensors": tensors,
        "aliases": aliases,
        "leaves": leaves,
    }


def summarised_leaves(leaves: dict[str, Any], limit: int = 8) -> list[list[str]]:
    """[path, value] rows of the leaves, where a run of more than ``limit`` numbered siblings
    (``rng.python.1.0`` ... ``rng.python.1.624``: Python's RNG state) is one row saying how
    many there are, of what type, and the first and last."""
    rows: list[list[str]] = []
    items = list(leaves.items())
    i = 0
    while i < len(items):
        parent, _, last = items[i][0].rpartition(".")
        j = i
        while (j < len(items) and last.isdigit() and items[j][0] == f"{parent}.{j - i}"
               and not isinstance(items[j][1], (dict, list))):
            j += 1
        if j - i > limit:
            vals = [v for _, v in items[i:j]]
            kinds = "/".join(sorted({type(v).__name__ for v in vals}))
            shown = ", ".join(repr(v) for v in vals[:3])
            rows.append([f"{parent}.0 .. {parent}.{j - i - 1}",
                         f"{j - i} {kinds} values: {shown[:60]}, ..., {repr(vals[-1])[:20]} (--all-leaves lists them)"])
            i = j
        else:
            rows.append([items[i][0], repr(items[i][1])[:80]])
            i += 1
    return rows


def compression(m: Manifest, path: str | None = None) -> dict[str, Any] | None:
    """None for plain stripes; else the codec, what no tool must mistake them for, the
    bytes the frames take (each padded to 4 KiB; chunks stored plain at full span), and
    for a local checkpoint ``disk_bytes``: the blocks its stripes hold on disk (what ``du``
    counts; None where the stripes are not local files)."""
    if not is_compressed(m):
        return None
    block, stored = m.block_bytes, 0
    for f in m.files:
        for k, n in enumerate(f.frames or [0] * -(-f.size // block)):
            stored += -(-n // 4096) * 4096 if n else min(block, f.size - k * block)
    total = sum(f.size for f in m.files)
    disk: int | None = None
    if path is not None and "://" not in os.fspath(path):
        try:
            disk = sum(os.stat(os.path.join(path, f.name)).st_blocks * 512 for f in m.files)
        except OSError:
            disk = None
    return {"codec": CODEC_NAME, "label": LABEL, "stored_bytes": stored, "ratio": total / stored if stored else None,
            "disk_bytes": disk}
