"""On-disk format, version 4: the manifest (``flashwrite.json``), the Hugging Face
style index, and the checks that make a checkpoint safe to open.

Version 3 added to version 2 a SHA-256 of the manifest's own content
(``manifest_checksum``), so an edited manifest cannot load as a different state.
Version 4 stores the per-tensor part of the manifest (the tensor table, the tree and
the aliases) packed: one ``packed`` field holding, base64-encoded, the zlib-compressed
JSON of the table as columns (one list per field, every checksum in one hex string).
A state of 100,000 tensors then costs tens of bytes per tensor on disk instead of
hundreds, and is parsed and checked column by column. The rest of the manifest stays
plain JSON, and the seal covers the packed field like any other value.

Manifests of versions 1 to 3 still load; for every version, each tensor's dtype,
shape and byte range is cross-checked against its stripe's own safetensors header.

Everything read from disk is treated as hostile: names cannot leave the
checkpoint directory, sizes and offsets are bounds-checked before anything is
allocated, tensors cannot overlap, and dtype/shape must agree with byte lengths.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import zlib
import os
import re
import stat
import struct
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import dtypes, gcpause
from ._core import CHECKSUM_ALGORITHM
from .errors import CorruptCheckpointError, FlashwriteError, UnsafeCheckpointError
from .flatten import referenced_keys
from .plan import MAX_HEADER_BYTES, PlannedFile
from .target import local_path

# 2: the tree may hold view, ndarray and npscalar nodes and tensor flags (param, rg).
# 3: the manifest carries manifest_checksum, a SHA-256 of its own content.
# 4: tensors, tree and aliases are stored packed (columns, zlib, base64) in "packed".
# Every version ever written stays readable (fixtures under tests/data/).
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
SEALED_SINCE = 3  # manifests of this version and later must carry manifest_checksum
PACKED_SINCE = 4  # manifests of this version and later may carry their table packed
SEAL_FIELD = "manifest_checksum"
PACKED_FIELD = "packed"
PACKED_ENCODING = "zlib+json/columns"
_TABLE_FIELDS = ("file", "offset", "nbytes", "dtype", "shape", "device")
MANIFEST_NAME = "flashwrite.json"
INDEX_NAME = "model.safetensors.index.json"
MAX_MANIFEST_BYTES = 1 << 30
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # used with fullmatch: no trailing newline
_HEX_RE = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    header_bytes: int


class TensorEntry(NamedTuple):
    # A named tuple: a manifest of 100,000 tensors makes 100,000 of these per load.
    key: str
    file: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    aliases: dict[str, str]
    tree: Any
    block_bytes: int
    writer_version: str
    metadata: dict[str, str]
    raw: dict


def piece_ranges(offset: int, nbytes: int, block: int) -> list[tuple[int, int]]:
    """Checksummed pieces of a tensor: its bytes cut at file offsets that are multiples of block."""
    out = []
    pos, end = offset, offset + nbytes
    while pos < end:
        nxt = min(end, (pos // block + 1) * block)
        out.append((pos, nxt - pos))
        pos = nxt
    return out


def assemble(files: list[dict], tensors: dict[str, dict], aliases: dict[str, str], tree: Any, block_bytes: int,
             writer_version: str, metadata: dict[str, str] | None = None, **sections: Any) -> dict:
    """A manifest from its parts: every manifest flashwrite writes is made here.
    ``sections`` (e.g. ``ranks``, ``dcp``) are added where not None."""
    m = {
        "format": "flashwrite",
        "format_version": FORMAT_VERSION,
        "writer_version": writer_version,
        "created_unix": time.time(),
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": block_bytes},
        "files": files,
        "tensors": tensors,
        "aliases": aliases,
        "tree": tree,
        "metadata": metadata or {},
    }
    m.update((k, v) for k, v in sections.items() if v is not None)
    return m


def build_manifest(files: list[PlannedFile], checksums: dict[str, list[int]], aliases: dict[str, str], tree: Any,
                   block_bytes: int, writer_version: str, metadata: dict[str, str] | None = None,
                   rank_info: dict | None = None, hf: dict | None = None) -> dict:
    tensors = {}
    names = {}  # dtype -> name, looked up once per dtype: this runs per tensor of 100,000
    for i, f in enumerate(files):
        for p in f.tensors:
            name = names.get(p.dtype)
            if name is None:
                name = names[p.dtype] = dtypes.dtype_name(p.dtype)
            tensors[p.key] = {"file": i, "offset": p.offset, "nbytes": p.nbytes, "dtype": name, "shape": p.shape,
                              "device": p.device, "checksums": ["%016x" % h for h in checksums[p.key]]}
    return assemble([{"name": f.name, "size": f.size, "header_bytes": len(f.header)} for f in files], tensors,
                    aliases, tree, block_bytes, writer_version, metadata, ranks=rank_info or None, hf=hf)


def build_index(m: dict) -> dict:
    """Hugging Face's model.safetensors.index.json: every tensor, or with an ``hf``
    section (``hf_model=``) only the model's, so from_pretrained sees just the model."""
    names = [f["name"] for f in m["files"]]
    listed = set(m["hf"]["files"]) if m.get("hf") else set(names)
    mine = {k: t for k, t in m["tensors"].items() if names[t["file"]] in listed}
    return {
        "metadata": {"total_size": sum(t["nbytes"] for t in mine.values())},
        "weight_map": {k: names[t["file"]] for k, t in mine.items()},
    }


