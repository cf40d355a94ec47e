"""The one parser of safetensors headers, which are hostile input: every header
flashwrite reads (a foreign file's, a shard ``flashwrite convert`` reads, a stripe's on
load) passes the same bounds here.

The bounds: an 8-byte little-endian length of at most ``MAX_HEADER_BYTES`` that fits in
the file; a JSON object (no fractions or exponents anywhere); ``__metadata__``, if there,
an object of strings; every other entry an object with a known dtype code, a shape of at
most ``MAX_DIMS`` integers in [0, 2**62], and ``data_offsets`` [start, end] inside the
data bytes that the dtype and shape fill exactly; no two non-empty tensors overlap.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import dtypes
from ..errors import CorruptCheckpointError
from .._core import MAX_HEADER_BYTES  # safetensors' own limit on a header (the native parser's too)
from .table import INT_LIMIT, MAX_DIMS

METADATA_KEY = "__metadata__"


class HeaderEntry(NamedTuple):
    code: str                 # the header's dtype code ("F32")
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int                # data_offsets: relative to the first byte after the header
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    header_bytes: int                 # 8 + the JSON's length: where the data starts in the file
    tensors: dict[str, HeaderEntry]   # in the header's order
    metadata: dict[str, str]


def _bad(name: str, msg: str, tensor: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{name}: {msg}", file=name, tensor=tensor)


def header_length(prefix: bytes | memoryview, size: int, name: str) -> int:
    """The JSON length the first 8 bytes of a ``size``-byte file give, bounded before
    anything is allocated by it."""
    if len(prefix) < 8 or size < 8:
        raise _bad(name, "too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise _bad(name, f"header length {n} is larger than the {size}-byte file or the safetensors limit "
                         f"({MAX_HEADER_BYTES})")
    return n


def _no_float(text: str) -> float:
    raise ValueError(f"a number with a fraction or exponent ({text[:20]}) in a safetensors header")


def parse_object(text: bytes, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(the header's tensor entries, as JSON gives them; its metadata) from the JSON text."""
    try:
        header = json.loads(text, parse_float=_no_float)
    except (ValueError, RecursionError):
        raise _bad(name, "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _bad(name, "safetensors header is not an object")
    meta = header.pop(METADATA_KEY, None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(name, f"{METADATA_KEY} must map strings to strings")
    return header, meta


def _is_uint(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT_LIMIT


def _entry(key: str, h: Any, data_bytes: int, name: str) -> HeaderEntry:
    if not isinstance(h, dict):
        raise _bad(name, "header entry is not an object", key)
    code = h.get("dtype")
    dt = dtypes.dtype_from_code(code)
    if dt is None:
        raise _bad(name, f"unknown dtype {str(code)[:20]!r}", key)
    shape, offs = h.get("shape"), h.get("data_offsets")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(_is_uint(x) for x in shape):
        raise _bad(name, f"shape must be a list of at most {MAX_DIMS} integers in [0, 2**62]", key)
    if type(offs) is not list or len(offs) != 2 or not all(type(x) is int for x in offs) \
            or not 0 <= offs[0] <= offs[1] <= data_bytes:
        raise _bad(name, f"data_offsets must lie inside the {data_bytes} data bytes", key)
    if math.prod(shape) * dt.itemsize != offs[1] - offs[0]:
        raise _bad(name, f"dtype {code} and shape {shape} do not fit {offs[1] - offs[0]} bytes", key)
    return HeaderEntry(code, dt, tuple(shape), offs[0], offs[1])


def check_entries(header: dict[str, Any], data_bytes: int, name: str) -> dict[str, HeaderEntry]:
    """Every tensor entry of a parsed header checked against the bounds, ``data_bytes``
    being what the file holds after its header."""
    out = {key: _entry(key, h, data_bytes, name) for key, h in header.items()}
    spans = sorted((e.start, e.end, key) for key, e in out.items() if e.end > e.start)
    for (_, e1, k1), (s2, _, k2) in zip(spans, spans[1:]):
        if e1 > s2:
            raise _bad(name, f"tensors {k1!r} and {k2!r} overlap", k2)
    return out


def _header(text: bytes, n: int, size: int, name: str) -> SafetensorsHeader:
    if len(text) != n:
        raise _bad(name, "header was cut short")
    header, meta = parse_object(text, name)
    return SafetensorsHeader(8 + n, check_entries(header, size - 8 - n, name), meta)


def parse(buf: bytes | memoryview, size: int, name: str) -> SafetensorsHeader:
    """The header at the start of ``buf`` (at least the whole header) of a ``size``-byte file."""
    n = header_length(buf, size, name)
    return _header(bytes(buf[8:8 + n]), n, size, name)


def read(fd: int, name: str, size: int | None = None) -> SafetensorsHeader:
    """The header of the open file ``fd`` (``size``: its size, when the caller has it)."""
    if size is None:
        size = os.fstat(fd).st_size
    n = header_length(os.pread(fd, 8, 0), size, name)
    return _header(os.pread(fd, n, 8), n, size, name)
