"""Plan a save: assign tensors to stripe files and lay each file out.

Each stripe is a valid safetensors file: an 8-byte little-endian header length,
a JSON header padded with spaces so tensor data starts on a 4 KiB boundary, then
tensors packed with no holes, largest element size first so every tensor stays
naturally aligned. Stripes are balanced by bytes (largest tensor to the
lightest stripe).
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
    names = [stripe_name(prefix, i, n) for i in range(n)]
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        # safetensors' own rule for __metadata__, which every header reader here enforces
        raise TypeError(f"metadata must map strings to strings, got {metadata!r}"[:200])
    meta = json.dumps({"format": "pt", "writer": "flashwrite", **(metadata or {})}, separators=(",", ":"))
    layout = _core.layout_stripes(columns.keys, dts, columns.shapes, nbytes, codes, names, meta, json.dumps)
    return [PlannedFile(name, header, size, columns, members, offsets)
            for name, (header, size, members, offsets) in zip(names, layout)]
