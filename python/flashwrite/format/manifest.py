"""What a manifest holds, and building one: the format's constants, the parsed entry
types, and the dicts every writer turns into ``flashwrite.json`` (see ``encoding`` for
the bytes)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import dtypes
from .._core import CHECKSUM_ALGORITHM

# 2: the tree may hold view, ndarray and npscalar nodes and tensor flags (param, rg).
# 3: the manifest carries manifest_checksum, a SHA-256 of its own content.
# 4: tensors, tree and aliases are stored packed (columns, zlib, base64) in "packed".
# Every version ever written stays readable (fixtures under tests/data/).
FORMAT_VERSION = 4
# 5: a file entry may carry "codec" (a compressed stripe, format/codec.py); only
#    checkpoints with one are written as 5, the others stay 4.
READABLE_VERSIONS = (1, 2, 3, 4, 5)
SEALED_SINCE = 3  # manifests of this version and later must carry manifest_checksum
PACKED_SINCE = 4  # manifests of this version and later may carry their table packed
SEAL_FIELD = "manifest_checksum"
PACKED_FIELD = "packed"
PACKED_ENCODING = "zlib+json/columns"
TABLE_FIELDS = ("file", "offset", "nbytes", "dtype", "shape", "device")  # a tensor's fields besides checksums
MANIFEST_NAME = "flashwrite.json"
INDEX_NAME = "model.safetensors.index.json"
MAX_MANIFEST_BYTES = 1 << 30


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    header_bytes: int
    frames: tuple[int, ...] = ()  # compressed: each chunk's frame length, 0 stored plain (format/codec.py)


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


def piece_count(offset: int, nbytes: int, block: int) -> int:
    """How many checksummed pieces a tensor has (counted, not listed: a hostile nbytes
    must not make anyone build a list of 2**50 pieces)."""
    return (offset + nbytes - 1) // block - offset // block + 1 if nbytes else 0


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


def build_manifest(files: list[Any], checksums: dict[str, list[int]], aliases: dict[str, str], tree: Any,
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


def build_index(m: dict) -> dict | None:
    """Hugging Face's model.safetensors.index.json: every tensor, or with an ``hf``
    section (``hf_model=``) only the model's, so from_pretrained sees just the model;
    None for a compressed checkpoint."""
    if any(f.get("codec") for f in m["files"]):
        return None  # compressed stripes are no safetensors: no index for Hugging Face to follow
    names = [f["name"] for f in m["files"]]
    listed = set(m["hf"]["files"]) if m.get("hf") else set(names)
    mine = {k: t for k, t in m["tensors"].items() if names[t["file"]] in listed}
    return {
        "metadata": {"total_size": sum(t["nbytes"] for t in mine.values())},
        "weight_map": {k: names[t["file"]] for k, t in mine.items()},
    }
