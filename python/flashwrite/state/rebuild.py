"""Rebuild the nested structure from a saved tree (the inverse of ``flatten``).

The tree comes from disk, so it is hostile input: every node is type-checked and
raises ``CorruptCheckpointError`` (or ``UnsafeCheckpointError`` for pickled objects
without ``allow_pickle``) when it is not what ``flatten`` writes.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
from typing import Any, Callable

import torch

from ..format import dtypes
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..format.tree import MAX_DEPTH

# numpy dtypes stored as tensor data (numeric, fixed size); everything else needs pickle.
NUMPY_KINDS = frozenset("biufc")
_MAX_DIMS = 64


def unflatten(tree: Any, tensor_for: Callable[[str], torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild the saved structure. Every node is type-checked: the tree comes from disk."""
    r = _Rebuild(tensor_for, allow_pickle)
    try:
        return r.node(tree, 0)
    except RecursionError:
        raise _bad("nested too deeply") from None
    finally:
        # Left alone, a traceback through r would hold tensor_for (and the read buffers) until it goes.
        r.tensor_for = None  # type: ignore[assignment]
        r.made.clear()


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest tree: {msg}", file="flashwrite.json")


class _Rebuild:
    """One rebuild: where tensors come from, and the tensors made so far (one object per
    distinct (key, view, flags), so ties stay ties)."""

    __slots__ = ("tensor_for", "allow_pickle", "made")

    def __init__(self, tensor_for: Callable[[str], torch.Tensor], allow_pickle: bool):
        self.tensor_for = tensor_for
        self.allow_pickle = allow_pickle
        self.made: dict[tuple, torch.Tensor] = {}

    def tensor_node(self, n: dict, t: str) -> torch.Tensor:
        k = n.get("k")
        if not isinstance(k, str):
            raise _bad(f"{t} node without a key")
        param, rg = n.get("param", False), n.get("rg", False)
        if not isinstance(param, bool) or not isinstance(rg, bool):
            raise _bad(f"tensor {k!r}: bad flags")
        shape = (n.get("dtype"), n.get("off"), str(n.get("shape")), str(n.get("stride"))) if t == "view" else None
        ident = (k, shape, param, rg)
        made = self.made
        if ident in made:
            return made[ident]
        base = self.tensor_for(k)
        out = _view_of(base, n) if t == "view" else base
        if param:
            out = torch.nn.Parameter(out, requires_grad=rg)
        elif rg:
            if out is base:  # a fresh tensor object over the same storage: the base keeps its own flag
                out = base.detach()
            out.requires_grad_(True)
        made[ident] = out
        return out

    def node(self, n: Any, depth: int) -> Any:
        """The containers, tensors and common leaves; the other leaves are ``_leaf``'s."""
        if depth > MAX_DEPTH:
            raise _bad(f"nested deeper than {MAX_DEPTH} levels")
        if not isinstance(n, dict) or not isinstance(n.get("t"), str):
            raise _bad("node is not an object with a type tag")
        t = n["t"]
        v = n.get("v")
        if t in ("tensor", "view"):
            return self.tensor_node(n, t)
        if t == "ndarray" and isinstance(v, dict) and v.get("t") in ("tensor", "view"):
            x = self.tensor_node(v, v["t"])
            if x.requires_grad or x.dtype not in _TORCH_TO_NUMPY_OK:
                raise _bad("ndarray node over a tensor numpy cannot hold")
            return x.numpy()
        if t in ("dict", "odict"):
            items = n.get("items")
            if not isinstance(items, list):
                raise _bad("dict without items")
            out = {} if t == "dict" else collections.OrderedDict()
            for it in items:
                if not isinstance(it, list) or len(it) != 2:
                    raise _bad("dict item is not a [key, value] pair")
                k = self.node(it[0], depth + 1)
                try:
                    out[k] = self.node(it[1], depth + 1)
                except TypeError:
                    raise _bad(f"unhashable key {k!r}") from None
            return out
        if t in ("list", "tuple"):
            items = n.get("items")
            if not isinstance(items, list):
                raise _bad(f"{t} without items")
            vals = [self.node(x, depth + 1) for x in items]
            return vals if t == "list" else tuple(vals)
        if t == "none":
            return None
        if t == "bool" and isinstance(v, bool):
            return v
        if t == "int" and isinstance(v, int) and not isinstance(v, bool):
            return v
        if t == "str" and isinstance(v, str):
            return v
        return _leaf(n, t, v, self.allow_pickle)


