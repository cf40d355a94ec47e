"""The ``dcp`` section of a DCP checkpoint's manifest, and what DCP stores per item.

A DCP checkpoint is a flashwrite checkpoint whose tree is a flat dict of items
(tensor chunks as stored tensors, DCP's byte items inline as base64) plus a
``dcp`` section holding DCP's ``Metadata`` as typed JSON: the state-dict
metadata, the planner data (stored without pickling), the storage meta, and an
index of ``[fqn, offsets, item key]`` rows. The manifest itself is assembled by
``format``'s builder from the manifests of the ranks' writes.

What DCP carries per item (its ``storage_data``) is kept to where the bytes are,
as with DCP's own ``_StorageInfo``: a ``StoredChunk`` names the item's key, file,
offset and length; dtype, shape and checksums come from the manifest. On the
writing side each chunk also refers to its rank's manifest (one object per rank,
so DCP's gather pickles it once), from which ``build_manifest`` assembles the
checkpoint's manifest.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.storage import WriteResult

from ...format import dtypes
from ... import format as fmt
from ...errors import CorruptCheckpointError, FlashwriteError
from ...state.flatten import flatten, unflatten
from ...incremental.link import merge_sections
from ...format import MANIFEST_NAME, Manifest

SECTION_VERSION = 1


def item_key(index: MetadataIndex) -> str:
    """The stripe/manifest name of one DCP item: its fqn, plus its offset when non-zero."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{'_'.join(str(int(o)) for o in index.offset)}"


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where one tensor item's bytes are (DCP's storage_data for it)."""

    key: str      # the item's key in the manifest (an alias of a stored tensor, or one)
    file: str     # the stripe holding it
    offset: int   # its first byte in that stripe
    length: int
    # Writing side only: the manifest of the rank's write that holds it (shared by all
    # of that rank's items), from which finish() assembles the checkpoint's manifest.
    part: dict | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class InlineItem:
    """A byte item DCP serialised (a non-tensor value), kept inline in the manifest."""

    key: str
    data: bytes


def stored_chunks(part: dict) -> dict[str, StoredChunk]:
    """Every tensor item of one rank's write (its manifest ``part``), aliases included."""
    files = part["files"]
    out = {}
    for key, t in part["tensors"].items():
        out[key] = StoredChunk(key, files[t["file"]]["name"], t["offset"], t["nbytes"], part)
    for alias, canon in part["aliases"].items():
        out[alias] = dataclasses.replace(out[canon], key=alias)
    return out


def as_ranks_base(m: Manifest) -> Manifest | str:
    """A DCP checkpoint's manifest as an incremental save's base: like a multi-rank one
    (its ranks' file spans as the ``ranks`` section, ``incremental.unusable`` and
    ``rank_part`` take it from there), or why it cannot be one."""
    section = m.raw.get("dcp")
    if not isinstance(section, dict):
        return "it is not a dcp checkpoint"
    if "ranks" not in section:
        return "its dcp section has no per-rank file spans (saved by an older flashwrite)"
    raw = {k: v for k, v in m.raw.items() if k != "dcp"}
    raw["ranks"] = section["ranks"]
    return dataclasses.replace(m, raw=raw)


