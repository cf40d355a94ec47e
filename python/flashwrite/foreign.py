"""Loading safetensors files that flashwrite did not write, through the same engine.

``flashwrite.load`` reads (through ``describe``) a path that is a ``.safetensors`` file, a directory with a
Hugging Face ``*.safetensors.index.json``, or a directory of ``*.safetensors`` files
without a flashwrite manifest. The result is the flat ``{name: tensor}`` dict that
``safetensors.torch.load_file`` returns (merged across shards). Files are read
with large parallel aligned O_DIRECT reads into bounce buffers, and the native job copies
each tensor's bytes out into its own storage wherever its data sits (safetensors offsets
need no alignment); tensors bound for a GPU go through the pinned host-to-device pipeline.

Headers are hostile input: bounded length, valid JSON object, known dtypes, shapes
that match byte ranges, ranges inside the file and not overlapping, names unique
across shards, and index entries that name plain files inside the directory.
"""

from __future__ import annotations

import glob
import json
import math
import os
import stat
import struct

from . import dtypes
from .defaults import READ_CHUNK_BYTES
from .errors import CorruptCheckpointError, UnsafeCheckpointError
from .format import MANIFEST_NAME, FileEntry, Manifest, TensorEntry, check_member_name
from .plan import MAX_HEADER_BYTES

MAX_INDEX_BYTES = 64 << 20


def is_foreign(path: str) -> bool:
    """A path flashwrite reads as plain safetensors: a file, or a directory without a manifest."""
    if os.path.isfile(path):
        return True
    return os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST_NAME)) and bool(
        glob.glob(os.path.join(glob.escape(path), "*.safetensors")))


def _bad(name: str, msg: str, tensor: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{name}: {msg}", file=name, tensor=tensor)


def _index_files(directory: str, index_path: str) -> list[str]:
    name = os.path.basename(index_path)
    with open(index_path, "rb") as fh:
        data = fh.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise _bad(name, f"larger than {MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(data)
    except (ValueError, RecursionError):
        raise _bad(name, "not valid JSON") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise _bad(name, "weight_map must map tensor names to file names")
    files = sorted(set(wm.values()))
    for f in files:
        try:
            check_member_name(f)
        except UnsafeCheckpointError:
            raise UnsafeCheckpointError(f"{name} names {f[:80]!r}, which is not a plain file in {directory}",
                                        file=name) from None
    return files


INDEX_SUFFIX = ".index.json"


def indexed_dir(path: str) -> str | None:
    """The directory a Hugging Face index file (``model.safetensors.index.json``) stands
    for, when ``path`` names one; users pass the index where the directory is meant."""
    if path.endswith(INDEX_SUFFIX) and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    return None


def locate(path: str) -> tuple[str, list[str] | None]:
    """(directory, [file name]) for a file; (directory, the files it lists) for an index
    file; (directory, None) for a directory."""
    if indexed_dir(path) is not None:
        directory = indexed_dir(path)
        return directory, _index_files(directory, path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            with open(path, "rb") as fh:
                head = fh.read(9)
            if head[:1] in (b"{", b"[") or (len(head) == 9 and head[8:9] != b"{"):
                raise ValueError(f"{path} is not a safetensors file (no safetensors header): pass a .safetensors "
                                 "file, a Hugging Face directory or a flashwrite checkpoint directory")
        return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    return path, None


def describe(base: str, shown: str, names: list[str] | None = None, from_index: bool = False) -> Manifest:
    """A manifest for the safetensors files in directory ``base`` (messages name ``shown``):
    ``names`` (those an index file lists, with from_index), else those its index lists,
    else every ``*.safetensors`` in name order."""
    if names is None:
        indexes = sorted(glob.glob(os.path.join(glob.escape(base), "*.safetensors.index.json")))
        if len(indexes) > 1:
            raise ValueError(f"{shown} holds several safetensors indexes "
                             f"({', '.join(map(os.path.basename, indexes))}); load their files one by one")
        names = _index_files(shown, indexes[0]) if indexes else sorted(
            os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(base), "*.safetensors")))
        whole_dir = True
    else:
        whole_dir = from_index
    if not names:
        raise FileNotFoundError(2, "no safetensors files (and no flashwrite manifest) in", shown)
    files: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    for fi, name in enumerate(names):
        full = os.path.join(base, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{name} (listed in the index) is missing from {shown}", file=name) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{name} in {shown} is not a regular file", file=name)
        header_bytes, entries, writer = _read_header(full, name, st.st_size)
        if writer == "flashwrite" and whole_dir:
            # Its stripes without its manifest: a crashed or damaged save, never a whole checkpoint.
            raise CorruptCheckpointError(f"{os.path.join(shown, MANIFEST_NAME)} is missing: {name} was written by "
                                         "flashwrite, so this is an incomplete flashwrite checkpoint",
                                         file=MANIFEST_NAME)
        files.append(FileEntry(name, st.st_size, header_bytes))
        for key, (dt_name, shape, start, end) in entries.items():
            if key in tensors:
                raise _bad(name, f"tensor {key!r} is also in {files[tensors[key].file].name}", key)
            tensors[key] = TensorEntry(key, fi, header_bytes + start, end - start, dt_name, shape, "cpu", ())
    tree = {"t": "dict", "items": [[{"t": "str", "v": k}, {"t": "tensor", "k": k}] for k in tensors]}
    return Manifest(files, tensors, {}, tree, READ_CHUNK_BYTES, "", {}, {})


def _read_header(full: str, name: str,
                 size: int) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]], str | None]:
    """(header bytes, {name: (dtype, shape, start, end)}, the writer its metadata names)"""
    fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise _bad(name, "too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(name, f"header length {n} is larger than the file or the safetensors limit")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise _bad(name, "header was cut short")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad(name, "safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _bad(name, "safetensors header is not an object")
    meta = header.pop("__metadata__", None)
    writer = meta.get("writer") if isinstance(meta, dict) and isinstance(meta.get("writer"), str) else None
    data = size - 8 - n
    out = {}
    spans = []
    for key, h in header.items():
        if not isinstance(h, dict):
            raise _bad(name, "header entry is not an object", key)
        dt = dtypes.dtype_from_code(h.get("dtype"))
        if dt is None:
            raise _bad(name, f"unknown dtype {str(h.get('dtype'))[:20]!r}", key)
        shape, offs = h.get("shape"), h.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 64 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 62) for x in shape):
            raise _bad(name, "shape must be a list of at most 64 non-negative integers", key)
        if not isinstance(offs, list) or len(offs) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in offs) or not 0 <= offs[0] <= offs[1] <= data:
            raise _bad(name, f"data_offsets must lie inside the {data} data bytes", key)
        if math.prod(shape) * dt.itemsize != offs[1] - offs[0]:
            raise _bad(name, f"dtype {h['dtype']} and shape {shape} do not fit {offs[1] - offs[0]} bytes", key)
        out[key] = (dtypes.dtype_name(dt), tuple(shape), offs[0], offs[1])
        if offs[1] > offs[0]:
            spans.append((offs[0], offs[1], key))
    spans.sort()
    for (_, e1, k1), (s2, _, k2) in zip(spans, spans[1:]):
        if e1 > s2:
            raise _bad(name, f"tensors {k1!r} and {k2!r} overlap", k2)
    return 8 + n, out, writer
