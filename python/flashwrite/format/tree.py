"""The manifest's tree of the saved structure, walked as hostile input: every node that
names a stored tensor, within a bounded depth. Building the structure back is
``state/rebuild.py``'s; flattening a state into a tree is ``state/flatten.py``'s."""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import CorruptCheckpointError

MAX_DEPTH = 200


def tensor_nodes(tree: Any) -> Iterator[dict]:
    """Every tensor and view node of a (hostile) tree that names a key, without building anything."""
    stack = [(tree, 0)]
    while stack:
        n, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError("manifest tree: nested too deeply", file="flashwrite.json")
        if not isinstance(n, dict):
            continue
        if n.get("t") in ("tensor", "view") and isinstance(n.get("k"), str):
            yield n
        if isinstance(n.get("v"), dict):
            stack.append((n["v"], depth + 1))
        items = n.get("items")
        for it in items if isinstance(items, list) else ():
            for x in it if isinstance(it, list) else (it,):
                stack.append((x, depth + 1))


def referenced_keys(tree: Any) -> set[str]:
    """Stored tensor keys that a (hostile) tree refers to."""
    return {n["k"] for n in tensor_nodes(tree)}
