"""Walk a manifest's tree without rebuilding it: no tensor is read, nothing is unpickled."""

from __future__ import annotations

import base64
from typing import Any, Iterator

from ..flatten import MAX_DEPTH


def _key_text(n: Any) -> str:
    if isinstance(n, dict):
        t, v = n.get("t"), n.get("v")
        if t == "tuple" and isinstance(n.get("items"), list):
            return "(" + ",".join(_key_text(x) for x in n["items"]) + ")"
        if t in ("str", "int", "bool") and v is not None:
            return str(v)
        if t == "none":
            return "None"
        if t == "float" and isinstance(v, str):
            try:
                return repr(float.fromhex(v))
            except (ValueError, OverflowError):
                return v[:40]
    return "?"


def leaf_value(n: dict) -> Any:
    """A JSON-friendly rendering of a non-tensor leaf (pickles are named, never loaded)."""
    t, v = n.get("t"), n.get("v")
    if t == "none":
        return None
    if t == "float" and isinstance(v, str):
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):
            return f"<bad float {v[:40]!r}>"
    if t == "bytes" and isinstance(v, str):
        return f"<{len(v) * 3 // 4} bytes>"
    if t == "pickle":
        return f"<pickled object, {len(v) * 3 // 4 if isinstance(v, str) else '?'} bytes>"
    if t == "ndarray" and isinstance(v, dict):
        return f"<numpy array, stored as tensor {str(v.get('k'))[:80]}>"
    if t in ("dtype", "device"):
        return f"{t}:{v}"
    return v


def walk(tree: Any) -> Iterator[tuple[str, dict]]:
    """(path, node) for every tensor reference and non-tensor leaf, depth first.
    Paths join keys with '.', as the flat tensor keys do. Malformed nodes are
    yielded as {"t": "?"} rather than raised, so a damaged tree can still be shown."""
    stack: list[tuple[str, Any, int]] = [("", tree, 0)]
    while stack:
        path, n, depth = stack.pop()
        if depth > MAX_DEPTH or not isinstance(n, dict):
            yield path or "<root>", {"t": "?"}
            continue
        t = n.get("t")
        items = n.get("items")
        if t in ("dict", "odict") and isinstance(items, list):
            for it in reversed(items):
                if isinstance(it, list) and len(it) == 2:
                    k = _key_text(it[0])
                    stack.append((f"{path}.{k}" if path else k, it[1], depth + 1))
        elif t in ("list", "tuple") and isinstance(items, list):
            for i in reversed(range(len(items))):
                stack.append((f"{path}.{i}" if path else str(i), items[i], depth + 1))
        else:
            yield path or "<root>", n


def leaves(tree: Any) -> dict[str, Any]:
    """{path: value} of the non-tensor leaves."""
    return {p: leaf_value(n) for p, n in walk(tree) if n.get("t") != "tensor"}


def leaf_digest(n: dict) -> str:
    """What two leaves are compared by (pickles by their bytes)."""
    v = n.get("v")
    if isinstance(v, str) and len(v) > 64:
        import hashlib
        return f"{n.get('t')}:{hashlib.sha256(base64.b64decode(v + '==', validate=False)).hexdigest()[:16]}"
    return f"{n.get('t')}:{v!r}"
