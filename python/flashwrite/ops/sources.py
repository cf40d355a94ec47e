"""Readers for ``flashwrite convert``: every format as a stream of tensors.

A source exposes its tensors' names, dtypes and shapes up front (from headers or
metadata, nothing else read), the flashwrite tree when the data came from one,
and then each tensor's bytes in order, a bounded piece at a time, so a
conversion holds about one piece (safetensors, flashwrite) or one batch of
tensors (DCP) in memory, never the checkpoint. Every input is parsed as hostile.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import stat
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .. import _core
from ..format import dtypes
from ..loading.read_plan import check_stripe_size
from ..errors import ChecksumMismatchError, CorruptCheckpointError, UnsafeCheckpointError
from ..state.flatten import flatten, referenced_keys
from ..format import MANIFEST_NAME, check_member_name, piece_ranges, safetensors_header
from ..targets.locate import locate, read_manifest as read_located
from ..targets.target import shown
from .common import UsageError
from .ls import read_json_small
from .pickled import dcp_arrays, load_weights_only, refused_global
from .tree import walk

PIECE = 16 << 20
SIDECAR = "flashwrite-tree.json"  # the flashwrite tree kept beside foreign formats, for round trips
META_KEY = "flashwrite.tree"      # ... and in a safetensors header's __metadata__


@dataclass
class Item:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Source:
    kind: str
    path: str
    items: list[Item]
    tree: Any = None            # flashwrite tree; None: a flat {key: tensor} dict
    aliases: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def chunks(self, item: Item) -> Iterator[memoryview]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def flat_tree(keys: list[str]) -> dict:
    return {"t": "dict", "items": [[{"t": "str", "v": k}, {"t": "tensor", "k": k}] for k in keys]}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _open_regular(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not a regular file")
    return fd


def _side_tree(raw: Any, keys: set[str], where: str) -> tuple[Any, dict, dict, dict]:
    """(tree, aliases, dtypes, metadata) from a flashwrite record kept with a foreign format,
    checked against the tensors that are really there; anything off is ignored (flat)."""
    if not isinstance(raw, dict):
        return None, {}, {}, {}
    tree, aliases, dts, meta = raw.get("tree"), raw.get("aliases", {}), raw.get("dtypes", {}), raw.get("metadata", {})
    if not (isinstance(aliases, dict) and isinstance(dts, dict) and isinstance(meta, dict)):
        return None, {}, {}, {}
    if not all(isinstance(v, str) and v in keys for v in aliases.values()):
        return None, {}, {}, {}
    if not all(n.get("k") in keys for _, n in walk(tree) if n.get("t") == "tensor"):
        return None, {}, {}, {}
    meta = {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}
    return tree, aliases, dts, meta


# ------------------------------------------------------------------ safetensors

def read_safetensors_header(path: str, fd: int) -> tuple[dict[str, tuple[Item, int]], dict, int]:
    """({key: (item, absolute offset)}, __metadata__, data start), every bound checked
    by ``format.safetensors_header``."""
    h = safetensors_header.read(fd, path)
    out = {k: (Item(k, e.dtype, e.shape), h.header_bytes + e.start) for k, e in h.tensors.items()}
    return out, h.metadata, h.header_bytes


class SafetensorsSource(Source):
    """One safetensors file, or every shard of a Hugging Face directory."""

    def __init__(self, path: str, files: list[str], kind: str):
        items, self._where, self._fds, keys_meta = [], {}, [], {}
        try:
            for f in files:
                fd = _open_regular(f)
                self._fds.append(fd)
                entries, meta, _ = read_safetensors_header(f, fd)
                keys_meta.update(meta)
                for k, (item, off) in entries.items():
                    if k in self._where:
                        raise CorruptCheckpointError(f"tensor {k!r} is in two shards of {path}", tensor=k)
                    self._where[k] = (len(self._fds) - 1, off)
                    items.append(item)
        except BaseException:
            self.close()
            raise
        super().__init__(kind, path, items)
        side = keys_meta.get(META_KEY)
        sidecar = os.path.join(path, SIDECAR)
        if not side and kind == "hf" and os.path.exists(sidecar):
            try:
                side = read_json_small(sidecar)[1]
            except ValueError:
                side = None
        if side:
            try:
                tree, aliases, dts, meta = _side_tree(json.loads(side), set(self._where), path)
            except (ValueError, RecursionError):
                tree = None
            if tree is not None:
                self.tree, self.aliases, self.metadata = tree, aliases, meta
                for it in self.items:  # bytes stored as U8 keep their true dtype in the record
                    dn = dts.get(it.key)
                    if dn and dn != dtypes.dtype_name(it.dtype):
                        try:
                            dt = dtypes.dtype_from_name(dn)
                        except ValueError:
                            continue
                        if it.nbytes % dt.itemsize == 0 and len(it.shape) == 1:
                            orig = dts.get(f"{it.key}#shape")
                            shape = tuple(orig) if isinstance(orig, list) and all(type(s) is int for s in orig) \
                                else (it.nbytes // dt.itemsize,)
                            if math.prod(shape) * dt.itemsize == it.nbytes:
                                it.dtype, it.shape = dt, shape

    def chunks(self, item: Item) -> Iterator[memoryview]:
        fi, off = self._where[item.key]
        pos, n = 0, item.nbytes
        while pos < n:
            k = min(PIECE, n - pos)
            data = os.pread(self._fds[fi], k, off + pos)
            if len(data) != k:
                raise CorruptCheckpointError(f"{self.path}: short read in tensor {item.key!r}", tensor=item.key)
            yield memoryview(data)
            pos += k

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def hf_shards(path: str) -> list[str]:
    """The shards of a Hugging Face directory: those its index names, else every *.safetensors."""
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        raw, _ = read_json_small(idx, 256 << 20)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict):
            raise CorruptCheckpointError(f"{idx}: weight_map missing")
        names = sorted({check_member_name(v) for v in wm.values()})
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise CorruptCheckpointError(f"{path}: no safetensors shards")
    return [os.path.join(path, n) for n in names]


# ------------------------------------------------------------------- flashwrite

class FlashwriteSource(Source):
    """A flashwrite checkpoint, read tensor by tensor with every piece checked
    against its stored checksum (a damaged checkpoint does not convert). ``path``
    may be an nfs:// URL: the manifest is fetched as ``inspect`` does, the pieces
    are read from the server."""

    def __init__(self, path: str):
        where = locate(path, "convert")
        self.target, self.root = where.target, where.path
        self.m = read_located(where, "convert", shown=shown(path))
        for f in self.m.files:  # verify's check and words: a truncated stripe is no checksum mismatch
            check_stripe_size(self.target, os.path.join(self.root, f.name), f.name, shown(path), f.size)
        items = [Item(k, dtypes.dtype_from_name(e.dtype), e.shape) for k, e in self.m.tensors.items()]
        super().__init__("flashwrite", path, items, self.m.tree, dict(self.m.aliases), dict(self.m.metadata))

    def chunks(self, item: Item) -> Iterator[memoryview]:
        e = self.m.tensors[item.key]
        fname = self.m.files[e.file].name  # a plain name: checked by the manifest parser
        for (off, n), h in zip(piece_ranges(e.offset, e.nbytes, self.m.block_bytes), e.checksums):
            data = self._read(e.file, off, n)
            got = _core.checksum(data) if len(data) == n else None
            if got != int(h, 16):
                raise ChecksumMismatchError(f"checksum mismatch in {fname}, tensor {e.key!r} at file offset {off}",
                                            file=fname, tensor=e.key, offset=off, expected=h,
                                            actual=f"{got:016x}" if got is not None else "short read")
            yield memoryview(data)

    def _read(self, fi: int, off: int, n: int) -> bytes:
        """n bytes at off of stripe fi, as stored; a compressed chunk decoded whole (and
        kept for the next piece inside it)."""
        f, block = self.m.files[fi], self.m.block_bytes
        path = os.path.join(self.root, f.name)
        k = off // block
        frame = f.frames[k] if f.frames else 0
        if not frame:
            return self.target.read_at(path, off, n)
        cached = getattr(self, "_chunk", None)
        if cached is None or cached[0] != (fi, k):
            raw_len = min(block, f.size - k * block)
            cached = self._chunk = ((fi, k), _core.codec_decompress(self.target.read_at(path, k * block, frame),
                                                                   raw_len))
        return cached[1][off - k * block: off - k * block + n]


# --------------------------------------------------------------------- torch.save

class TorchSource(Source):
    """A torch.save file, loaded with weights_only=True (no code runs) unless the
    caller allows pickles, and memory-mapped where the file allows it."""

    def __init__(self, path: str, allow_pickle: bool):
        fd = _open_regular(path)
        os.close(fd)
        try:
            # weights_only (numeric numpy values allowed, as convert writes them) unless told
            load = (lambda **kw: torch.load(path, weights_only=False, **kw)) if allow_pickle else \
                (lambda **kw: load_weights_only(path, **kw))
            try:  # zip files (torch.save since 1.6) map their storages: nothing is read until converted
                obj = load(map_location="cpu", mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e) and "zip" not in str(e):
                    raise
                obj = load(map_location="cpu")
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"{path}: refused to unpickle: {refused_global(e)}; pass --allow-pickle "
                                        "only for files you trust (it runs the code the file names)") from None
        except (RuntimeError, EOFError, ValueError, OSError, AttributeError, ImportError, KeyError) as e:
            raise CorruptCheckpointError(f"{path}: not a readable torch.save file: {str(e)[:300]}") from None
        tree, flat, aliases = flatten(obj, allow_pickle=allow_pickle)
        self._tensors = {ft.key: ft.tensor for ft in flat}
        items = [Item(ft.key, ft.tensor.dtype, tuple(ft.tensor.shape)) for ft in flat]
        super().__init__("torch", path, items, tree, aliases)

    def chunks(self, item: Item) -> Iterator[memoryview]:
        data = tensor_bytes(self._tensors[item.key])
        for pos in range(0, len(data), PIECE):
            yield data[pos:pos + PIECE]


# ----------------------------------------------------------------------------- DCP

class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; only the plain classes DCP writes there may load."""
    _OK_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                   "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension")
    _OK = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
           ("torch._utils", "_rebuild_tensor_v2"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._OK_MODULES or (module, name) in self._OK or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                               torch.memory_format))):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"DCP metadata wants {module}.{name}, which a checkpoint has no need of; "
                                    "refusing to load it")