def _content_digest(raw: dict) -> str:
    """SHA-256 of the manifest's content without its seal, in one canonical spelling
    (sorted keys, no spaces), so it covers exactly what the parser reads: JSON
    whitespace and key order may change, no value can."""
    body = {k: v for k, v in raw.items() if k != SEAL_FIELD}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def encode_manifest(m: dict) -> bytes:
    """The bytes of flashwrite.json for manifest ``m`` (as ``assemble`` makes it: tensors,
    tree and aliases plain): from version 4 with those packed, then sealed with its checksum."""
    with gcpause.paused():
        return _encode_manifest(m)


def _encode_manifest(m: dict) -> bytes:
    sealed = {k: v for k, v in m.items() if k != SEAL_FIELD}
    version = sealed.get("format_version")
    if isinstance(version, int) and version >= PACKED_SINCE and "tensors" in sealed:
        try:
            packed = pack_table(sealed["tensors"], sealed.get("tree"), sealed.get("aliases", {}))
        except (TypeError, ValueError):
            pass  # no table to pack (an editor's or a test's): written plain, for the parser to judge
        else:
            for k in ("tensors", "tree", "aliases"):
                sealed.pop(k, None)
            sealed[PACKED_FIELD] = packed
    sealed[SEAL_FIELD] = {"algorithm": "sha256", "digest": _content_digest(sealed)}
    return json.dumps(sealed, separators=(",", ":")).encode()


def pack_table(tensors: Any, tree: Any, aliases: Any) -> dict:
    """The ``packed`` field of a version-4 manifest: the tensor table as columns (one
    list per field, in key order; every checksum in one hex string, each tensor's
    pieces in turn), with the tree and aliases, as zlib-compressed JSON in base64.
    Raises TypeError/ValueError for a table that is not one (what parse_manifest reads)."""
    if not isinstance(tensors, dict) or not all(isinstance(t, dict) for t in tensors.values()):
        raise TypeError("manifest: tensors must be an object of objects")
    vals = list(tensors.values())
    sums = []
    for t in vals:
        c = t.get("checksums")
        if not isinstance(c, list) or not all(isinstance(x, str) and len(x) == 16 for x in c):
            raise ValueError("manifest: checksums must be lists of 16-digit hex strings")
        sums += c
    body = {"keys": list(tensors), **{f: [t.get(f) for t in vals] for f in _TABLE_FIELDS},
            "checksums": "".join(sums), "aliases": aliases, "tree": tree}
    js = json.dumps(body, separators=(",", ":")).encode()
    return {"encoding": PACKED_ENCODING, "count": len(vals), "bytes": len(js),
            "data": base64.b64encode(zlib.compress(js, 1)).decode("ascii")}  # 1: 3x faster than 6, 3% larger