def build_manifest(metadata: Metadata, results: list[list[WriteResult]], storage_meta: StorageMeta | None) -> dict:
    """The flashwrite manifest of a DCP checkpoint, from every rank's WriteResults
    (``results[r]``: rank r's). Its ``dcp`` section keeps each rank's span of the files
    (the part the rank's next incremental save compares with, ``incremental.rank_part``),
    and the rank's incremental sections are merged as a multi-rank save merges them."""
    by_rank: list[dict | None] = [None] * len(results)
    stored: set[str] = set()
    inline: dict[str, bytes] = {}
    index = []
    for r, rank_results in enumerate(results):
        for wr in rank_results:
            sd = wr.storage_data
            if isinstance(sd, InlineItem):
                inline[sd.key] = sd.data
            elif isinstance(sd, StoredChunk) and sd.part is not None:
                if by_rank[r] is not None and by_rank[r] is not sd.part:
                    raise FlashwriteError(f"rank {r}'s results come from two writes")
                by_rank[r] = sd.part
                stored.add(sd.key)
            else:
                raise FlashwriteError(f"unexpected storage data {type(sd).__name__} for {wr.index}")
            off = None if wr.index.offset is None else [int(o) for o in wr.index.offset]
            index.append([wr.index.fqn, off, sd.key])
    ordered = [p for p in by_rank if p is not None]
    files, tensors, aliases, spans = fmt.combine(ordered)
    rank_files, it = [], iter(spans)
    for p in by_rank:  # a rank that wrote no tensor has an empty span
        rank_files.append(next(it) if p is not None else [sum(rank_files[-1]) if rank_files else 0, 0])
    items = [[{"t": "str", "v": k}, {"t": "tensor", "k": aliases.get(k, k)}] for k in sorted(stored)]
    items += [[{"t": "str", "v": k}, {"t": "bytes", "v": base64.b64encode(v).decode()}]
              for k, v in sorted(inline.items())]
    first = ordered[0] if ordered else None
    section = _encode_metadata(metadata, storage_meta, index)
    section["ranks"] = {"world_size": len(results), "files": rank_files}
    merged = fmt.assemble(files, dict(sorted(tensors.items())), dict(sorted(aliases.items())),
                          {"t": "dict", "items": items},
                          first["checksum"]["block_bytes"] if first else 1 << 20,
                          first["writer_version"] if first else "", dcp=section)
    return merge_sections(merged, [p if p is not None else {} for p in by_rank])


_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


def _encode_metadata(md: Metadata, storage_meta: StorageMeta | None, index: list) -> dict:
    sdm = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            if p.layout != torch.strided:
                raise TypeError(f"{fqn}: only strided tensors can be stored (layout {p.layout})")
            sdm[fqn] = {"type": "tensor", "dtype": dtypes.dtype_name(p.dtype), "requires_grad": bool(p.requires_grad),
                        "memory_format": str(p.memory_format).removeprefix("torch."),
                        "pin_memory": bool(p.pin_memory), "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"{fqn}: unknown DCP storage metadata {type(m).__name__}")
    try:
        ptree, ptensors, _ = flatten(md.planner_data)
    except TypeError as e:
        raise TypeError(f"DCP planner_data cannot be stored without pickling: {e}") from None
    if ptensors:
        raise TypeError("DCP planner_data holds tensors; flashwrite stores it as JSON")
    sm = storage_meta or StorageMeta()
    return {
        "section_version": SECTION_VERSION,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": ptree,
        "storage_meta": {"checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
                         "save_id": sm.save_id, "modules": list(sm.modules or [])},
        "index": index,
    }


def decode_metadata(d: Any, manifest: Manifest) -> Metadata:
    """DCP's Metadata from the dcp section ``d`` of ``manifest`` (hostile input: checked throughout)."""
    if not isinstance(d, dict) or d.get("section_version") != SECTION_VERSION:
        raise _bad(f"section version {str(d.get('section_version') if isinstance(d, dict) else d)[:20]!r} "
                   f"is not supported (this flashwrite reads {SECTION_VERSION})")
    sdm = _decode_storage_metadata(d.get("state_dict_metadata"))
    storage_data = _decode_index(d.get("index"), _inline_items(manifest), manifest)
    sm = d.get("storage_meta") if isinstance(d.get("storage_meta"), dict) else {}
    modules = sm.get("modules") if isinstance(sm.get("modules"), list) else []
    storage_meta = StorageMeta(checkpoint_id=sm.get("checkpoint_id") if isinstance(sm.get("checkpoint_id"), str)
                               else None, save_id=sm.get("save_id") if isinstance(sm.get("save_id"), str) else None,
                               modules=[m for m in modules if isinstance(m, str)])
    version = d.get("version")
    def no_tensors(key: str) -> Any:
        raise _bad("planner_data refers to a tensor")

    planner_data = unflatten(d.get("planner_data"), no_tensors)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data,
                    storage_meta=storage_meta, version=version if isinstance(version, str) else None)


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest: dcp: {msg}", file=MANIFEST_NAME)


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise _bad(f"{what} must be a list of non-negative integers")
    return v


