"""Flatten a nested state dict into (tree, tensors) and back.

The tree is typed JSON: it keeps dict/OrderedDict/list/tuple containers, key types
(str, int, ...) and non-tensor leaves exactly, so ``load`` returns the structure
that was saved. Tensors become references to flat keys such as
``model.layers.0.weight``. Arbitrary objects need ``allow_pickle=True``.
"""

from __future__ import annotations

import base64
import collections
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

MAX_DEPTH = 200


@dataclass
class FlatTensor:
    key: str
    tensor: torch.Tensor


def _alias_id(t: torch.Tensor) -> tuple:
    """Identity of the exact bytes a tensor shows: equal ids are tied weights."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[dict, list[FlatTensor], dict[str, str]]:
    """Returns (tree, unique tensors, aliases {key: canonical key})."""
    tensors: list[FlatTensor] = []
    aliases: dict[str, str] = {}
    seen_ids: dict[tuple, str] = {}
    used: set[str] = set()

    def unique_key(path: list[str]) -> str:
        key = ".".join(path) if path else "tensor"
        if key in used:
            n = 1
            while f"{key}#{n}" in used:
                n += 1
            key = f"{key}#{n}"
        used.add(key)
        return key

    def leaf(v: Any, where: str) -> dict:
        if v is None:
            return {"t": "none"}
        if isinstance(v, bool):
            return {"t": "bool", "v": v}
        if isinstance(v, int):
            return {"t": "int", "v": int(v)}
        if isinstance(v, float):
            return {"t": "float", "v": float(v).hex()}
        if isinstance(v, str):
            return {"t": "str", "v": v}
        if isinstance(v, bytes):
            return {"t": "bytes", "v": base64.b64encode(v).decode()}
        if isinstance(v, torch.dtype):
            return {"t": "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"t": "device", "v": str(v)}
        if isinstance(v, torch.nn.Module):
            raise TypeError(f"{where}: got a {type(v).__qualname__} module; save its state_dict() instead")
        if allow_pickle:
            return {"t": "pickle", "v": base64.b64encode(pickle.dumps(v)).decode()}
        raise TypeError(
            f"{where}: cannot store {type(v).__module__}.{type(v).__qualname__} without pickling; "
            "pass allow_pickle=True to save (and to load) to opt in")

    def key_node(k: Any, where: str) -> dict:
        if type(k) is tuple:  # tuple keys of plain values, e.g. (layer, head)
            return {"t": "tuple", "items": [key_node(x, where) for x in k]}
        return leaf(k, where)

    def walk(v: Any, path: list[str], depth: int) -> dict:
        where = ".".join(path) or "<root>"
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: state is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, torch.Tensor):
            if v.is_quantized or v.is_sparse or v.layout != torch.strided:
                raise TypeError(f"{where}: only dense strided tensors are supported (got layout {v.layout})")
            ident = _alias_id(v) if v.numel() else None
            if ident is not None and ident in seen_ids:
                key = unique_key(path)
                aliases[key] = seen_ids[ident]
                return {"t": "tensor", "k": seen_ids[ident]}
            key = unique_key(path)
            if ident is not None:
                seen_ids[ident] = key
            tensors.append(FlatTensor(key, v))
            return {"t": "tensor", "k": key}
        if isinstance(v, torch.Size):
            return {"t": "size", "v": list(v)}
        if type(v) in (dict, collections.OrderedDict):
            kind = "odict" if type(v) is collections.OrderedDict else "dict"
            items = []
            for k, x in v.items():
                if isinstance(k, (torch.Tensor, dict, list)):
                    raise TypeError(f"{where}: unsupported key type {type(k).__qualname__}")
                items.append([key_node(k, where), walk(x, path + [str(k)], depth + 1)])
            return {"t": kind, "items": items}
        if type(v) in (list, tuple):
            return {"t": "list" if isinstance(v, list) else "tuple",
                    "items": [walk(x, path + [str(i)], depth + 1) for i, x in enumerate(v)]}
        return leaf(v, where)

    tree = walk(state, [], 0)
    del walk  # it reaches itself through its closure: break the cycle so the caller's tensors go with the caller
    return tree, tensors, aliases


def unflatten(tree: Any, tensor_for: Callable[[str], torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild the saved structure. Every node is type-checked: the tree comes from disk."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest tree: {msg}", file="flashwrite.json")

    def node(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH} levels")
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            raise bad("node is not an object with a type tag")
        t = n["t"]
        v = n.get("v")
        if t == "tensor":
            if not isinstance(n.get("k"), str):
                raise bad("tensor node without a key")
            return tensor_for(n["k"])
        if t in ("dict", "odict"):
            items = n.get("items")
            if not isinstance(items, list):
                raise bad("dict without items")
            out = {} if t == "dict" else collections.OrderedDict()
            for it in items:
                if not isinstance(it, list) or len(it) != 2:
                    raise bad("dict item is not a [key, value] pair")
                k = node(it[0], depth + 1)
                try:
                    out[k] = node(it[1], depth + 1)
                except TypeError:
                    raise bad(f"unhashable key {k!r}") from None
            return out
        if t in ("list", "tuple"):
            items = n.get("items")
            if not isinstance(items, list):
                raise bad(f"{t} without items")
            vals = [node(x, depth + 1) for x in items]
            return vals if t == "list" else tuple(vals)
        if t == "none":
            return None
        if t == "bool" and isinstance(v, bool):
            return v
        if t == "int" and isinstance(v, int) and not isinstance(v, bool):
            return v
        if t == "float" and isinstance(v, str):
            try:
                return float.fromhex(v)
            except (ValueError, OverflowError):  # "0x1p99999" overflows
                raise bad(f"bad float {v[:40]!r}") from None
        if t == "str" and isinstance(v, str):
            return v
        if t == "bytes" and isinstance(v, str):
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                raise bad("bad base64 bytes") from None
        if t == "dtype" and isinstance(v, str):
            dt = getattr(torch, v, None)
            if not isinstance(dt, torch.dtype):
                raise bad(f"unknown dtype {v[:40]!r}")
            return dt
        if t == "device" and isinstance(v, str):
            try:
                return torch.device(v)
            except (RuntimeError, ValueError):
                raise bad(f"bad device {v[:40]!r}") from None
        if t == "size" and isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if not all(-(1 << 63) <= x < (1 << 63) for x in v):  # torch.Size holds int64s
                raise bad("size out of range")
            return torch.Size(v)
        if t == "pickle" and isinstance(v, str):
            if not allow_pickle:
                raise UnsafeCheckpointError(
                    "checkpoint holds pickled objects; loading them can execute code. "
                    "Pass allow_pickle=True only for checkpoints you trust", file="flashwrite.json")
            return pickle.loads(base64.b64decode(v))
        raise bad(f"unknown or malformed node type {t[:40]!r}")

    try:
        return node(tree, 0)
    except RecursionError:
        raise bad("nested too deeply") from None
    finally:
        del node  # a self-referencing closure: left alone it would hold tensor_for (and the read buffers) until gc