def unpack_table(packed: Any) -> dict:
    """The body of a ``packed`` field (hostile input: sizes are checked before anything
    is allocated by them, and the decompressed length must be what it says)."""
    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest: packed table: {msg}", file=MANIFEST_NAME)

    if not isinstance(packed, dict) or packed.get("encoding") != PACKED_ENCODING:
        raise bad(f"encoding must be {PACKED_ENCODING!r}")
    n = packed.get("bytes")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_MANIFEST_BYTES:
        raise bad(f"bytes must be an integer in [0, {MAX_MANIFEST_BYTES}]")
    data = packed.get("data")
    if not isinstance(data, str):
        raise bad("data must be a base64 string")
    try:
        z = base64.b64decode(data, validate=True)
        d = zlib.decompressobj()
        js = d.decompress(z, n + 1)  # at most n + 1 bytes: a bomb stops here
    except (binascii.Error, ValueError, zlib.error) as e:
        raise bad(f"data does not decode ({e})"[:200]) from None
    if len(js) != n or not d.eof or d.unused_data:
        raise bad(f"data decodes to {len(js)}{'+' if not d.eof else ''} bytes, not the {n} it records")
    try:
        body = json.loads(js)
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON: {e}"[:200]) from None
    if not isinstance(body, dict):
        raise bad("not an object")
    count = packed.get("count")
    keys = body.get("keys")
    if not isinstance(keys, list) or count != len(keys) or isinstance(count, bool):
        raise bad("keys must be a list of count names")
    for f in _TABLE_FIELDS:
        col = body.get(f)
        if not isinstance(col, list) or len(col) != len(keys):
            raise bad(f"column {f} must be a list of {len(keys)} values")
    if not isinstance(body.get("checksums"), str):
        raise bad("checksums must be one hex string")
    return body


def decode_manifest_json(data: bytes) -> dict:
    """flashwrite.json as a plain dict with tensors, tree and aliases unpacked (the form
    ``assemble`` makes; the seal, if any, is kept as it was). For tools and tests."""
    raw = json.loads(data)
    if isinstance(raw, dict) and PACKED_FIELD in raw:
        body = unpack_table(raw.pop(PACKED_FIELD))
        sums, pos, tensors = body["checksums"], 0, {}
        block = raw["checksum"]["block_bytes"]
        for i, k in enumerate(body["keys"]):
            t = {f: body[f][i] for f in _TABLE_FIELDS}
            n = _pieces(t["offset"], t["nbytes"], block)
            t["checksums"] = [sums[pos + 16 * j: pos + 16 * j + 16] for j in range(n)]
            pos += 16 * n
            tensors[k] = t
        raw["tensors"], raw["tree"], raw["aliases"] = tensors, body["tree"], body["aliases"]
    return raw


def _pieces(offset: int, nbytes: int, block: int) -> int:
    """How many checksummed pieces a tensor has (counted, not listed: a hostile nbytes
    must not make anyone build a list of 2**50 pieces)."""
    return (offset + nbytes - 1) // block - offset // block + 1 if nbytes else 0


def check_manifest_seal(raw: Any) -> None:
    """A manifest of version >= SEALED_SINCE must carry the checksum of its content, and
    it must match; manifests of earlier versions have none (their writers made none)."""
    if not isinstance(raw, dict) or raw.get("format") != "flashwrite":
        return  # parse_manifest says what is wrong
    version = raw.get("format_version")
    seal = raw.get(SEAL_FIELD)
    if not isinstance(version, int) or isinstance(version, bool) or version < SEALED_SINCE:
        if seal is not None:
            raise CorruptCheckpointError(f"manifest: format version {str(version)[:20]!r} carries no "
                                         f"{SEAL_FIELD}, but this one has one (edited version?)", file=MANIFEST_NAME)
        return
    if not isinstance(seal, dict) or seal.get("algorithm") != "sha256" or not isinstance(seal.get("digest"), str):
        raise CorruptCheckpointError(f"manifest: format version {version} must carry {SEAL_FIELD} "
                                     "{'algorithm': 'sha256', 'digest': ...}; it is missing or malformed",
                                     file=MANIFEST_NAME)
    actual = _content_digest(raw)
    if seal["digest"] != actual:
        raise CorruptCheckpointError(f"manifest: content does not match its checksum (expected sha256 "
                                     f"{seal['digest'][:64]!r}, content hashes to {actual!r}): the manifest was "
                                     "altered after it was written", file=MANIFEST_NAME)


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CorruptCheckpointError(f"manifest: {what} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}",
                                     file=MANIFEST_NAME)
    return v


