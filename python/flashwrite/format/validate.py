"""Reading ``flashwrite.json`` as hostile input: names cannot leave the checkpoint
directory, sizes and offsets are bounds-checked before anything is allocated by them,
the seal must match, and the tensor table is checked by ``table``. Manifests of every
version in ``READABLE_VERSIONS`` load."""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from ..system import gcpause
from .._core import CHECKSUM_ALGORITHM
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .encoding import content_digest, unpack_table
from .hints import no_manifest, not_a_checkpoint
from .safetensors_header import MAX_HEADER_BYTES
from .manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    PACKED_FIELD,
    PACKED_SINCE,
    READABLE_VERSIONS,
    SEAL_FIELD,
    SEALED_SINCE,
    TABLE_FIELDS,
    FileEntry,
    Manifest,
)
from .codec import check_codec
from .table import check_table, checked_int

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # used with fullmatch: no trailing newline
MAX_FILES = 1_000_000


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}", file=MANIFEST_NAME)


def check_member_name(name: Any) -> str:
    """A file name inside the checkpoint: no separators, no '..', not absolute."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", "..") or name == MANIFEST_NAME:
        raise UnsafeCheckpointError(f"manifest names file {str(name)[:80]!r}, which is not a plain file name "
                                    "inside the checkpoint directory", file=MANIFEST_NAME)
    return name


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
    actual = content_digest(raw)
    if seal["digest"] != actual:
        raise CorruptCheckpointError(f"manifest: content does not match its checksum (expected sha256 "
                                     f"{seal['digest'][:64]!r}, content hashes to {actual!r}): the manifest was "
                                     "altered after it was written", file=MANIFEST_NAME)


def read_manifest(path: str | os.PathLike, *, shown: str | None = None) -> Manifest:
    """Read and check ``path``/flashwrite.json; messages name ``shown`` (default: path)."""
    fpath = os.path.join(os.fspath(path), MANIFEST_NAME)  # a local directory: a target reads its own
    mpath = os.path.join(shown, MANIFEST_NAME) if shown is not None else fpath
    if not os.path.isdir(path):
        raise not_a_checkpoint(os.fspath(path), shown)
    try:
        # O_NONBLOCK: a FIFO planted as the manifest must not hang the open.
        fd = os.open(fpath, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        root = no_manifest(os.fspath(path), os.fspath(shown if shown is not None else path))
        if root is not None:
            raise root from None
        raise CorruptCheckpointError(f"{mpath} is missing: the checkpoint is incomplete or not a flashwrite "
                                     "checkpoint (`flashwrite ls DIR` lists the checkpoints in a directory)",
                                     file=MANIFEST_NAME) from None
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
    version, block = _check_heading(raw)
    files = _check_files(raw.get("files"), version, block)
    keys, cols, sums, tree, aliases = _table_columns(raw, version)
    tensors = check_table(keys, cols, sums, files, block)
    if not isinstance(aliases, dict) or not all(isinstance(v, str) and v in tensors for v in aliases.values()):
        raise _bad("aliases must map names to stored tensors")
    meta = raw.get("metadata", {})
    if not isinstance(meta, dict):
        raise _bad("metadata must be an object")
    wv = raw.get("writer_version", "")
    return Manifest(files, tensors, aliases, tree, block, wv if isinstance(wv, str) else "", meta, raw)


def _check_heading(raw: Any) -> tuple[int, int]:
    """(format version, checksum block size) of a flashwrite manifest this version reads."""
    if not isinstance(raw, dict) or raw.get("format") != "flashwrite":
        raise _bad("not a flashwrite manifest")
    version = raw.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise _bad(f"format version {str(version)[:20]!r} is not supported (this flashwrite reads "
                   f"{', '.join(map(str, READABLE_VERSIONS))}; a newer flashwrite wrote it?)")
    ck = raw.get("checksum")
    if not isinstance(ck, dict) or ck.get("algorithm") != CHECKSUM_ALGORITHM:
        raise _bad(f"checksum algorithm must be {CHECKSUM_ALGORITHM}")
    block = checked_int(ck.get("block_bytes"), "checksum.block_bytes", 4096, 1 << 30)
    if block % 4096:
        raise _bad("checksum.block_bytes must be a multiple of 4096")
    return version, block


def _check_files(rfiles: Any, version: int, block: int) -> list[FileEntry]:
    """The stripe list: plain, unique names; sizes and header lengths in range."""
    if not isinstance(rfiles, list) or len(rfiles) > MAX_FILES:
        raise _bad("files must be a list")
    files: list[FileEntry] = []
    seen_names = set()
    for f in rfiles:
        if not isinstance(f, dict):
            raise _bad("file entry is not an object")
        name = check_member_name(f.get("name"))
        if name in seen_names:
            raise _bad(f"file {name} listed twice")
        seen_names.add(name)
        size = checked_int(f.get("size"), f"{name}.size", 8)
        hb = checked_int(f.get("header_bytes"), f"{name}.header_bytes", 8, min(size, MAX_HEADER_BYTES + 8))
        frames: tuple[int, ...] = ()
        if "codec" in f:
            frames = check_codec(f["codec"], name, size, version, block)[1]
        files.append(FileEntry(name, size, hb, frames))
    return files


def _table_columns(raw: dict, version: int) -> tuple[list, dict, Any, Any, Any]:
    """(keys, columns, checksums, tree, aliases), from the packed field or the plain table."""
    if PACKED_FIELD in raw:
        if version < PACKED_SINCE:
            raise _bad(f"format version {version} has no packed table")
        body = unpack_table(raw[PACKED_FIELD])
        return body["keys"], body, body["checksums"], body.get("tree"), body.get("aliases", {})
    rt = raw.get("tensors")
    if not isinstance(rt, dict):
        raise _bad("tensors must be an object")
    for key, t in rt.items():
        if not isinstance(t, dict):
            raise _bad(f"tensor {key[:80]!r} is not an object")
    vals = list(rt.values())
    cols = {f: [t.get(f) for t in vals] for f in TABLE_FIELDS}
    return list(rt), cols, [t.get("checksums") for t in vals], raw.get("tree"), raw.get("aliases", {})
