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


def plan_files(tensors: list[FlatTensor], stripes: int, prefix: str = "model",
               metadata: dict[str, str] | None = None) -> list[PlannedFile]:
    planned = []
    device_names: dict[torch.device, str] = {}
    for ft in tensors:
        src = _contiguous(ft.tensor)
        dt = src.dtype
        dtypes.dtype_name(dt)  # raises for dtypes we cannot store
        dev = src.device
        name = device_names.get(dev)
        if name is None:
            name = device_names[dev] = str(dev)
        planned.append(PlannedTensor(ft.key, src, dt, list(src.shape), src.nbytes, name))

    n = max(1, min(stripes, sum(1 for p in planned if p.nbytes) or 1))
    files = [PlannedFile(stripe_name(prefix, i, n)) for i in range(n)]
    heap = [(0, i) for i in range(n)]
    for p in sorted(planned, key=lambda p: (-p.nbytes, p.key)):
        load, i = heapq.heappop(heap)
        files[i].tensors.append(p)
        heapq.heappush(heap, (load + p.nbytes, i))

    for f in files:
        f.tensors.sort(key=lambda p: (-p.dtype.itemsize, p.key))
        header: dict = {"__metadata__": {"format": "pt", "writer": "flashwrite", **(metadata or {})}}
        rel = 0
        code_of = dtypes.safetensors_code
        for p in f.tensors:
            code = code_of(p.dtype)
            header[p.key] = {"dtype": code or "U8", "shape": p.shape if code else [p.nbytes],
                             "data_offsets": [rel, rel + p.nbytes]}
            p.offset = rel  # relative for now
            rel += p.nbytes
        body = json.dumps(header, separators=(",", ":")).encode()
        padded = -(-(8 + len(body)) // ALIGN) * ALIGN - 8
        if padded > MAX_HEADER_BYTES:
            raise ValueError(f"{f.name}: safetensors header would be {padded} bytes (limit {MAX_HEADER_BYTES}); "
                             "use more stripes")
        f.header = struct.pack("<Q", padded) + body + b" " * (padded - len(body))
        for p in f.tensors:
            p.offset += len(f.header)
        f.size = len(f.header) + rel
    for i, f in enumerate(files):
        for p in f.tensors:
            p.file = i
    return files