def read_dcp_metadata(path: str) -> Any:
    fd = _open_regular(os.path.join(path, ".metadata"))
    with open(fd, "rb") as fh:
        data = fh.read(1 << 30)
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise CorruptCheckpointError(f"{path}/.metadata is not readable DCP metadata: {type(e).__name__}: "
                                     f"{str(e)[:200]}") from None


class DCPSource(Source):
    """A directory written by torch.distributed.checkpoint's FileSystemWriter. Tensors
    are read in batches of about BATCH bytes (a larger tensor alone) through DCP's own reader (which loads
    them with weights_only=True); non-tensor items are pickles and need allow_pickle."""
    BATCH = 64 << 20

    def __init__(self, path: str, allow_pickle: bool):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
        md = read_dcp_metadata(path)
        sdm = getattr(md, "state_dict_metadata", None)
        if not isinstance(sdm, dict):
            raise CorruptCheckpointError(f"{path}/.metadata has no state_dict_metadata")
        items, self._bytes_keys = [], []
        for k, v in sdm.items():
            if isinstance(v, TensorStorageMetadata):
                dt = v.properties.dtype
                dtypes.dtype_name(dt)
                if not all(type(s) is int and s >= 0 for s in v.size):
                    raise CorruptCheckpointError(f"{path}: tensor {k!r} has a bad size")
                items.append(Item(str(k), dt, tuple(v.size)))
            elif isinstance(v, BytesStorageMetadata):
                self._bytes_keys.append(str(k))
        super().__init__("dcp", path, items)
        self.allow_pickle = allow_pickle
        self._cache: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, torch.Tensor] = {}
        self._order = [i.key for i in items]
        self._pos = {k: n for n, k in enumerate(self._order)}
        self._items = {i.key: i for i in items}
        side = os.path.join(path, SIDECAR)
        if os.path.exists(side):
            try:
                raw, _ = read_json_small(side)
            except ValueError:
                raw = None
            tree, aliases, _, meta = _side_tree(raw, {i.key for i in items}, path)
            if tree is not None:
                self.tree, self.aliases, self.metadata = tree, aliases, meta
                # DCP holds a tied tensor under each of its names; the tree names it once.
                used = referenced_keys(tree)
                self.items = [i for i in items if i.key in used]
                self._order = [i.key for i in self.items]
                self._pos = {k: n for n, k in enumerate(self._order)}
                # numpy arrays: DCP pickled them (whole, or in the tuple holding them)
                self._arrays = dcp_arrays(path, md, tree, used - set(self._order), allow_pickle)
                self.items += [Item(k, t.dtype, tuple(t.shape)) for k, t in self._arrays.items()]
        if self.tree is None and self._bytes_keys:
            if allow_pickle:
                leaves, _, _ = flatten(self._load({k: None for k in self._bytes_keys}), allow_pickle=True)
                self.tree = {"t": "dict", "items": flat_tree(self._order)["items"] + leaves["items"]}
            else:
                self.notes.append(f"skipped {len(self._bytes_keys)} non-tensor item(s) (DCP stores them as pickles; "
                                  "--allow-pickle reads them): " + ", ".join(self._bytes_keys[:5]))

    def _load(self, sd: dict) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        class _Reader(FileSystemReader):
            def read_metadata(inner, *a: Any, **kw: Any) -> Any:  # noqa: N805 - the safe unpickler
                return read_dcp_metadata(self.path)

        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=_Reader(self.path), no_dist=True)
        return sd

    def chunks(self, item: Item) -> Iterator[memoryview]:
        if item.key in self._arrays:
            data = tensor_bytes(self._arrays[item.key])
            for pos in range(0, len(data), PIECE):
                yield data[pos:pos + PIECE]
            return
        if item.key not in self._cache:
            self._cache.clear()
            batch, size = {}, 0
            for k in self._order[self._pos[item.key]:]:
                it = self._items[k]
                if batch and size + it.nbytes > self.BATCH:
                    break
                batch[k] = torch.empty(it.shape, dtype=it.dtype)
                size += it.nbytes
            self._cache = self._load(batch)
        t = self._cache.pop(item.key)
        data = tensor_bytes(t)
        for pos in range(0, len(data), PIECE):
            yield data[pos:pos + PIECE]


