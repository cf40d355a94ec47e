"""Plan a save: assign tensors to stripe files and lay each file out.

Each stripe is a valid safetensors file: an 8-byte little-endian header length,
a JSON header padded with spaces so tensor data starts on a 4 KiB boundary, then
tensors packed with no holes, largest element size first so every tensor stays
naturally aligned. Stripes are balanced by bytes (largest tensor to the
lightest stripe).
"""

from __future__ import annotations

import heapq
import json
import struct
import warnings
from dataclasses import dataclass, field

import torch

from . import dtypes
from .flatten import FlatTensor

ALIGN = 4096
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(slots=True)
class PlannedTensor:
    key: str
    # Contiguous, on its original device. Handed to the native job (which keeps it
    # alive only until staged) and then dropped here, so the caller's memory is
    # not held until the checkpoint commits.
    source: torch.Tensor | None
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    device: str = "cpu"
    file: int = 0
    offset: int = 0  # absolute offset in the stripe file

    @property
    def stored_code(self) -> str:
        return dtypes.safetensors_code(self.dtype) or "U8"

    @property
    def stored_shape(self) -> list[int]:
        return self.shape if dtypes.safetensors_code(self.dtype) else [self.nbytes]


@dataclass
class PlannedFile:
    name: str
    header: bytes = b""
    size: int = 0
    tensors: list[PlannedTensor] = field(default_factory=list)


def stripe_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"


def rank_prefix(rank: int) -> str:
    """The stripe-name prefix of one rank's part of a multi-rank checkpoint."""
    return f"model-rank{rank:05d}"


def _contiguous(t: torch.Tensor) -> torch.Tensor:
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


def _json_key(key: str) -> str:
    # Printable ASCII but '"' and '\\' is a JSON string as it is (str methods: a regex
    # match per key of 100,000 costs more).
    if key.isascii() and key.isprintable() and '"' not in key and "\\" not in key:
        return f'"{key}"'
    return json.dumps(key)


def plan_files(tensors: list[FlatTensor], stripes: int, prefix: str = "model",
               metadata: dict[str, str] | None = None) -> list[PlannedFile]:
    """Runs once per save of states with 100,000 tensors: attributes are read column by
    column, each dtype is checked once, and the headers are written as text."""
    srcs = [_contiguous(ft.tensor) for ft in tensors]
    dts = [s.dtype for s in srcs]
    codes = {}
    for dt in set(dts):
        dtypes.dtype_name(dt)  # raises for dtypes we cannot store
        codes[dt] = dtypes.safetensors_code(dt)
    nbytes = [s.nbytes for s in srcs]
    devs = ["cpu" if s.is_cpu else str(s.device) for s in srcs]
    shapes = [s.shape for s in srcs]  # torch.Size: a tuple, so its header text is made once per shape
    keys = [ft.key for ft in tensors]
    planned = list(map(PlannedTensor, keys, srcs, dts, map(list, shapes), nbytes, devs))
    del srcs
    itemsize = {dt: dt.itemsize for dt in codes}
    sizes = [itemsize[dt] for dt in dts]
    shape_text: dict[torch.Size, str] = {}

    n = max(1, min(stripes, sum(1 for b in nbytes if b) or 1))
    files = [PlannedFile(stripe_name(prefix, i, n)) for i in range(n)]
    members: list[list[int]] = [[] for _ in range(n)]
    if n == 1:
        members[0] = list(range(len(planned)))
    else:
        # Largest first to the lightest stripe; equal sizes keep the state's order (a stable sort).
        heap = [(0, i) for i in range(n)]
        for j in sorted(range(len(planned)), key=nbytes.__getitem__, reverse=True):
            load, i = heap[0]
            members[i].append(j)
            heapq.heapreplace(heap, (load + nbytes[j], i))
    meta = json.dumps({"format": "pt", "writer": "flashwrite", **(metadata or {})}, separators=(",", ":"))
    for fi, (f, idx) in enumerate(zip(files, members)):
        idx.sort()
        idx.sort(key=sizes.__getitem__, reverse=True)  # largest elements first: all stay aligned
        parts = ['{"__metadata__":', meta]
        rels = []
        rel = 0
        for j in idx:
            code, nb = codes[dts[j]], nbytes[j]
            if code:
                sh = shapes[j]
                shape = shape_text.get(sh)
                if shape is None:
                    shape = shape_text[sh] = ",".join(map(str, sh))
            else:
                shape = str(nb)
            parts.append(f',{_json_key(keys[j])}:{{"dtype":"{code or "U8"}","shape":[{shape}],'
                         f'"data_offsets":[{rel},{rel + nb}]}}')
            rels.append(rel)
            rel += nb
        parts.append("}")
        body = "".join(parts).encode()
        padded = -(-(8 + len(body)) // ALIGN) * ALIGN - 8
        if padded > MAX_HEADER_BYTES:
            raise ValueError(f"{f.name}: safetensors header would be {padded} bytes (limit {MAX_HEADER_BYTES}); "
                             "use more stripes")
        f.header = struct.pack("<Q", padded) + body + b" " * (padded - len(body))
        hb = len(f.header)
        f.tensors = [planned[j] for j in idx]
        for p, r in zip(f.tensors, rels):
            p.offset, p.file = hb + r, fi
        f.size = hb + rel
    return files
