"""Plan a save: assign tensors to stripe files and lay each file out.

Each stripe is a valid safetensors file: an 8-byte little-endian header length,
a JSON header padded with spaces so tensor data starts on a 4 KiB boundary, then
tensors packed with no holes, largest element size first so every tensor stays
naturally aligned. Stripes are balanced by bytes (largest tensor to the
lightest stripe).

Frozen tensors (``nn.Parameter`` with ``requires_grad=False``, as
``model.state_dict(keep_vars=True)`` gives a LoRA run's base weights) get stripes of
their own, apart from the rest: the first incremental save after a full one then
finds whole stripes unchanged and links them, instead of rewriting every stripe that
mixed a frozen tensor with a trained one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .. import _core
from ..format import dtypes
from ..state.flatten import Columns, FlatTensor, columns_of


@dataclass(slots=True)
class PlannedTensor:
    key: str
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    device: str = "cpu"
    offset: int = 0  # absolute offset in the stripe file

    @property
    def stored_code(self) -> str:
        return dtypes.safetensors_code(self.dtype) or "U8"

    @property
    def stored_shape(self) -> list[int]:
        return self.shape if dtypes.safetensors_code(self.dtype) else [self.nbytes]


class PlannedFile:
    """One stripe: its name, header and size, and where each of its tensors goes.

    Its tensors are rows of the plan's ``Columns`` (``members``, at ``offsets``); the
    ``PlannedTensor`` objects are made only when asked for (by the manifest, after
    staging), so a save of 100,000 tensors makes none of them while the caller waits."""

    __slots__ = ("name", "header", "size", "columns", "members", "offsets", "_tensors")

    def __init__(self, name: str, header: bytes, size: int, columns: Columns, members: list[int],
                 offsets: list[int]):
        self.name, self.header, self.size = name, header, size
        self.columns, self.members, self.offsets = columns, members, offsets
        self._tensors: list[PlannedTensor] | None = None

    @property
    def tensors(self) -> list[PlannedTensor]:
        if self._tensors is None:
            c = self.columns
            k = c.keys
            dims: dict[str, tuple[int, ...]] = {}  # shape text -> dims, parsed once per shape
            for text in {c.shapes[j] for j in self.members}:
                dims[text] = tuple(map(int, text.split(","))) if text else ()
            self._tensors = [PlannedTensor(k[j], c.dtypes[j], list(dims[c.shapes[j]]), c.nbytes[j], c.devices[j], off)
                             for j, off in zip(self.members, self.offsets)]
        return self._tensors


def stripe_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"


def rank_prefix(rank: int) -> str:
    """The stripe-name prefix of one rank's part of a multi-rank checkpoint."""
    return f"model-rank{rank:05d}"


def plan_files(tensors: list[FlatTensor] | None, stripes: int, prefix: str = "model",
               metadata: dict[str, str] | None = None, columns: Columns | None = None) -> list[PlannedFile]:
    """Stripes for ``tensors`` (or for the tensors of ``columns``, as the walk read them).

    Runs once per save of states with 100,000 tensors: the tensors' attributes come in
    columns, each dtype is checked once, and the layout and the headers are made
    natively (csrc/write/stripe_layout.cpp)."""
    if columns is None:
        columns = columns_of(tensors or [])
    dts, nbytes = columns.dtypes, columns.nbytes
    codes = {}
    for dt in set(dts):
        dtypes.dtype_name(dt)  # raises for dtypes we cannot store
        codes[dt] = (dtypes.safetensors_code(dt), dt.itemsize)
    n = max(1, min(stripes, len(nbytes) - nbytes.count(0)))
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        # safetensors' own rule for __metadata__, which every header reader here enforces
        raise TypeError(f"metadata must map strings to strings, got {metadata!r}"[:200])
    meta = json.dumps({"format": "pt", "writer": "flashwrite", **(metadata or {})}, separators=(",", ":"))
    groups = _frozen_apart(columns, n)
    if groups is not None:
        n = sum(count for _, count in groups)
    names = [stripe_name(prefix, i, n) for i in range(n)]
    if groups is None:
        layout = _core.layout_stripes(columns.keys, dts, columns.shapes, nbytes, codes, names, meta, json.dumps)
        return [PlannedFile(name, header, size, columns, members, offsets)
                for name, (header, size, members, offsets) in zip(names, layout)]
    out, first = [], 0
    for idx, count in groups:  # each group laid out on its own, its members mapped back to the state's rows
        part = names[first:first + count]
        first += count
        layout = _core.layout_stripes([columns.keys[j] for j in idx], [dts[j] for j in idx],
                                      [columns.shapes[j] for j in idx], [nbytes[j] for j in idx], codes, part, meta,
                                      json.dumps)
        out += [PlannedFile(name, header, size, columns, [idx[m] for m in members], offsets)
                for name, (header, size, members, offsets) in zip(part, layout)]
    return out


def _frozen_apart(columns: Columns, n: int) -> list[tuple[list[int], int]] | None:
    """(rows, stripe count) of the frozen tensors and of the others, the ``n`` stripes
    shared by bytes (at least one each); None where the state has no frozen tensor, only
    frozen ones, or one stripe to give."""
    sources = columns.sources
    if n < 2 or not sources:
        return None
    param = torch.nn.Parameter
    frozen = [j for j, t in enumerate(sources) if isinstance(t, param) and not t.requires_grad]
    if not frozen or len(frozen) == len(sources):
        return None
    fset = set(frozen)
    rest = [j for j in range(len(sources)) if j not in fset]
    nbytes = columns.nbytes
    fb, rb = sum(nbytes[j] for j in frozen), sum(nbytes[j] for j in rest)
    if not fb or not rb:
        return None
    n_rest = min(n - 1, max(1, round(n * rb / (fb + rb))))
    # no group gets more stripes than it has tensors with bytes (an empty stripe is no use)
    n_frozen = min(n - n_rest, sum(1 for j in frozen if nbytes[j]))
    n_rest = min(n_rest, sum(1 for j in rest if nbytes[j]))
    return [(frozen, n_frozen), (rest, n_rest)]