def check_member_name(name: Any) -> str:
    """A file name inside the checkpoint: no separators, no '..', not absolute."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", "..") or name == MANIFEST_NAME:
        raise UnsafeCheckpointError(f"manifest names file {str(name)[:80]!r}, which is not a plain file name "
                                    "inside the checkpoint directory", file=MANIFEST_NAME)
    return name


def read_manifest(path: str | os.PathLike, *, shown: str | None = None) -> Manifest:
    """Read and check ``path``/flashwrite.json; messages name ``shown`` (default: path)."""
    fpath = os.path.join(local_path(path, "read manifest"), MANIFEST_NAME)
    mpath = os.path.join(shown, MANIFEST_NAME) if shown is not None else fpath
    if not os.path.isdir(path):
        raise FileNotFoundError(2, "checkpoint directory not found", os.fspath(shown or path))
    try:
        # O_NONBLOCK: a FIFO planted as the manifest must not hang the open.
        fd = os.open(fpath, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{mpath} is missing: the checkpoint is incomplete or not a flashwrite "
                                     "checkpoint", file=MANIFEST_NAME) from None
    with open(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{mpath} is not a regular file", file=MANIFEST_NAME)
        if st.st_size > MAX_MANIFEST_BYTES:  # checked before reading: no allocation sized by a hostile file
            raise CorruptCheckpointError(f"{mpath} is larger than {MAX_MANIFEST_BYTES} bytes", file=MANIFEST_NAME)
        data = fh.read(st.st_size + 1)  # read(n) allocates n up front: ask for what is there
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{mpath} is larger than {MAX_MANIFEST_BYTES} bytes", file=MANIFEST_NAME)
    return parse_manifest(data, sealed=True)


def parse_manifest(data: bytes, *, sealed: bool = False) -> Manifest:
    """Parse and check a manifest. sealed=True (what every load does) also checks its
    checksum; the writers' own pre-commit check parses the dict before it is sealed."""
    with gcpause.paused():  # a manifest of 100,000 tensors: see gcpause
        return _parse_manifest(data, sealed)


