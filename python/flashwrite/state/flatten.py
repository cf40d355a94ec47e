"""Flatten a nested state dict into (tree, tensors); ``rebuild`` turns a tree back.

The tree is typed JSON: it keeps dict/OrderedDict/list/tuple containers, key types
(str, int, ...) and non-tensor leaves exactly, so ``load`` returns the structure
that was saved. Tensors become references to flat keys such as
``model.layers.0.weight``. Arbitrary objects need ``allow_pickle=True``.

What ``torch.save`` keeps, the tree keeps too:

- ``nn.Parameter`` and ``requires_grad`` (flags on the tensor node);
- storage sharing: tensors that view one storage (slices, transposes, ``expand``,
  one base under two names) are stored once, as the span of the storage they
  cover, and come back as views of one storage with the same offsets and strides
  (``view`` nodes: base key, dtype, byte offset, shape, stride);
- numpy arrays of numeric dtypes (``ndarray`` nodes over a stored tensor) and
  numpy scalars, without pickle.
"""

from __future__ import annotations

import base64
import collections
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import _core
from ..format.tree import MAX_DEPTH, referenced_keys, tensor_nodes
from .rebuild import NUMPY_KINDS, unflatten

__all__ = ["MAX_DEPTH", "Columns", "FlatTensor", "columns_of", "diagnose", "flatten", "flatten_columns",
           "referenced_keys", "stored_form", "tensor_nodes", "unflatten"]


@dataclass(slots=True)
class FlatTensor:
    key: str
    tensor: torch.Tensor


def _alias_id(t: torch.Tensor) -> tuple:
    """Identity of the exact bytes a tensor shows: equal ids are tied weights."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of its storage that a non-empty tensor can reach."""
    size = t.element_size()
    start = t.storage_offset() * size
    reach = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + reach * size


def _row_major(t: torch.Tensor) -> bool:
    """Contiguous with exactly the strides a new tensor of its shape gets (is_contiguous()
    ignores the strides of size-1 dims; a stored tensor comes back with the standard ones)."""
    expect = 1
    for n, st in zip(reversed(t.shape), reversed(t.stride())):
        if st != expect:
            return False
        expect *= n
    return True


def _check_storable(v: torch.Tensor, where: str) -> None:
    """Clear errors for tensors that hold no plain bytes, each naming the key."""
    if v.is_quantized:
        raise TypeError(f"{where}: quantized tensors ({v.dtype}) cannot be stored: they carry scales and zero points, "
                        "not just bytes; store t.dequantize() (or t.int_repr() with its q_scale()/q_zero_point())")
    if v.is_meta:
        raise TypeError(f"{where}: a meta tensor has no data to store; materialise it first (e.g. to_empty() "
                        "and initialise, or load real weights)")
    if v.is_nested:
        raise TypeError(f"{where}: nested tensors cannot be stored; store t.unbind() (a list of tensors) instead")
    if v.layout != torch.strided:
        raise TypeError(f"{where}: {v.layout} tensors cannot be stored (only dense strided ones); "
                        "store t.to_dense(), or the indices and values")
    if type(v) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"{where}: tensor subclass {type(v).__module__}.{type(v).__qualname__} cannot be stored "
                        "(only torch.Tensor and nn.Parameter); store a plain tensor, e.g. t.as_subclass(torch.Tensor)")


@dataclass(slots=True)
class Columns:
    """What the plan and the stager need of each stored tensor, read once by the walk
    (aligned with the tensors list; sources as stored: contiguous, resolved)."""
    keys: list[str]
    # Contiguous, on their original device. Handed to the native job (which keeps them
    # alive only until staged) and then dropped (None), so the caller's memory is not
    # held until the checkpoint commits.
    sources: list[torch.Tensor] | None
    dtypes: list[torch.dtype]
    shapes: list[str]  # as the header spells them: "4096,1024" ("" for a scalar)
    nbytes: list[int]
    ptrs: list[int]  # data_ptr() of each source, 0 for an empty one
    devices: list[str]  # "cpu", "cuda:0", ...

    def flat(self) -> list[FlatTensor]:
        """As (key, tensor) pairs, for the paths that still work tensor by tensor."""
        if self.sources is None:
            raise RuntimeError("these columns were staged already: their sources are gone")
        return list(map(FlatTensor, self.keys, self.sources))