def _leaf(n: dict, t: str, v: Any, allow_pickle: bool) -> Any:
    """The less common leaves (numpy scalars, floats, bytes, dtypes, devices, sizes,
    pickles); anything else is no node ``flatten`` writes."""
    if t == "npscalar" and isinstance(v, str) and isinstance(n.get("dtype"), str):
        np = _numpy()
        try:
            dt = np.dtype(n["dtype"])
            if dt.kind not in NUMPY_KINDS or dt.fields is not None:
                raise TypeError
            return np.frombuffer(base64.b64decode(v, validate=True), dtype=dt, count=1)[0]
        except (TypeError, ValueError):
            raise _bad(f"bad numpy scalar {n['dtype'][:20]!r}") from None
    if t == "float" and isinstance(v, str):
        try:
            return float.fromhex(v)
        except (ValueError, OverflowError):  # "0x1p99999" overflows
            raise _bad(f"bad float {v[:40]!r}") from None
    if t == "bytes" and isinstance(v, str):
        try:
            return base64.b64decode(v, validate=True)
        except ValueError:
            raise _bad("bad base64 bytes") from None
    if t == "dtype" and isinstance(v, str):
        dt = getattr(torch, v, None)
        if not isinstance(dt, torch.dtype):
            raise _bad(f"unknown dtype {v[:40]!r}")
        return dt
    if t == "device" and isinstance(v, str):
        try:
            return torch.device(v)
        except (RuntimeError, ValueError):
            raise _bad(f"bad device {v[:40]!r}") from None
    if t == "size" and isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        if not all(-(1 << 63) <= x < (1 << 63) for x in v):  # torch.Size holds int64s
            raise _bad("size out of range")
        return torch.Size(v)
    if t == "pickle" and isinstance(v, str):
        if not allow_pickle:
            raise UnsafeCheckpointError(
                "checkpoint holds pickled objects; loading them can execute code. "
                "Pass allow_pickle=True only for checkpoints you trust", file="flashwrite.json")
        return pickle.loads(base64.b64decode(v))
    raise _bad(f"unknown or malformed node type {t[:40]!r}")


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > _MAX_DIMS or \
            not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (1 << 62) for i in x):
        raise _bad(f"view {what} must be a list of at most {_MAX_DIMS} non-negative integers")
    return tuple(x)


def _view_of(base: torch.Tensor, n: dict) -> torch.Tensor:
    try:
        dt = dtypes.dtype_from_name(n.get("dtype"))
    except ValueError as e:
        raise _bad(f"view of {n['k']!r}: {e}") from None
    off, shape, stride = n.get("off"), _ints(n.get("shape"), "shape"), _ints(n.get("stride"), "stride")
    size = dt.itemsize
    if not isinstance(off, int) or isinstance(off, bool) or off < 0 or off % size or len(stride) != len(shape):
        raise _bad(f"view of {n['k']!r}: bad offset or stride")
    numel = math.prod(shape)
    reach = (1 + sum((a - 1) * b for a, b in zip(shape, stride))) * size if numel else 0
    have = base.numel() * base.element_size()
    if off + reach > have:
        raise _bad(f"view of {n['k']!r} reaches byte {off + reach}, past the {have} bytes of its base")
    start = base.storage_offset() * base.element_size() + off
    return torch.empty(0, dtype=torch.uint8, device=base.device).view(dt).set_(
        base.untyped_storage(), start // size, shape, stride)


def _numpy() -> Any:
    import numpy  # only for checkpoints that hold numpy values

    return numpy


_TORCH_TO_NUMPY_OK = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                                *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))})