def _decode_storage_metadata(raw: Any) -> dict[str, Any]:
    """The section's state_dict_metadata as DCP's tensor and bytes storage metadata, by fqn."""
    sdm: dict[str, Any] = {}
    if not isinstance(raw, dict):
        raise _bad("state_dict_metadata must be an object")
    for fqn, m in raw.items():
        if not isinstance(m, dict):
            raise _bad(f"{fqn!r} is not an object")
        if m.get("type") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if m.get("type") != "tensor":
            raise _bad(f"{fqn!r} has unknown type")
        try:
            dt = dtypes.dtype_from_name(m.get("dtype"))
        except ValueError as e:
            raise _bad(f"{fqn!r}: {e}") from None
        mf = _MEMORY_FORMATS.get(m.get("memory_format"))
        if mf is None:
            raise _bad(f"{fqn!r}: unknown memory format")
        size = _ints(m.get("size"), f"{fqn}.size")
        chunks = m.get("chunks")
        if not isinstance(chunks, list):
            raise _bad(f"{fqn!r}: chunks must be a list")
        cs = []
        for c in chunks:
            if not isinstance(c, list) or len(c) != 2:
                raise _bad(f"{fqn!r}: a chunk must be [offsets, sizes]")
            off, sz = _ints(c[0], f"{fqn}.chunk.offsets"), _ints(c[1], f"{fqn}.chunk.sizes")
            if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                raise _bad(f"{fqn!r}: chunk {off}+{sz} does not fit in {size}")
            cs.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        props = TensorProperties(dtype=dt, layout=torch.strided, requires_grad=bool(m.get("requires_grad")),
                                 memory_format=mf, pin_memory=bool(m.get("pin_memory")))
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(size), cs)
    return sdm


def _inline_items(manifest: Manifest) -> dict[str, bytes]:
    """The bytes items stored inline in the (flat dict) tree of a DCP checkpoint, by key."""
    inline: dict[str, bytes] = {}
    tree = manifest.tree
    if not isinstance(tree, dict) or tree.get("t") != "dict" or not isinstance(tree.get("items"), list):
        raise _bad("the tree of a DCP checkpoint must be a flat dict")
    for it in tree["items"]:
        if isinstance(it, list) and len(it) == 2 and isinstance(it[1], dict) and it[1].get("t") == "bytes":
            key = it[0].get("v") if isinstance(it[0], dict) else None
            try:
                inline[key] = base64.b64decode(it[1].get("v"), validate=True)
            except (ValueError, TypeError):
                raise _bad(f"inline item {str(key)[:80]!r} is not base64") from None
    return inline


def _decode_index(index: Any, inline: dict[str, bytes], manifest: Manifest) -> dict[MetadataIndex, Any]:
    """The section's index as DCP's storage_data: each row an inline item or a stored chunk."""
    storage_data: dict[MetadataIndex, Any] = {}
    if not isinstance(index, list):
        raise _bad("index must be a list")
    for row in index:
        if not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str) or not isinstance(row[2], str):
            raise _bad("index rows must be [fqn, offsets, key]")
        fqn, off, key = row
        if off is not None:
            off = _ints(off, f"{fqn}.offset")
        mi = MetadataIndex(fqn, off)
        if key in inline:
            storage_data[mi] = InlineItem(key, inline[key])
            continue
        e = manifest.tensors.get(manifest.aliases.get(key, key))
        if e is None:
            raise _bad(f"index names unknown item {key!r}")
        storage_data[mi] = StoredChunk(key, manifest.files[e.file].name, e.offset, e.nbytes)
    return storage_data
