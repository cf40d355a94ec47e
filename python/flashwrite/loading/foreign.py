"""Loading safetensors files that flashwrite did not write, through the same engine.

``flashwrite.load`` reads (through ``describe``) a path that is a ``.safetensors`` file, a directory with a
Hugging Face ``*.safetensors.index.json``, or a directory of ``*.safetensors`` files
without a flashwrite manifest. The result is the flat ``{name: tensor}`` dict that
``safetensors.torch.load_file`` returns (merged across shards). Files are read
with large parallel aligned O_DIRECT reads into bounce buffers, and the native job copies
each tensor's bytes out into its own storage wherever its data sits (safetensors offsets
need no alignment); tensors bound for a GPU go through the pinned host-to-device pipeline.

Headers are hostile input, parsed by ``format.safetensors_header`` (bounded length,
valid JSON object, known dtypes, shapes that match byte ranges, ranges inside the file
and not overlapping); here, names must be unique across shards and index entries must
name plain files inside the directory.
"""

from __future__ import annotations

import glob
import json
import os
import stat
from typing import Any, Callable

from ..format import dtypes
from ..defaults import READ_CHUNK_BYTES
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..format.hints import file_hint, file_kind
from ..format import MANIFEST_NAME, FileEntry, Manifest, TensorEntry, check_member_name, safetensors_header

MAX_INDEX_BYTES = 64 << 20


def is_foreign(path: str) -> bool:
    """A path flashwrite reads as plain safetensors: a file, or a directory without a manifest."""
    if os.path.isfile(path):
        return True
    return os.path.isdir(path) and not os.path.lexists(os.path.join(path, MANIFEST_NAME)) and bool(
        glob.glob(os.path.join(glob.escape(path), "*.safetensors")))


def is_foreign_on(target: Any, path: str) -> bool:
    """``is_foreign`` of a directory on a target whose paths are not this machine's."""
    return target.is_dir(path) and not target.exists(f"{path.rstrip('/')}/{MANIFEST_NAME}") and any(
        n.endswith(".safetensors") for n in target.list(path))


def describe_on(target: Any, base: str, shown: str) -> Manifest:
    """``describe`` of the directory ``base`` of ``target`` (its index, else every
    ``*.safetensors`` in it), each file and header read through the target."""
    listing = sorted(target.list(base))
    indexes = [n for n in listing if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        raise ValueError(f"{shown} holds several safetensors indexes ({', '.join(indexes)}); load their files one "
                         "by one")
    if indexes:
        try:
            data = target.read_small(f"{base.rstrip('/')}/{indexes[0]}", MAX_INDEX_BYTES)
        except ValueError:
            raise _bad(indexes[0], f"larger than {MAX_INDEX_BYTES} bytes") from None
        names = _index_names(shown, indexes[0], data)
    else:
        names = [n for n in listing if n.endswith(".safetensors")]

    def header_of(name: str) -> tuple[int, safetensors_header.SafetensorsHeader]:
        full = f"{base.rstrip('/')}/{name}"
        size = target.file_size(full)
        if size is None and not target.exists(full):
            raise CorruptCheckpointError(f"{name} (listed in the index) is missing from {shown}", file=name)
        if size is None:
            raise UnsafeCheckpointError(f"{name} in {shown} is not a regular file", file=name)
        n = safetensors_header.header_length(target.read_at(full, 0, 8), size, name)
        return size, safetensors_header.parse(target.read_at(full, 0, 8 + n), size, name)

    return _manifest(names, shown, True, header_of)


def _bad(name: str, msg: str, tensor: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{name}: {msg}", file=name, tensor=tensor)


def _index_files(directory: str, index_path: str) -> list[str]:
    name = os.path.basename(index_path)
    with open(index_path, "rb") as fh:
        data = fh.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise _bad(name, f"larger than {MAX_INDEX_BYTES} bytes")
    return _index_names(directory, name, data)


def _index_names(directory: str, name: str, data: bytes) -> list[str]:
    """The files the index ``name`` (its bytes ``data``) lists, each a plain name in ``directory``."""
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
            if head[:1] in (b"{", b"[") or len(head) < 9 or head[8:9] != b"{":
                if file_kind(path) == "torch":
                    raise ValueError(file_hint(path, path))
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

    def header_of(name: str) -> tuple[int, safetensors_header.SafetensorsHeader]:
        full = os.path.join(base, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{name} (listed in the index) is missing from {shown}", file=name) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{name} in {shown} is not a regular file", file=name)
        return st.st_size, _read_header(full, name, st.st_size)

    return _manifest(names, shown, whole_dir, header_of)


def _manifest(names: list[str], shown: str, whole_dir: bool,
              header_of: Callable[[str], tuple[int, safetensors_header.SafetensorsHeader]]) -> Manifest:
    """The manifest of the files ``names`` (``header_of(name)``: its size and header)."""
    if not names:
        raise FileNotFoundError(2, "no safetensors files (and no flashwrite manifest) in", shown)
    files: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    for fi, name in enumerate(names):
        size, header = header_of(name)
        if header.metadata.get("writer") == "flashwrite" and whole_dir:
            # Its stripes without its manifest: a crashed or damaged save, never a whole checkpoint.
            raise CorruptCheckpointError(f"{os.path.join(shown, MANIFEST_NAME)} is missing: {name} was written by "
                                         "flashwrite, so this is an incomplete flashwrite checkpoint",
                                         file=MANIFEST_NAME)
        files.append(FileEntry(name, size, header.header_bytes))
        for key, e in header.tensors.items():
            if key in tensors:
                raise _bad(name, f"tensor {key!r} is also in {files[tensors[key].file].name}", key)
            tensors[key] = TensorEntry(key, fi, header.header_bytes + e.start, e.end - e.start,
                                       dtypes.dtype_name(e.dtype), e.shape, "cpu", ())
    tree = {"t": "dict", "items": [[{"t": "str", "v": k}, {"t": "tensor", "k": k}] for k in tensors]}
    return Manifest(files, tensors, {}, tree, READ_CHUNK_BYTES, "", {}, {})


def _read_header(full: str, name: str, size: int) -> safetensors_header.SafetensorsHeader:
    fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        return safetensors_header.read(fd, name, size)
    finally:
        os.close(fd)