def stored_form(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are stored for ``t``: contiguous, conjugate and negative
    views resolved (``t`` itself in the common case)."""
    if not t.requires_grad and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t  # the common case, without detach()'s cost per tensor
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_contiguous():
        return t
    with warnings.catch_warnings():  # our own copy of a complex32 view is no experiment of the user's
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
        return t.contiguous()


def columns_of(tensors: list[FlatTensor]) -> Columns:
    """The columns of tensors that did not come straight from the walk (shared storage
    resolved, a model split off for Hugging Face, a conversion): read here, as stored."""
    srcs = [stored_form(ft.tensor) for ft in tensors]
    return Columns([ft.key for ft in tensors], srcs, [s.dtype for s in srcs],
                   [",".join(map(str, s.shape)) for s in srcs], [s.nbytes for s in srcs],
                   [s.data_ptr() if s.nbytes and s.device.type != "meta" else 0 for s in srcs],
                   ["cpu" if s.is_cpu else str(s.device) for s in srcs])


def flatten(state: Any, *, allow_pickle: bool = False, share_storage: bool = False,
            check_storable: bool = True) -> tuple[dict, list[FlatTensor], dict[str, str]]:
    """Returns (tree, unique tensors, aliases {key: canonical key}).

    share_storage: tensors that view one storage are stored once as the span they
    cover, and the others become ``view`` nodes (what a save wants). Without it every
    distinct view is its own tensor (what matching keys against a destination wants).

    check_storable=False skips the per-tensor checks for tensors that hold no plain
    bytes (quantized, meta, nested, sparse): for a caller that fails on them anyway
    later (the save path) and then calls ``diagnose`` for the message that names the key.
    """
    tree, tensors, aliases, columns = _flatten(state, allow_pickle, share_storage, check_storable)
    return tree, tensors if tensors is not None else columns.flat(), aliases


def flatten_columns(state: Any, *, allow_pickle: bool = False) -> tuple[dict, dict[str, str], Columns]:
    """``flatten`` as a save wants it (shared storage resolved, tensors unchecked): (tree,
    aliases, the stored tensors as columns). The walk read the columns; a tensor object
    is made per tensor only for views that are stored resolved."""
    tree, tensors, aliases, columns = _flatten(state, allow_pickle, True, False)
    return tree, aliases, columns if columns is not None else columns_of(tensors)


def _flatten(state: Any, allow_pickle: bool, share_storage: bool,
             check_storable: bool) -> tuple[dict, list[FlatTensor] | None, dict[str, str], Columns | None]:
    """(tree, tensors, aliases, columns): columns when the walk's stand (no shared
    storage to resolve), and then tensors only if share_storage is off."""
    # The walk is native (csrc/python/state_walk.cpp: about 3 µs of Python per tensor
    # before); it calls back here for everything that is not a container or a tensor.
    np = sys.modules.get("numpy")  # no numpy imported: no numpy values can be in the state

    def leaf(v: Any, where: str) -> dict:
        if np is not None and isinstance(v, np.generic) and v.dtype.kind in NUMPY_KINDS:  # before float: float64
            return {"t": "npscalar", "dtype": v.dtype.newbyteorder("=").str,
                    "v": base64.b64encode(v.astype(v.dtype.newbyteorder("=")).tobytes()).decode()}
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

    def other(v: Any, prefix: str | None) -> dict | torch.Tensor:
        """A value that is not a container or a tensor: its node, or for a numpy array
        of a numeric dtype the tensor that stores its data (an ``ndarray`` node)."""
        if np is not None and isinstance(v, np.ndarray) and v.dtype.kind in NUMPY_KINDS and v.dtype.fields is None:
            arr = v if v.dtype.isnative else v.astype(v.dtype.newbyteorder("="))
            t = torch.from_numpy(np.ascontiguousarray(arr) if arr.flags.writeable else arr.copy())
            return t.reshape(arr.shape)
        if isinstance(v, torch.Size):
            return {"t": "size", "v": list(v)}
        return leaf(v, prefix or "<root>")

    walk = _core.walk_state(state, torch.Tensor, torch.nn.Parameter, collections.OrderedDict, other, leaf,
                            _check_storable, check_storable, MAX_DEPTH)
    tree, objs, keys, nodes, dts, shapes = walk.tree, walk.tensors, walk.keys, walk.nodes, walk.dtypes, walk.shapes
    ptrs, bases, nbytes, flags, used = walk.ptrs, walk.bases, walk.nbytes, walk.flags, walk.used
    stored = len(nbytes) - nbytes.count(0)
    distinct_ptrs, distinct_bases = set(ptrs), set(bases) if share_storage else None
    distinct_ptrs.discard(0)
    if distinct_bases is not None:
        distinct_bases.discard(0)
    if len(distinct_ptrs) == stored and (distinct_bases is None or len(distinct_bases) == stored):
        # No two tensors show bytes at one address and none shares a storage (the common
        # case): every tensor is stored as it is, and the columns stand.
        if not share_storage:  # not a save: the caller wants the tensors as they are
            return tree, list(map(FlatTensor, keys, objs)), {}, None
        devices = ["cpu" if f & _CPU else str(t.device) for f, t in zip(flags, objs)]
        for i in [i for i, f in enumerate(flags) if not f & _DENSE]:  # stored resolved: a copy of its own
            objs[i] = stored_form(objs[i])
            ptrs[i] = objs[i].data_ptr() if nbytes[i] else 0
        return tree, None, {}, Columns(keys, objs, dts, shapes, nbytes, ptrs, devices)
    return (tree, *_resolve_shared(objs, keys, nodes, ptrs, bases, nbytes, flags, used, share_storage), None)


_CPU, _DENSE = _core.WALK_CPU, _core.WALK_DENSE


def _resolve_shared(objs: list, keys: list[str], nodes: list[dict], ptrs: list[int], bases: list[int],
                    nbytes: list[int], flags: list[int], used: set[str],
                    share_storage: bool) -> tuple[dict, list[FlatTensor], dict[str, str]]:
    """Tied weights and shared storage, for a walk that met two tensors at one address
    (or, with share_storage, two tensors of one storage). A tensor whose exact bytes were
    met before (same storage, offset, shape, strides, dtype) becomes an alias; with
    share_storage, tensors that view one storage are stored once (see ``_share``).

    The exact identity is computed only for tensors whose data pointer was seen before."""
    tensors: list[FlatTensor] = []
    tensor_nodes: list[dict] = []  # the node of each stored tensor, by index
    alias_nodes: list[tuple[str, dict]] = []  # (canonical key, node) of every alias
    aliases: dict[str, str] = {}
    first_at: dict[int, int] = {}  # data pointer -> index of the first stored tensor there
    exact: dict[tuple, str] = {}  # alias identity -> key, for tensors whose pointer collided
    identified: set[int] = set()
    groups: dict[Any, int | list[int]] = {}  # storage address (with the device if not CPU) -> indices into tensors

    def unique_key(prefix: str) -> str:
        key = prefix
        if key in used:
            n = 1
            while f"{key}#{n}" in used:
                n += 1
            key = f"{key}#{n}"
        used.add(key)
        return key

    for v, key, node, ptr, base, nb, fl in zip(objs, keys, nodes, ptrs, bases, nbytes, flags):
        if nb:
            first = first_at.get(ptr)
            if first is not None:  # maybe the same bytes again (tied weights): compare exactly
                if first not in identified:
                    identified.add(first)
                    exact.setdefault(_alias_id(tensors[first].tensor), tensors[first].key)
                ident = _alias_id(v)
                canon = exact.get(ident)
                if canon is not None:
                    aliases[key] = canon
                    node["k"] = canon
                    alias_nodes.append((canon, node))
                    continue
                exact[ident] = key
                identified.add(len(tensors))
            else:
                first_at[ptr] = len(tensors)
            if share_storage:
                gk = base if fl & _CPU else (v.device, base)
                g = groups.get(gk)
                if g is None:
                    groups[gk] = len(tensors)  # a list only once a second tensor shares it
                elif type(g) is int:
                    groups[gk] = [g, len(tensors)]
                else:
                    g.append(len(tensors))
        tensors.append(FlatTensor(key, v))
        tensor_nodes.append(node)
    tree_tensors = tensors
    if any(type(g) is list for g in groups.values()):
        tree_tensors = _share(tensors, tensor_nodes, alias_nodes, aliases, groups, unique_key)
    return tree_tensors, aliases


def diagnose(state: Any) -> None:
    """Raise the clear error for the first tensor of ``state`` that cannot be stored
    (quantized, meta, nested, sparse, a subclass), naming its key as ``flatten`` does;
    return if none is (anything else about the state is not this function's to judge)."""
    def walk(v: Any, prefix: str | None, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            _check_storable(v, prefix or "<root>")
        elif depth <= MAX_DEPTH and isinstance(v, dict):
            for k, x in v.items():
                walk(x, str(k) if prefix is None else f"{prefix}.{k}", depth + 1)
        elif depth <= MAX_DEPTH and type(v) in (list, tuple):
            for i, x in enumerate(v):
                walk(x, str(i) if prefix is None else f"{prefix}.{i}", depth + 1)

    walk(state, None, 0)


def _share(tensors: list[FlatTensor], tensor_nodes: list[dict], alias_nodes: list[tuple[str, dict]],
           aliases: dict[str, str], groups: dict[Any, int | list[int]],
           unique_key: Callable[[str | None], str]) -> list[FlatTensor]:
    """Store each storage that several tensors view once: as the member that covers
    the whole span when there is one, else as the span itself; the rest become views."""
    drop: set[int] = set()
    extra: list[FlatTensor] = []
    aliased: dict[str, list[dict]] = {}
    for canon, node in alias_nodes:
        aliased.setdefault(canon, []).append(node)
    for members in groups.values():
        if type(members) is int:
            continue
        # Conjugate and negative views are stored resolved, on their own.
        members = [i for i in members if not tensors[i].tensor.is_conj() and not tensors[i].tensor.is_neg()]
        if len(members) < 2:
            continue
        spans = [_byte_span(tensors[i].tensor) for i in members]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        base_i = next((i for i, (a, b) in zip(members, spans)
                       if a == lo and b == hi and _row_major(tensors[i].tensor)
                       and all((a2 - lo) % tensors[j].tensor.element_size() == 0
                               for j, (a2, _) in zip(members, spans))), None)
        if base_i is not None:
            base_key, base_lo = tensors[base_i].key, lo
        else:
            first = tensors[members[0]].tensor
            dts = {tensors[i].tensor.dtype for i in members}
            dt = first.dtype if len(dts) == 1 else torch.uint8
            size = dt.itemsize
            base_lo = lo - lo % 16 if size == 1 and len(dts) > 1 else lo - lo % size
            n = -(-(hi - base_lo) // size)
            base = torch.empty(0, dtype=torch.uint8, device=first.device).view(dt).set_(
                first.untyped_storage(), base_lo // size, (n,), (1,))
            base_key = unique_key(tensors[members[0]].key + ".__storage__")
            extra.append(FlatTensor(base_key, base.detach()))
        for i, (a, _) in zip(members, spans):
            if i == base_i:
                continue
            t = tensors[i].tensor
            view = {"t": "view", "k": base_key, "dtype": str(t.dtype).removeprefix("torch."), "off": a - base_lo,
                    "shape": list(t.shape), "stride": list(t.stride())}
            for node in [tensor_nodes[i], *aliased.get(tensors[i].key, ())]:
                flags = {f: node[f] for f in ("param", "rg") if f in node}
                node.clear()
                node.update(view, **flags)
            drop.add(i)
    gone = {tensors[i].key for i in drop}
    for k in [k for k, c in aliases.items() if c in gone]:
        del aliases[k]  # their nodes became views of the base
    return [ft for i, ft in enumerate(tensors) if i not in drop] + extra