# ------------------------------------------------------------------------ detect

FORMATS = ("flashwrite", "safetensors", "hf", "torch", "dcp")


def detect(path: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(2, "no such file or directory", path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, MANIFEST_NAME)):
            return "flashwrite"
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        if os.path.exists(os.path.join(path, "model.safetensors.index.json")) or \
                any(n.endswith(".safetensors") for n in os.listdir(path)):
            return "hf"
        raise UsageError(f"{path}: cannot tell the format of this directory (no {MANIFEST_NAME}, no DCP .metadata, "
                         "no safetensors shards): pass a checkpoint directory, or name its format with --from")
    fd = _open_regular(path)
    try:
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise UsageError(f"{path}: not a torch.save or safetensors file: pass one, or name its format with --from")


def open_source(path: str, kind: str, allow_pickle: bool = False) -> Source:
    if kind == "flashwrite":
        return FlashwriteSource(path)
    if kind == "safetensors":
        return SafetensorsSource(path, [path], "safetensors")
    if kind == "hf":
        return SafetensorsSource(path, hf_shards(path), "hf")
    if kind == "torch":
        return TorchSource(path, allow_pickle)
    if kind == "dcp":
        return DCPSource(path, allow_pickle)
    raise ValueError(f"unknown format {kind!r}; choose from {', '.join(FORMATS)}")
