"""The tensor table of a manifest, checked as hostile input column by column (one pass
per check in C where it can be: a table of 100,000 tensors costs milliseconds). The
first failing tensor is named, with the message a check of it alone would give."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np

from . import dtypes
from ..errors import CorruptCheckpointError
from .manifest import MANIFEST_NAME, FileEntry, TensorEntry

INT_LIMIT = 1 << 62  # sizes, offsets and dims: their sums and products stay exact in int64
MAX_DIMS = 64
_HEX_RE = re.compile(r"^[0-9a-f]{16}$")
_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}", file=MANIFEST_NAME)


def checked_int(v: Any, what: str, lo: int = 0, hi: int = INT_LIMIT) -> int:
    """``v`` when it is an integer (not a bool) in [lo, hi]; else the manifest is corrupt."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _bad(f"{what} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def _first(col: list, ok: Callable[[Any], bool]) -> int:
    """Index of the first value of col for which ok(value) is false."""
    return next(i for i, v in enumerate(col) if not ok(v))


def _is_uint(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT_LIMIT


def check_table(keys: list, cols: dict, sums: Any, files: list[FileEntry], block: int) -> dict[str, TensorEntry]:
    """The tensor table's entries, every field checked. ``cols``: one list per field of
    ``TABLE_FIELDS``; ``sums``: every tensor's checksum list (plain manifests), or one
    hex string holding each tensor's pieces in turn (packed ones)."""
    _check_keys(keys, files)
    n = len(keys)
    fcol, ocol, ncol = cols["file"], cols["offset"], cols["nbytes"]
    _check_placement(keys, fcol, ocol, ncol, files)
    fi = np.fromiter(fcol, np.int64, n)
    off = np.fromiter(ocol, np.int64, n)
    nb = np.fromiter(ncol, np.int64, n)
    _check_inside_files(keys, fcol, ocol, ncol, files, fi, off, nb)
    isz = _check_dtypes_and_shapes(keys, cols["dtype"], cols["shape"], ncol, fcol, files)
    _check_alignment(keys, fcol, ocol, files, off, nb, np.fromiter(isz, np.int64, n))
    vcol = [("cpu" if v is None else v) for v in cols["device"]]
    if not all(type(v) is str and len(v) <= 64 for v in vcol):
        i = _first(vcol, lambda v: type(v) is str and len(v) <= 64)
        raise _bad(f"tensor {keys[i]!r}: bad device")
    sum_col = _checksum_column(keys, sums, off, nb, block)
    _check_overlaps(keys, fcol, files, fi, off, nb)
    _check_coverage(files, fi, nb)
    shapes = [tuple(s) for s in cols["shape"]]
    return dict(zip(keys, map(TensorEntry, keys, fcol, ocol, ncol, cols["dtype"], shapes, vcol, sum_col)))


def _check_keys(keys: list, files: list[FileEntry]) -> None:
    if not all(type(k) is str for k in keys):
        raise _bad(f"tensor name {str(keys[_first(keys, lambda k: type(k) is str)])[:80]!r} is not a string")
    if len(set(keys)) != len(keys):
        raise _bad("a tensor is listed twice")
    if keys and not files:
        raise _bad("tensors listed but no files")


def _check_placement(keys: list, fcol: list, ocol: list, ncol: list, files: list[FileEntry]) -> None:
    """Every file index names a file; every offset and nbytes is an integer in range."""
    if not all(type(v) is int and 0 <= v < len(files) for v in fcol):
        i = _first(fcol, lambda v: type(v) is int and 0 <= v < len(files))
        checked_int(fcol[i], f"{keys[i]}.file", 0, max(0, len(files) - 1))
    for col, what in ((ncol, "nbytes"), (ocol, "offset")):
        if not all(type(v) is int and 0 <= v <= INT_LIMIT for v in col):
            i = _first(col, _is_uint)
            checked_int(col[i], f"{keys[i]}.{what}")


def _check_inside_files(keys: list, fcol: list, ocol: list, ncol: list, files: list[FileEntry],
                        fi: np.ndarray, off: np.ndarray, nb: np.ndarray) -> None:
    """Every tensor lies in its stripe's data: past the header, before the end."""
    size = np.array([f.size for f in files], np.int64)
    hb = np.array([f.header_bytes for f in files], np.int64)
    below = off < hb[fi]
    if below.any():
        i = int(np.argmax(below))
        checked_int(ocol[i], f"{keys[i]}.offset", files[fcol[i]].header_bytes)
    past = off + nb > size[fi]  # both <= 2**62: no overflow
    if past.any():
        i = int(np.argmax(past))
        fe = files[fcol[i]]
        raise CorruptCheckpointError(f"tensor {keys[i]!r} ends at {ocol[i] + ncol[i]}, past the end of {fe.name} "
                                     f"({fe.size} bytes)", file=fe.name, tensor=keys[i])


def _check_dtypes_and_shapes(keys: list, dcol: list, scol: list, ncol: list, fcol: list,
                             files: list[FileEntry]) -> list[int]:
    """Known dtypes and plain shapes whose element count fills nbytes exactly; returns
    each tensor's element size."""
    if not all(type(v) is str for v in dcol):
        i = _first(dcol, lambda v: type(v) is str)
        raise _bad(f"tensor {keys[i]!r}: dtype {str(dcol[i])[:40]!r} is not a dtype name")
    itemsizes: dict[str, int] = {}
    for name in set(dcol):
        try:
            itemsizes[name] = dtypes.itemsize(dtypes.dtype_from_name(name))
        except ValueError as e:
            i = dcol.index(name)
            raise _bad(f"tensor {keys[i]!r}: {e}") from None
    if not all(type(s) is list and len(s) <= MAX_DIMS for s in scol):
        i = _first(scol, lambda s: type(s) is list and len(s) <= MAX_DIMS)
        raise _bad(f"tensor {keys[i]!r}: shape must be a list of at most {MAX_DIMS} dims")
    if not all(type(d) is int and 0 <= d <= INT_LIMIT for s in scol for d in s):
        i = _first(scol, lambda s: all(_is_uint(d) for d in s))
        for d in scol[i]:
            checked_int(d, f"{keys[i]}.shape")
    isz = [itemsizes[v] for v in dcol]
    need = [math.prod(s) * z for s, z in zip(scol, isz)]
    if need != ncol:
        i = next(i for i, (a, b) in enumerate(zip(need, ncol)) if a != b)
        raise CorruptCheckpointError(f"tensor {keys[i]!r}: dtype {dcol[i]} and shape {scol[i]} need "
                                     f"{need[i]} bytes, the manifest says {ncol[i]}",
                                     file=files[fcol[i]].name, tensor=keys[i])
    return isz


def _check_alignment(keys: list, fcol: list, ocol: list, files: list[FileEntry],
                     off: np.ndarray, nb: np.ndarray, iz: np.ndarray) -> None:
    unaligned = (nb > 0) & (off % iz != 0)  # the writer aligns every tensor; views need it
    if unaligned.any():
        i = int(np.argmax(unaligned))
        fe = files[fcol[i]]
        raise CorruptCheckpointError(f"tensor {keys[i]!r} at offset {ocol[i]} of {fe.name} is not aligned to its "
                                     f"{int(iz[i])}-byte elements", file=fe.name, tensor=keys[i])


def _checksum_column(keys: list, sums: Any, off: np.ndarray, nb: np.ndarray, block: int) -> list[tuple[str, ...]]:
    """Each tensor's checksums, one 16-digit hex string per piece of ``block`` bytes."""
    pieces = np.where(nb > 0, (off + nb - 1) // block - off // block + 1, 0)
    if isinstance(sums, str):
        if len(sums) != 16 * int(pieces.sum()) or not _HEX_DIGITS.fullmatch(sums):
            raise _bad(f"packed checksums must be {int(pieces.sum())} 16-digit hex strings, one per piece")
        ends = (np.cumsum(pieces) * 16).tolist()
        starts = [0] + ends[:-1]
        return [tuple(sums[a + 16 * j: a + 16 * j + 16] for j in range((b - a) // 16)) if b - a != 16
                else (sums[a:b],) for a, b in zip(starts, ends)]
    plist = pieces.tolist()
    for i, c in enumerate(sums):
        if not isinstance(c, list) or not all(isinstance(h, str) and _HEX_RE.match(h) for h in c):
            raise _bad(f"tensor {keys[i]!r}: checksums must be 16-digit hex strings")
        if len(c) != plist[i]:
            raise _bad(f"tensor {keys[i]!r}: {len(c)} checksums for {plist[i]} pieces")
    return [tuple(c) for c in sums]


def _check_overlaps(keys: list, fcol: list, files: list[FileEntry],
                    fi: np.ndarray, off: np.ndarray, nb: np.ndarray) -> None:
    """Per file, sorted by offset, each non-empty tensor ends before the next starts."""
    live = np.flatnonzero(nb > 0)
    order = live[np.lexsort((off[live], fi[live]))]
    same = fi[order[1:]] == fi[order[:-1]]
    clash = same & (off[order[:-1]] + nb[order[:-1]] > off[order[1:]])
    if clash.any():
        j = int(np.argmax(clash))
        a, b = int(order[j]), int(order[j + 1])
        raise CorruptCheckpointError(f"tensors {keys[a]!r} and {keys[b]!r} overlap in {files[fcol[b]].name}",
                                     file=files[fcol[b]].name, tensor=keys[b])


def _check_coverage(files: list[FileEntry], fi: np.ndarray, nb: np.ndarray) -> None:
    """Stripes are packed: with no overlaps, equal sums mean every data byte belongs to a
    tensor, so no unchecked bytes exist and no file is larger (to read) than its tensors."""
    covered = np.zeros(len(files), np.int64)
    np.add.at(covered, fi, nb)
    for i, fe in enumerate(files):
        if int(covered[i]) != fe.size - fe.header_bytes:
            raise CorruptCheckpointError(f"{fe.name}: its tensors cover {int(covered[i])} of "
                                         f"{fe.size - fe.header_bytes} data bytes (stripes hold nothing but tensors)",
                                         file=fe.name)
