"""The codec table of a compressed checkpoint (issue 38), read as hostile input.

A compressed stripe keeps its plain layout (every tensor at the offset the manifest
names, the checksums over the uncompressed bytes), but each chunk of ``chunk_bytes``
may hold, from its first byte, a frame of the native codec (byte planes + zstd,
``csrc/core/codec.hpp``) padded to 4 KiB, the rest of its span a hole. The manifest's
file entry says which: ``"codec": {"name": "zstd-planes", "chunk_bytes": N, "frames":
[n0, n1, ...]}``, one frame length per chunk, 0 for a chunk stored as it is. Such a
stripe is not plain safetensors: its name ends in ``.fwz``, and ``flashwrite convert``
writes plain files from it. Manifests carrying a codec are format version 5."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError
from .manifest import MANIFEST_NAME

CODEC_NAME = "zstd-planes"
COMPRESSED_SINCE = 5
STRIPE_SUFFIX = ".fwz"
FRAME_HEADER_BYTES = 80  # codec::kHeaderBytes
LABEL = "compressed (zstd, byte planes) — not plain safetensors"


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: {msg}", file=MANIFEST_NAME)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_codec(raw: Any, name: str, size: int, version: int, block: int) -> tuple[int, tuple[int, ...]]:
    """(chunk_bytes, frames) of a file entry's ``codec``, every number bounds-checked
    against the file before anyone reads by it."""
    if version < COMPRESSED_SINCE:
        raise _bad(f"{name}: format version {version} has no codec (compressed checkpoints are version "
                   f"{COMPRESSED_SINCE})")
    if not isinstance(raw, dict) or set(raw) != {"name", "chunk_bytes", "frames"}:
        raise _bad(f"{name}.codec must be {{'name', 'chunk_bytes', 'frames'}}")
    if raw["name"] != CODEC_NAME:
        raise _bad(f"{name}.codec: unknown codec {str(raw['name'])[:40]!r} (this flashwrite knows {CODEC_NAME!r}; "
                   "a newer flashwrite wrote it?)")
    chunk = raw["chunk_bytes"]
    if not _int(chunk) or chunk != block:
        raise _bad(f"{name}.codec.chunk_bytes must equal checksum.block_bytes ({block})")
    frames = raw["frames"]
    count = (size + chunk - 1) // chunk
    if not isinstance(frames, list) or len(frames) != count:
        raise _bad(f"{name}.codec.frames must list {count} chunks")
    for k, n in enumerate(frames):
        span = min(chunk, size - k * chunk)
        if not _int(n) or (n and not (FRAME_HEADER_BYTES <= n and -(-n // 4096) * 4096 < -(-span // 4096) * 4096)):
            raise _bad(f"{name}.codec.frames[{k}] = {str(n)[:30]}: not 0 and not a frame that fits its chunk")
    return chunk, tuple(frames)


def entry(chunk_bytes: int, frames: list[int]) -> dict:
    return {"name": CODEC_NAME, "chunk_bytes": chunk_bytes, "frames": list(frames)}


def stripe_name(plain: str) -> str:
    """A compressed stripe's name: no tool may take it for safetensors."""
    stem = plain[: -len(".safetensors")] if plain.endswith(".safetensors") else plain
    return stem + STRIPE_SUFFIX


def is_compressed(m: Any) -> bool:
    """Whether a parsed Manifest (or a manifest dict) has a compressed stripe."""
    files = m.files if hasattr(m, "files") else m.get("files", [])
    return any((f.frames if hasattr(f, "frames") else f.get("codec")) for f in files)