def _parse_manifest(data: bytes, sealed: bool) -> Manifest:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON: {e}"[:300], file=MANIFEST_NAME) from None
    if sealed:
        check_manifest_seal(raw)
    bad = lambda msg: CorruptCheckpointError(f"manifest: {msg}", file=MANIFEST_NAME)  # noqa: E731
    if not isinstance(raw, dict) or raw.get("format") != "flashwrite":
        raise bad("not a flashwrite manifest")
    version = raw.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise bad(f"format version {str(version)[:20]!r} is not supported (this flashwrite reads "
                  f"{', '.join(map(str, READABLE_VERSIONS))}; a newer flashwrite wrote it?)")
    ck = raw.get("checksum")
    if not isinstance(ck, dict) or ck.get("algorithm") != CHECKSUM_ALGORITHM:
        raise bad(f"checksum algorithm must be {CHECKSUM_ALGORITHM}")
    block = _int(ck.get("block_bytes"), "checksum.block_bytes", 4096, 1 << 30)
    if block % 4096:
        raise bad("checksum.block_bytes must be a multiple of 4096")

    rfiles = raw.get("files")
    if not isinstance(rfiles, list) or len(rfiles) > 1_000_000:
        raise bad("files must be a list")
    files: list[FileEntry] = []
    seen_names = set()
    for f in rfiles:
        if not isinstance(f, dict):
            raise bad("file entry is not an object")
        name = check_member_name(f.get("name"))
        if name in seen_names:
            raise bad(f"file {name} listed twice")
        seen_names.add(name)
        size = _int(f.get("size"), f"{name}.size", 8)
        hb = _int(f.get("header_bytes"), f"{name}.header_bytes", 8, min(size, MAX_HEADER_BYTES + 8))
        files.append(FileEntry(name, size, hb))

    if PACKED_FIELD in raw:
        if version < PACKED_SINCE:
            raise bad(f"format version {version} has no packed table")
        body = unpack_table(raw[PACKED_FIELD])
        keys, cols, sums = body["keys"], body, body["checksums"]
        tree, aliases = body.get("tree"), body.get("aliases", {})
    else:
        rt = raw.get("tensors")
        if not isinstance(rt, dict):
            raise bad("tensors must be an object")
        for key, t in rt.items():
            if not isinstance(t, dict):
                raise bad(f"tensor {key[:80]!r} is not an object")
        keys = list(rt)
        vals = list(rt.values())
        cols = {f: [t.get(f) for t in vals] for f in _TABLE_FIELDS}
        sums = [t.get("checksums") for t in vals]
        tree, aliases = raw.get("tree"), raw.get("aliases", {})
    tensors = _check_table(keys, cols, sums, files, block)

    if not isinstance(aliases, dict) or not all(isinstance(v, str) and v in tensors for v in aliases.values()):
        raise bad("aliases must map names to stored tensors")
    meta = raw.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad("metadata must be an object")
    wv = raw.get("writer_version", "")
    return Manifest(files, tensors, aliases, tree, block, wv if isinstance(wv, str) else "", meta, raw)


_INT_LIMIT = 1 << 62
_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _first(col: list, ok: Any) -> int:
    """Index of the first value of col for which ok(value) is false."""
    return next(i for i, v in enumerate(col) if not ok(v))


