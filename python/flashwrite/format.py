"""On-disk format, version 3: the manifest (``flashwrite.json``), the Hugging Face
style index, and the checks that make a checkpoint safe to open.

Version 3 adds one fact to version 2: the manifest carries a SHA-256 of its own
content (``manifest_checksum``), so an edited manifest cannot load as a different
state. Manifests of versions 1 and 2 (no checksum) still load; for every version,
each tensor's dtype, shape and byte range is cross-checked against its stripe's own
safetensors header.

Everything read from disk is treated as hostile: names cannot leave the
checkpoint directory, sizes and offsets are bounds-checked before anything is
allocated, tensors cannot overlap, and dtype/shape must agree with byte lengths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from . import dtypes
from ._core import CHECKSUM_ALGORITHM
from .errors import CorruptCheckpointError, FlashwriteError, UnsafeCheckpointError
from .flatten import referenced_keys
from .plan import MAX_HEADER_BYTES, PlannedFile

# 2: the tree may hold view, ndarray and npscalar nodes and tensor flags (param, rg).
# 3: the manifest carries manifest_checksum, a SHA-256 of its own content.
# Every version ever written stays readable (fixtures under tests/data/).
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
SEALED_SINCE = 3  # manifests of this version and later must carry manifest_checksum
SEAL_FIELD = "manifest_checksum"
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


@dataclass(frozen=True)
class TensorEntry:
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
    for i, f in enumerate(files):
        for p in f.tensors:
            tensors[p.key] = {
                "file": i, "offset": p.offset, "nbytes": p.nbytes, "dtype": dtypes.dtype_name(p.dtype),
                "shape": p.shape, "device": p.device,
                "checksums": [f"{h:016x}" for h in checksums[p.key]],
            }
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
    """The bytes of flashwrite.json for manifest ``m``: sealed with its checksum."""
    sealed = {k: v for k, v in m.items() if k != SEAL_FIELD}
    sealed[SEAL_FIELD] = {"algorithm": "sha256", "digest": _content_digest(sealed)}
    return json.dumps(sealed, separators=(",", ":")).encode()


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
    fpath = os.path.join(os.fspath(path), MANIFEST_NAME)
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

    rt = raw.get("tensors")
    if not isinstance(rt, dict):
        raise bad("tensors must be an object")
    tensors: dict[str, TensorEntry] = {}
    per_file: dict[int, list[tuple[int, int, str]]] = {}
    for key, t in rt.items():
        if not isinstance(t, dict):
            raise bad(f"tensor {key[:80]!r} is not an object")
        fi = _int(t.get("file"), f"{key}.file", 0, max(0, len(files) - 1))
        if not files:
            raise bad("tensors listed but no files")
        fe = files[fi]
        nbytes = _int(t.get("nbytes"), f"{key}.nbytes")
        offset = _int(t.get("offset"), f"{key}.offset", fe.header_bytes)
        if offset + nbytes > fe.size:
            raise CorruptCheckpointError(f"tensor {key!r} ends at {offset + nbytes}, past the end of {fe.name} "
                                         f"({fe.size} bytes)", file=fe.name, tensor=key)
        try:
            dt = dtypes.dtype_from_name(t.get("dtype"))
        except ValueError as e:
            raise bad(f"tensor {key!r}: {e}") from None
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > 64:
            raise bad(f"tensor {key!r}: shape must be a list of at most 64 dims")
        shape = tuple(_int(s, f"{key}.shape") for s in shape)
        if math.prod(shape) * dtypes.itemsize(dt) != nbytes:
            raise CorruptCheckpointError(f"tensor {key!r}: dtype {t.get('dtype')} and shape {list(shape)} need "
                                         f"{math.prod(shape) * dtypes.itemsize(dt)} bytes, the manifest says {nbytes}",
                                         file=fe.name, tensor=key)
        if nbytes and offset % dtypes.itemsize(dt):  # the writer aligns every tensor; views need it
            raise CorruptCheckpointError(f"tensor {key!r} at offset {offset} of {fe.name} is not aligned to its "
                                         f"{dtypes.itemsize(dt)}-byte elements", file=fe.name, tensor=key)
        device = t.get("device", "cpu")
        if not isinstance(device, str) or len(device) > 64:
            raise bad(f"tensor {key!r}: bad device")
        sums = t.get("checksums")
        if not isinstance(sums, list) or not all(isinstance(s, str) and _HEX_RE.match(s) for s in sums):
            raise bad(f"tensor {key!r}: checksums must be 16-digit hex strings")
        # Counted, not listed: a hostile nbytes must not make us build a list of 2**50 pieces.
        pieces = (offset + nbytes - 1) // block - offset // block + 1 if nbytes else 0
        if len(sums) != pieces:
            raise bad(f"tensor {key!r}: {len(sums)} checksums for {pieces} pieces")
        tensors[key] = TensorEntry(key, fi, offset, nbytes, t["dtype"], shape, device, tuple(sums))
        if nbytes:
            per_file.setdefault(fi, []).append((offset, nbytes, key))
    for fi, spans in per_file.items():
        spans.sort()
        for (o1, n1, k1), (o2, _, k2) in zip(spans, spans[1:]):
            if o1 + n1 > o2:
                raise CorruptCheckpointError(f"tensors {k1!r} and {k2!r} overlap in {files[fi].name}",
                                             file=files[fi].name, tensor=k2)
    # Stripes are packed: with no overlaps, equal sums mean every data byte belongs to a
    # tensor, so no unchecked bytes exist and no file is larger (to read) than its tensors.
    for fi, fe in enumerate(files):
        covered = sum(n for _, n, _ in per_file.get(fi, ()))
        if covered != fe.size - fe.header_bytes:
            raise CorruptCheckpointError(f"{fe.name}: its tensors cover {covered} of {fe.size - fe.header_bytes} "
                                         "data bytes (stripes hold nothing but tensors)", file=fe.name)

    aliases = raw.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) and v in tensors for v in aliases.values()):
        raise bad("aliases must map names to stored tensors")
    meta = raw.get("metadata", {})
    if not isinstance(meta, dict):
        raise bad("metadata must be an object")
    wv = raw.get("writer_version", "")
    return Manifest(files, tensors, aliases, raw.get("tree"), block, wv if isinstance(wv, str) else "", meta, raw)


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
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, RecursionError):
        raise bad("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("safetensors header is not an object")
    header.pop("__metadata__", None)
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
