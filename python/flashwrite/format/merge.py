"""Several writes in one checkpoint: the per-rank manifests merged into one on save, and
on load the part of a multi-rank manifest that one rank reads."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import CorruptCheckpointError, FlashwriteError
from .tree import referenced_keys
from .manifest import MANIFEST_NAME, Manifest, assemble

MAX_WORLD_SIZE = 1 << 20


def combine(parts: list[dict]) -> tuple[list[dict], dict[str, dict], dict[str, str], list[list[int]]]:
    """The files, tensors and aliases of several writes into one directory (each part a
    manifest, as ``build_manifest`` makes them; part r is rank r's), file indices
    rebased, and each part's ``[first file, count]``."""
    files: list[dict] = []
    tensors: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    spans = []
    for r, m in enumerate(parts):
        for field in ("format_version", "writer_version", "checksum"):
            if m[field] != parts[0][field]:
                raise FlashwriteError(f"rank {r} wrote with {field} {m[field]!r}, rank 0 with {parts[0][field]!r}: "
                                      "every rank must use the same flashwrite version and chunk_bytes")
        base = len(files)
        spans.append([base, len(m["files"])])
        files.extend(m["files"])
        for k, t in m["tensors"].items():
            if k in tensors:
                raise FlashwriteError(f"tensor {k!r} written by two ranks")
            tensors[k] = dict(t, file=t["file"] + base)
        aliases.update(m["aliases"])
    return files, tensors, aliases, spans


def merge_manifests(manifests: list[dict]) -> dict:
    """One global manifest from the per-rank manifests (each with tree ``{rank: state}``)."""
    items: list = []
    for r, m in enumerate(manifests):
        tree = m["tree"]
        if tree.get("t") != "dict" or len(tree["items"]) != 1 or tree["items"][0][0] != {"t": "int", "v": r}:
            raise FlashwriteError(f"rank {r}'s manifest is not a rank-{r} state (saves issued in different orders?)")
        items.extend(tree["items"])
    files, tensors, aliases, spans = combine(manifests)
    first = manifests[0]
    merged = assemble(files, tensors, aliases, {"t": "dict", "items": items}, first["checksum"]["block_bytes"],
                      first["writer_version"], first["metadata"], ranks={"world_size": len(manifests), "files": spans})
    merged["created_unix"] = first["created_unix"]
    groups: dict = {}  # replica groups (replica_group=): each rank reports its own, once per group kept
    for m in manifests:
        for g in (m.get("replicas") or {}).get("groups", []):
            groups.setdefault(tuple(g["ranks"]), g)
    if groups:
        merged["replicas"] = {"groups": [groups[k] for k in sorted(groups)]}
    return merged


def rank_section(raw: dict) -> dict | None:
    """The validated ``ranks`` section of a manifest, or None for a single-process checkpoint."""
    ranks = raw.get("ranks")
    if ranks is None:
        return None
    if not isinstance(ranks, dict):
        raise CorruptCheckpointError("manifest: ranks: not an object", file=MANIFEST_NAME)
    n = ranks.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_WORLD_SIZE:
        raise CorruptCheckpointError("manifest: ranks: world_size must be a positive integer", file=MANIFEST_NAME)
    return ranks


def _rank_subtree(tree: Any, rank: int) -> Any:
    if not isinstance(tree, dict) or tree.get("t") != "dict" or not isinstance(tree.get("items"), list):
        raise CorruptCheckpointError("manifest: a multi-rank tree must be a dict of ranks", file=MANIFEST_NAME)
    for it in tree["items"]:
        if isinstance(it, list) and len(it) == 2 and it[0] == {"t": "int", "v": rank}:
            return it[1]
    raise CorruptCheckpointError(f"manifest: no state for rank {rank}", file=MANIFEST_NAME)


def select_rank(m: Manifest, rank: int, size: int, *, shown: str) -> tuple[Manifest, set[str] | None]:
    """The part of ``m`` that rank ``rank`` of a group of ``size`` loads: for a multi-rank
    checkpoint its own state (the manifest with that subtree as its tree) and the keys of
    its tensors; a single-process checkpoint whole (keys None: every tensor)."""
    ranks = rank_section(m.raw)
    if ranks is None:
        return m, None
    if ranks["world_size"] != size:
        raise ValueError(f"{shown} was saved by {ranks['world_size']} ranks and this group has {size}: "
                         "load it in one process with flashwrite.load(path), which returns {rank: state}, or save "
                         "through flashwrite.dcp to reshard on load")
    subtree = _rank_subtree(m.tree, rank)
    keys = referenced_keys(subtree)
    unknown = keys - set(m.tensors)
    if unknown:
        raise CorruptCheckpointError(f"manifest tree refers to unknown tensor {sorted(unknown)[0]!r}",
                                     file=MANIFEST_NAME)
    return dataclasses.replace(m, tree=subtree), keys