def _is_uint(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _INT_LIMIT


def _check_table(keys: list, cols: dict, sums: Any, files: list[FileEntry], block: int) -> dict[str, TensorEntry]:
    """Check the tensor table, column by column (one pass per check in C where it can
    be: a table of 100,000 tensors costs milliseconds), and return its entries. The
    first failing tensor is named, with the message a check of it alone would give.
    sums: every tensor's checksum list (plain manifests), or one hex string holding
    each tensor's pieces in turn (packed ones)."""
    bad = lambda msg: CorruptCheckpointError(f"manifest: {msg}", file=MANIFEST_NAME)  # noqa: E731
    n = len(keys)
    if not all(type(k) is str for k in keys):
        raise bad(f"tensor name {str(keys[_first(keys, lambda k: type(k) is str)])[:80]!r} is not a string")
    if len(set(keys)) != n:
        raise bad("a tensor is listed twice")
    if n and not files:
        raise bad("tensors listed but no files")
    fcol, ocol, ncol = cols["file"], cols["offset"], cols["nbytes"]
    if not all(type(v) is int and 0 <= v < len(files) for v in fcol):
        i = _first(fcol, lambda v: type(v) is int and 0 <= v < len(files))
        _int(fcol[i], f"{keys[i]}.file", 0, max(0, len(files) - 1))
    for col, what in ((ncol, "nbytes"), (ocol, "offset")):
        if not all(type(v) is int and 0 <= v <= _INT_LIMIT for v in col):
            i = _first(col, _is_uint)
            _int(col[i], f"{keys[i]}.{what}")
    fi = np.fromiter(fcol, np.int64, n)
    off = np.fromiter(ocol, np.int64, n)
    nb = np.fromiter(ncol, np.int64, n)
    size = np.array([f.size for f in files], np.int64)
    hb = np.array([f.header_bytes for f in files], np.int64)
    below = off < hb[fi]
    if below.any():
        i = int(np.argmax(below))
        _int(ocol[i], f"{keys[i]}.offset", files[fcol[i]].header_bytes)
    past = off + nb > size[fi]  # both <= 2**62: no overflow
    if past.any():
        i = int(np.argmax(past))
        fe = files[fcol[i]]
        raise CorruptCheckpointError(f"tensor {keys[i]!r} ends at {ocol[i] + ncol[i]}, past the end of {fe.name} "
                                     f"({fe.size} bytes)", file=fe.name, tensor=keys[i])

    dcol = cols["dtype"]
    if not all(type(v) is str for v in dcol):
        i = _first(dcol, lambda v: type(v) is str)
        raise bad(f"tensor {keys[i]!r}: dtype {str(dcol[i])[:40]!r} is not a dtype name")
    itemsizes: dict[str, int] = {}
    for name in set(dcol):
        try:
            itemsizes[name] = dtypes.itemsize(dtypes.dtype_from_name(name))
        except ValueError as e:
            i = dcol.index(name)
            raise bad(f"tensor {keys[i]!r}: {e}") from None
    scol = cols["shape"]
    if not all(type(s) is list and len(s) <= 64 for s in scol):
        i = _first(scol, lambda s: type(s) is list and len(s) <= 64)
        raise bad(f"tensor {keys[i]!r}: shape must be a list of at most 64 dims")
    if not all(type(d) is int and 0 <= d <= _INT_LIMIT for s in scol for d in s):
        i = _first(scol, lambda s: all(_is_uint(d) for d in s))
        for d in scol[i]:
            _int(d, f"{keys[i]}.shape")
    isz = [itemsizes[v] for v in dcol]
    need = [math.prod(s) * z for s, z in zip(scol, isz)]
    if need != ncol:
        i = next(i for i, (a, b) in enumerate(zip(need, ncol)) if a != b)
        raise CorruptCheckpointError(f"tensor {keys[i]!r}: dtype {dcol[i]} and shape {scol[i]} need "
                                     f"{need[i]} bytes, the manifest says {ncol[i]}",
                                     file=files[fcol[i]].name, tensor=keys[i])
    iz = np.fromiter(isz, np.int64, n)
    unaligned = (nb > 0) & (off % iz != 0)  # the writer aligns every tensor; views need it
    if unaligned.any():
        i = int(np.argmax(unaligned))
        fe = files[fcol[i]]
        raise CorruptCheckpointError(f"tensor {keys[i]!r} at offset {ocol[i]} of {fe.name} is not aligned to its "
                                     f"{isz[i]}-byte elements", file=fe.name, tensor=keys[i])
    vcol = [("cpu" if v is None else v) for v in cols["device"]]
    if not all(type(v) is str and len(v) <= 64 for v in vcol):
        i = _first(vcol, lambda v: type(v) is str and len(v) <= 64)
        raise bad(f"tensor {keys[i]!r}: bad device")

    pieces = np.where(nb > 0, (off + nb - 1) // block - off // block + 1, 0)
    if isinstance(sums, str):
        if len(sums) != 16 * int(pieces.sum()) or not _HEX_DIGITS.fullmatch(sums):
            raise bad(f"packed checksums must be {int(pieces.sum())} 16-digit hex strings, one per piece")
        ends = (np.cumsum(pieces) * 16).tolist()
        starts = [0] + ends[:-1]
        sum_col = [tuple(sums[a + 16 * j: a + 16 * j + 16] for j in range((b - a) // 16)) if b - a != 16
                   else (sums[a:b],) for a, b in zip(starts, ends)]
    else:
        plist = pieces.tolist()
        for i, c in enumerate(sums):
            if not isinstance(c, list) or not all(isinstance(h, str) and _HEX_RE.match(h) for h in c):
                raise bad(f"tensor {keys[i]!r}: checksums must be 16-digit hex strings")
            if len(c) != plist[i]:
                raise bad(f"tensor {keys[i]!r}: {len(c)} checksums for {plist[i]} pieces")
        sum_col = [tuple(c) for c in sums]

    # Overlaps, per file: sorted by (file, offset), each non-empty tensor ends before the next starts.
    live = np.flatnonzero(nb > 0)
    order = live[np.lexsort((off[live], fi[live]))]
    same = fi[order[1:]] == fi[order[:-1]]
    clash = same & (off[order[:-1]] + nb[order[:-1]] > off[order[1:]])
    if clash.any():
        j = int(np.argmax(clash))
        a, b = int(order[j]), int(order[j + 1])
        raise CorruptCheckpointError(f"tensors {keys[a]!r} and {keys[b]!r} overlap in {files[fcol[b]].name}",
                                     file=files[fcol[b]].name, tensor=keys[b])
    # Stripes are packed: with no overlaps, equal sums mean every data byte belongs to a
    # tensor, so no unchecked bytes exist and no file is larger (to read) than its tensors.
    covered = np.zeros(len(files), np.int64)
    np.add.at(covered, fi, nb)
    for i, fe in enumerate(files):
        if int(covered[i]) != fe.size - fe.header_bytes:
            raise CorruptCheckpointError(f"{fe.name}: its tensors cover {int(covered[i])} of "
                                         f"{fe.size - fe.header_bytes} data bytes (stripes hold nothing but tensors)",
                                         file=fe.name)
    shapes = [tuple(s) for s in scol]
    return dict(zip(keys, map(TensorEntry, keys, fcol, ocol, ncol, dcol, shapes, vcol, sum_col)))




def combine(parts: list[dict]) -> tuple[list[dict], dict[str, dict], dict[str, str], list[list[int]]]:
    """The files, tensors and aliases of several writes into one directory (each part a
    manifest, as ``build_manifest`` makes them; part r is rank r's), file indices
    rebased, and each part's ``[first file, count]``."""
    files: list[dict] = []
    tensors: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    spans = []
    for r, m in enumerate(parts):
        for field in ("format_version", "writer_version", "checksum"):
            if m[field] != parts[0][field]:
                raise FlashwriteError(f"rank {r} wrote with {field} {m[field]!r}, rank 0 with {parts[0][field]!r}: "
                                      "every rank must use the same flashwrite version and chunk_bytes")
        base = len(files)
        spans.append([base, len(m["files"])])
        files.extend(m["files"])
        for k, t in m["tensors"].items():
            if k in tensors:
                raise FlashwriteError(f"tensor {k!r} written by two ranks")
            tensors[k] = dict(t, file=t["file"] + base)
        aliases.update(m["aliases"])
    return files, tensors, aliases, spans


def merge_manifests(manifests: list[dict]) -> dict:
    """One global manifest from the per-rank manifests (each with tree ``{rank: state}``)."""
    items: list = []
    for r, m in enumerate(manifests):
        tree = m["tree"]
        if tree.get("t") != "dict" or len(tree["items"]) != 1 or tree["items"][0][0] != {"t": "int", "v": r}:
            raise FlashwriteError(f"rank {r}'s manifest is not a rank-{r} state (saves issued in different orders?)")
        items.extend(tree["items"])
    files, tensors, aliases, spans = combine(manifests)
    first = manifests[0]
    merged = assemble(files, tensors, aliases, {"t": "dict", "items": items}, first["checksum"]["block_bytes"],
                      first["writer_version"], first["metadata"], ranks={"world_size": len(manifests), "files": spans})
    merged["created_unix"] = first["created_unix"]
    return merged


def rank_section(raw: dict) -> dict | None:
    """The validated ``ranks`` section of a manifest, or None for a single-process checkpoint."""
    ranks = raw.get("ranks")
    if ranks is None:
        return None
    bad = lambda msg: CorruptCheckpointError(f"manifest: ranks: {msg}", file=MANIFEST_NAME)  # noqa: E731
    if not isinstance(ranks, dict):
        raise bad("not an object")
    n = ranks.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1 << 20:
        raise bad("world_size must be a positive integer")
    return ranks


def _rank_subtree(tree: Any, rank: int) -> Any:
    if not isinstance(tree, dict) or tree.get("t") != "dict" or not isinstance(tree.get("items"), list):
        raise CorruptCheckpointError("manifest: a multi-rank tree must be a dict of ranks", file=MANIFEST_NAME)
    for it in tree["items"]:
        if isinstance(it, list) and len(it) == 2 and it[0] == {"t": "int", "v": rank}:
            return it[1]
    raise CorruptCheckpointError(f"manifest: no state for rank {rank}", file=MANIFEST_NAME)


def select_rank(m: Manifest, rank: int, size: int, *, shown: str) -> tuple[Manifest, set[str] | None]:
    """The part of ``m`` that rank ``rank`` of a group of ``size`` loads: for a multi-rank
    checkpoint its own state (the manifest with that subtree as its tree) and the keys of
    its tensors; a single-process checkpoint whole (keys None: every tensor)."""
    ranks = rank_section(m.raw)
    if ranks is None:
        return m, None
    if ranks["world_size"] != size:
        raise ValueError(f"{shown} was saved by {ranks['world_size']} ranks and this group has {size}: "
                         "load it in one process with flashwrite.load(path), which returns {rank: state}, or save "
                         "through flashwrite.dcp to reshard on load")
    subtree = _rank_subtree(m.tree, rank)
    keys = referenced_keys(subtree)
    unknown = keys - set(m.tensors)
    if unknown:
        raise CorruptCheckpointError(f"manifest tree refers to unknown tensor {sorted(unknown)[0]!r}",
                                     file=MANIFEST_NAME)
    return dataclasses.replace(m, tree=subtree), keys


def _no_float(text: str) -> float:
    raise ValueError(f"a number with a fraction or exponent ({text[:20]}) in a safetensors header")


def check_stripe_header(buf: memoryview, fe: FileEntry, entries: list[TensorEntry]) -> None:
    """The stripe's own safetensors header must describe exactly what the manifest says."""
    def bad(msg: str, tensor: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{fe.name}: {msg}", file=fe.name, tensor=tensor)

    if len(buf) < 8:
        raise bad("too short for a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8])
    if n + 8 != fe.header_bytes:
        raise bad(f"header length {n} does not match the manifest ({fe.header_bytes - 8})")
    try:
        text = bytes(buf[8:8 + n])
        header = json.loads(text, parse_float=_no_float)
    except (ValueError, RecursionError):
        raise bad("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("safetensors header is not an object")
    header.pop("__metadata__", None)
    # The whole header at once (C-speed dict comparison); the check below, one tensor
    # at a time, runs only to name what differs (or when JSON booleans could pass as 0/1).
    codes: dict[str, str | None] = {}
    for e in entries:
        if e.dtype not in codes:
            codes[e.dtype] = dtypes.safetensors_code(dtypes.dtype_from_name(e.dtype))
    expected = {}
    for e in entries:
        code, rel = codes[e.dtype], e.offset - fe.header_bytes
        expected[e.key] = {"dtype": code or "U8", "shape": list(e.shape) if code else [e.nbytes],
                           "data_offsets": [rel, rel + e.nbytes]}
    if header == expected and b"true" not in text and b"false" not in text:
        return
    want = {e.key for e in entries}
    if set(header) != want:
        extra = sorted(set(header) - want)[:3]
        missing = sorted(want - set(header))[:3]
        raise bad(f"header tensors differ from the manifest (extra {extra}, missing {missing})")
    for e in entries:
        h = header[e.key]
        if not isinstance(h, dict):
            raise bad(f"header entry for {e.key!r} is not an object", e.key)
        # What the writer put in the header for this manifest entry (plan.py): dtypes
        # safetensors cannot name are stored as U8 bytes, 1-D.
        dt = dtypes.dtype_from_name(e.dtype)
        code = dtypes.safetensors_code(dt)
        rel = e.offset - fe.header_bytes
        want_fields = {"dtype": code or "U8", "shape": list(e.shape) if code else [e.nbytes],
                       "data_offsets": [rel, rel + e.nbytes]}
        names = {"dtype": "dtype", "shape": "shape", "data_offsets": "byte range"}
        for field, want_v in want_fields.items():
            got = h.get(field)
            if got != want_v or type(got) is not type(want_v) or \
                    (isinstance(got, list) and any(type(x) is not int for x in got)):
                shown = f"{e.dtype} {list(e.shape)} at {rel}..{rel + e.nbytes}"
                raise bad(f"tensor {e.key!r}: {names[field]} disagrees between the manifest ({shown}: header should "
                          f"say {field}={want_v}) and the stripe header ({field}={str(got)[:80]})", e.key)
