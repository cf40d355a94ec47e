"""``flashwrite diff A B``: what changed between two checkpoints.

By default only the manifests are read: tensor content is compared by the
checksums stored per piece. Pieces are cut at file offsets that are multiples of
the checksum block, so two tensors' checksums are comparable only when both
checkpoints cut them the same way (same block, same offset within a block; true
for saves of the same state with the same settings). Otherwise the tensor is
reported as "unknown" and ``--deep`` compares the bytes themselves.
"""

from __future__ import annotations

import os
from typing import Any

from ..format import Manifest, TensorEntry
from ..targets.locate import locate, read_manifest
from ..targets.target import Target, shown
from . import tree as _tree
from .inspect import key_matcher

READ_BYTES = 8 << 20


def _comparable(a: Manifest, ea: TensorEntry, b: Manifest, eb: TensorEntry) -> bool:
    if ea.nbytes == 0:
        return True
    if len(ea.checksums) == 1 and len(eb.checksums) == 1:
        return True  # each is the hash of the whole tensor
    return a.block_bytes == b.block_bytes and ea.offset % a.block_bytes == eb.offset % b.block_bytes


class _Stripes:
    """The stripe files of one checkpoint on its target (local, or read from an nfs:// server)."""

    def __init__(self, target: Target, root: str, m: Manifest):
        self.target, self.root, self.m = target, root, m

    def read(self, e: TensorEntry, pos: int, n: int) -> bytes:
        path = os.path.join(self.root, self.m.files[e.file].name)  # a plain name: checked by the manifest parser
        data = self.target.read_at(path, e.offset + pos, n)
        if len(data) != n:
            raise OSError(5, f"{self.m.files[e.file].name} is shorter than its manifest says (tensor {e.key})",
                          self.target.show(path))
        return data


def _same_bytes(sa: _Stripes, ea: TensorEntry, sb: _Stripes, eb: TensorEntry, progress: Any = None) -> bool:
    pos = 0
    while pos < ea.nbytes:
        n = min(READ_BYTES, ea.nbytes - pos)
        if sa.read(ea, pos, n) != sb.read(eb, pos, n):
            if progress is not None:
                progress.advance(ea.nbytes - pos)
            return False
        pos += n
        if progress is not None:
            progress.advance(n)
    return True


def diff(a: str, b: str, *, deep: bool = False, pattern: str | None = None, progress: Any = None) -> dict[str, Any]:
    """Either checkpoint may be an nfs:// URL: its manifest is fetched as ``inspect`` does,
    and ``deep`` reads its stripes from the server."""
    match = key_matcher(pattern)
    wa, wb = locate(a, "diff"), locate(b, "diff")
    ma, mb = read_manifest(wa, "diff", shown=shown(a)), read_manifest(wb, "diff", shown=shown(b))
    ka = {k for k in ma.tensors if match(k)}
    kb = {k for k in mb.tensors if match(k)}
    out: dict[str, Any] = {"a": shown(a), "b": shown(b), "deep": deep,
                           "added": sorted(kb - ka), "removed": sorted(ka - kb),
                           "changed_meta": [], "changed_content": [], "unknown": [], "same": 0, "leaves": []}
    common = sorted(ka & kb)
    to_read = []
    for k in common:
        ea, eb = ma.tensors[k], mb.tensors[k]
        if ea.dtype != eb.dtype or ea.shape != eb.shape:
            out["changed_meta"].append({"key": k, "a": {"dtype": ea.dtype, "shape": list(ea.shape)},
                                        "b": {"dtype": eb.dtype, "shape": list(eb.shape)}})
        elif deep:
            to_read.append(k)
        elif _comparable(ma, ea, mb, eb):
            if ea.checksums == eb.checksums:
                out["same"] += 1
            else:
                out["changed_content"].append(k)
        else:
            out["unknown"].append(k)
    if to_read:
        sa, sb = _Stripes(wa.target, wa.path, ma), _Stripes(wb.target, wb.path, mb)
        if progress is not None:
            progress.start(sum(ma.tensors[k].nbytes for k in to_read), "comparing")
        try:
            for k in to_read:
                if _same_bytes(sa, ma.tensors[k], sb, mb.tensors[k], progress):
                    out["same"] += 1
                else:
                    out["changed_content"].append(k)
        finally:
            if progress is not None:
                progress.finish()
    la = {p: n for p, n in _tree.walk(ma.tree) if n.get("t") != "tensor" and match(p)}
    lb = {p: n for p, n in _tree.walk(mb.tree) if n.get("t") != "tensor" and match(p)}
    for p in sorted(la.keys() | lb.keys()):
        na, nb = la.get(p), lb.get(p)
        if na is None or nb is None or _tree.leaf_digest(na) != _tree.leaf_digest(nb):
            out["leaves"].append({"path": p, "a": None if na is None else _tree.leaf_value(na),
                                  "b": None if nb is None else _tree.leaf_value(nb),
                                  "change": "added" if na is None else "removed" if nb is None else "changed"})
    differ = bool(out["added"] or out["removed"] or out["changed_meta"] or out["changed_content"] or out["leaves"])
    out["identical"] = not differ and not out["unknown"]
    # Only tensors whose stored checksums cannot be compared (laid out differently): not
    # a difference, and not known the same either; --deep decides.
    out["undetermined"] = not differ and bool(out["unknown"])
    return out
