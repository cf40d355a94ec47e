"""``torch.distributed.checkpoint`` (DCP) storage backed by flashwrite's engine.

    import torch.distributed.checkpoint as dcp
    from flashwrite.dcp import FlashwriteStorageWriter, FlashwriteStorageReader

    dcp.save(state_dict, storage_writer=FlashwriteStorageWriter(path))
    fut = dcp.async_save(state_dict, storage_writer=FlashwriteStorageWriter(path))
    dcp.load(state_dict, storage_reader=FlashwriteStorageReader(path))   # reshards as DCP does

What lands on disk is a flashwrite checkpoint (format version 1): every rank's
tensor chunks are safetensors stripes written by the native engine
(``model-rank00001-00001-of-00004.safetensors``, keys ``fqn`` or, for a shard that
does not start at the origin, ``fqn@row_col``); objects DCP serialises to bytes
(non-tensor values) are kept inline in the manifest; DCP's metadata is a typed
JSON ``dcp`` section of ``flashwrite.json``, so reading a checkpoint never
unpickles anything by itself (DCP's own planner still ``torch.load``s the
byte items it asked for). The checkpoint is committed like any flashwrite
checkpoint: written into a temporary sibling directory, manifest last, renamed
into place by the coordinator in ``finish``; ``flashwrite.verify`` and
``flashwrite.load`` (a flat ``{key: tensor or bytes}``) work on it too.

Staging for ``dcp.async_save``: the writer is DCP's ``AsyncStager``. When it was
created with its path, ``stage()`` plans this rank's part of the checkpoint with
DCP's default planner, agrees with the other ranks (one small exchange on
flashwrite's gloo group) which rank writes each replicated item, and starts the
native save of exactly those chunks: it returns once they are copied into the
reusable staging pool (``Writer.save_async(block=True)`` semantics) while the
writes continue; the background ``dcp.save`` then only waits for them and
commits. Without a path (``checkpoint_id=`` given to ``async_save``) the state is
copied to cached host buffers instead and written from there. Use the default
planner and the thread executor with ``async_save``; one save at a time per writer
instance.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import math
import os
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import commit, defaults, dtypes
from ._core import CHECKSUM_ALGORITHM
from .coord import coordinator
from .errors import CheckpointExistsError, CorruptCheckpointError, FlashwriteError
from .flatten import flatten, unflatten
from .format import FORMAT_VERSION, MANIFEST_NAME, build_index, parse_manifest, read_manifest
from .plan import rank_prefix as stripe_prefix
from .read import CheckpointDir
from .save import default_writer

__all__ = ["FlashwriteStorageWriter", "FlashwriteStorageReader"]

DCP_SECTION_VERSION = 1
DEFAULT_MAX_READ_BYTES = 4 << 30  # host memory one read_data batch may hold


def item_key(index: MetadataIndex) -> str:
    """The stripe/manifest name of one DCP item: its fqn, plus its offset when non-zero."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{'_'.join(str(int(o)) for o in index.offset)}"


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one tensor chunk's bytes are (the WriteResult storage_data, and what the
    reader resolves each MetadataIndex to)."""

    key: str
    file: str
    file_size: int
    header_bytes: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    checksums: tuple[str, ...]
    block_bytes: int
    writer_version: str
    alias_of: str | None = None


@dataclasses.dataclass(frozen=True)
class _Inline:
    key: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class _LocalData:
    rank: int
    staged_tmp: str | None


@dataclasses.dataclass(frozen=True)
class _GlobalData:
    tmp: str
    prefix: str


@dataclasses.dataclass
class _Staged:
    """One ``stage()``: the native save already running for this rank's items."""

    final: str
    tmp: str
    sw: Any  # StripeWrite, or None when this rank has no tensor to write
    owner: dict[MetadataIndex, int]
    tensor_keys: set[str]
    inline: dict[str, bytes]
    t0: float


# Temporary directories this process created for a DCP save that never reached
# finish(): DCP reports failures to the caller without telling the storage, so the
# next save to the same path removes them (saves of one writer run one at a time).
_unfinished: dict[str, set[str]] = collections.defaultdict(set)
_unfinished_lock = threading.Lock()


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _copy_containers(obj: Any) -> Any:
    """The same structure with fresh dicts/lists/tuples (leaves shared), so later
    changes to the caller's containers do not reach a save in flight."""
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, _copy_containers(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_copy_containers(v) for v in obj)
    return obj


def _assign_owners(all_items: list[list[tuple[MetadataIndex, int]]]) -> dict[MetadataIndex, int]:
    """Which rank writes each item: among the ranks holding it, the one with the
    fewest bytes assigned so far (DCP's dedup rule), deterministic on every rank."""
    holders: dict[MetadataIndex, list[int]] = {}
    size: dict[MetadataIndex, int] = {}
    for r, items in enumerate(all_items):
        for idx, n in items:
            holders.setdefault(idx, []).append(r)
            size[idx] = n
    load = [0] * len(all_items)
    owner = {}
    for idx, hs in holders.items():
        r = min(hs, key=lambda h: (load[h], h))
        owner[idx] = r
        load[r] += size[idx] or 1
    return owner


def _chunk_bytes(item: Any) -> int:
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * torch._utils._element_size(item.tensor_data.properties.dtype)


class FlashwriteStorageWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` (and ``AsyncStager``) writing through flashwrite's native engine.

    path: the checkpoint directory (or pass ``checkpoint_id`` to dcp.save).
    overwrite: replace an existing checkpoint atomically (DCP's writer overwrites too).
    writer: a ``flashwrite.Writer`` to use; otherwise the shared one for ``writer_options``
    (stripes, queue_depth, chunk_bytes, backend, direct, max_staging_bytes, copy_threads).
    process_group: the group passed to ``dcp.async_save`` (default: the default group);
    ``stage()`` agrees with its ranks, on flashwrite's own gloo group for them
    (``coordination_group`` for a subgroup, see ``flashwrite.distributed.coordinator``).
    timeout: seconds a rank waits for its peers in that exchange.
    """

    _synchronize_after_execute = False  # stage() returns only once staged

    def __init__(self, path: str | os.PathLike | None = None, *, overwrite: bool = True, writer: Any = None,
                 process_group: Any = None, coordination_group: Any = None, timeout: float | None = None,
                 **writer_options: Any):
        super().__init__()
        self._fixed_path = os.path.abspath(os.fspath(path)) if path is not None else None
        self.path: str | None = self._fixed_path
        self.overwrite = overwrite
        self.writer = writer if writer is not None else default_writer(**writer_options)
        self.timeout = timeout
        self.process_group = process_group
        self.coordination_group = coordination_group
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: Any = None
        self._pending: collections.deque[_Staged] = collections.deque()
        self._current: _Staged | None = None
        self._copy_cache: Any = None
        self._tmp: str | None = None

    # ------------------------------------------------------------ AsyncStager

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._fixed_path is None:
            return self._copy_stage(state_dict)
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        t0 = time.perf_counter()
        coord = None
        rank, size = 0, 1
        if dist.is_available() and dist.is_initialized():
            coord = coordinator(self.process_group, self.timeout, self.coordination_group)
            rank, size = coord.rank, coord.size
        final = self._fixed_path
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, None, rank == 0)
        local = planner.create_local_plan()
        mine_sizes = [(it.index, _chunk_bytes(it)) for it in local.items]
        proposal = commit.temp_dir_for(final)
        refuse = commit.target_problem(final, self.overwrite)

        def exchange(obj: Any) -> list:
            if coord is None:
                return [obj]
            out: list = [None] * size
            coord.run(dist.all_gather_object, out, obj, group=coord.group).result()
            return out

        gathered = exchange((mine_sizes, final, proposal, refuse))
        if len({g[1] for g in gathered}) != 1:
            raise ValueError(f"ranks stage into different paths: {sorted({g[1] for g in gathered})}")
        if gathered[0][3]:
            raise CheckpointExistsError(17, gathered[0][3], final)
        owner = _assign_owners([g[0] for g in gathered])
        tmp = gathered[0][2]
        sw, tensors, inline, error = None, {}, {}, None
        try:
            for it in local.items:
                if owner[it.index] != rank:
                    continue
                data = planner.resolve_data(it)
                if it.type == WriteItemType.BYTE_IO:
                    inline[item_key(it.index)] = data.getvalue()
                else:
                    tensors[item_key(it.index)] = data
            os.makedirs(tmp, exist_ok=True)
            if tensors:
                sw = self.writer.write_stripes(tensors, tmp, t0, prefix=stripe_prefix(rank))
                sw.job.wait_staged()
                sw.job.release_sources()
        except BaseException as e:  # noqa: BLE001 - agreed on below, then raised
            error = e
        # Every rank learns whether every rank staged, so a failure raises on all of
        # them here instead of leaving the others waiting in DCP's collectives.
        texts = exchange(None if error is None else f"{type(error).__name__}: {error}"[:2000])
        failed = {r: t for r, t in enumerate(texts) if t is not None}
        if failed:
            if sw is not None:
                sw.job.cancel()
                sw.job.wait()
            if rank == 0:
                commit.discard(tmp)
            if error is not None:
                raise error
            raise FlashwriteError("staging failed on " + "; ".join(f"rank {r}: {t}" for r, t in failed.items()))
        self._pending.append(_Staged(final, tmp, sw, owner, set(tensors), inline, t0))
        return _copy_containers(state_dict)

    def _copy_stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Fallback staging when the path is not known yet: copy into cached host buffers."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._copy_cache is None:
            self._copy_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._copy_cache)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage()`` returns once staged."""

    def close(self) -> None:
        self._copy_cache = None
        while self._pending:
            st = self._pending.popleft()
            if st.sw is not None:
                st.sw.job.cancel()
                st.sw.job.wait()

    # ------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # The first call of every save (DCP calls reset() only when given a checkpoint_id).
        self._current = self._pending.popleft() if self._pending else None
        self._tmp = None
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else _rank_and_size()[0]
        self._use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not getattr(self, "_use_collectives", True):
            raise NotImplementedError("FlashwriteStorageWriter needs use_collectives=True (one committed checkpoint)")
        if self.path is None:
            raise ValueError("no checkpoint path: pass it to FlashwriteStorageWriter or as checkpoint_id")
        cur = self._current
        if cur is not None and cur.final != self.path:
            raise ValueError(f"stage() wrote into a temporary directory for {cur.final}, but this save is for "
                             f"{self.path}: create one FlashwriteStorageWriter per checkpoint path")
        return dataclasses.replace(plan, storage_data=_LocalData(self.rank, cur.tmp if cur else None))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        staged = {p.storage_data.staged_tmp for p in plans}
        if len(staged) != 1:
            raise FlashwriteError("some ranks staged this save and others did not")
        tmp = staged.pop()
        final = self.path
        with _unfinished_lock:
            for old in _unfinished.pop(final, set()) - {tmp}:
                commit.discard(old)
        if tmp is None:
            tmp = commit.prepare(final, self.overwrite)
        else:
            commit.check_target(final, self.overwrite)
        with _unfinished_lock:
            _unfinished[final].add(tmp)
        if self._current is not None:
            plans = self._move_to_owners(plans, self._current.owner)
        return [dataclasses.replace(p, storage_data=_GlobalData(tmp, stripe_prefix(i))) for i, p in enumerate(plans)]

    @staticmethod
    def _move_to_owners(plans: list[SavePlan], owner: dict[MetadataIndex, int]) -> list[SavePlan]:
        """DCP's planner dedups replicated items by its own rule; staging already wrote
        each where ``owner`` says, so the plans follow the staging."""
        items: list[list] = [[] for _ in plans]
        for i, p in enumerate(plans):
            for it in p.items:
                items[owner.get(it.index, i)].append(it)
        return [dataclasses.replace(p, items=its) for p, its in zip(plans, items)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        g: _GlobalData = plan.storage_data
        self._tmp = g.tmp
        cur, self._current = self._current, None
        sw = None
        try:
            if cur is not None:
                sw, inline = cur.sw, dict(cur.inline)
                want = {item_key(it.index) for it in plan.items}
                have = cur.tensor_keys | set(inline)
                if want != have:
                    diff = sorted(want ^ have)[:5]
                    raise FlashwriteError(f"rank {self.rank}: DCP's plan differs from what stage() snapshotted "
                                          f"(e.g. {diff}); async_save with this writer needs DCP's default planner")
            else:
                tensors, inline = {}, {}
                for it in plan.items:
                    data = planner.resolve_data(it)
                    if it.type == WriteItemType.BYTE_IO:
                        inline[item_key(it.index)] = data.getvalue()
                    else:
                        tensors[item_key(it.index)] = data
                if tensors:
                    sw = self.writer.write_stripes(tensors, g.tmp, time.perf_counter(), prefix=g.prefix)
            stored: dict[str, _Stored] = {}
            if sw is not None:
                sw.job.wait_staged()
                sw.job.release_sources()
                local = sw.wait_durable()
                self.last_stats = sw.stats
                stored = _stored_entries(local)
            results = []
            for it in plan.items:
                key = item_key(it.index)
                if it.type == WriteItemType.BYTE_IO:
                    data = inline[key]
                    results.append(WriteResult(index=it.index, size_in_bytes=len(data), storage_data=_Inline(key, data)))
                else:
                    s = stored[key]
                    results.append(WriteResult(index=it.index, size_in_bytes=s.nbytes, storage_data=s))
        except BaseException:
            if sw is not None and not sw.job.done:
                sw.job.cancel()
                sw.job.wait()
            if sw is not None:
                for f in sw.files:
                    try:
                        os.unlink(os.path.join(g.tmp, f.name))
                    except OSError:
                        pass
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tmp, final = self._tmp, self.path
        try:
            manifest = build_dcp_manifest(metadata, results, self.storage_meta())
            parse_manifest(json.dumps(manifest).encode())  # what a reader will check, before it is visible
            commit.finalize(tmp, final, manifest, build_index(manifest), self.overwrite)
        except BaseException:
            commit.discard(tmp)
            raise
        finally:
            with _unfinished_lock:
                _unfinished.get(final, set()).discard(tmp)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        s = os.fspath(checkpoint_id)
        return isinstance(s, str) and "://" not in s


def _stored_entries(local: dict) -> dict[str, _Stored]:
    files = local["files"]
    block = local["checksum"]["block_bytes"]
    out = {}
    for key, t in local["tensors"].items():
        f = files[t["file"]]
        out[key] = _Stored(key, f["name"], f["size"], f["header_bytes"], t["offset"], t["nbytes"], t["dtype"],
                           tuple(t["shape"]), t["device"], tuple(t["checksums"]), block, local["writer_version"])
    for alias, canon in local["aliases"].items():
        out[alias] = dataclasses.replace(out[canon], key=alias, alias_of=canon)
    return out


# ------------------------------------------------------------------ the dcp section

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
        "section_version": DCP_SECTION_VERSION,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": ptree,
        "storage_meta": {"checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
                         "save_id": sm.save_id, "modules": list(sm.modules or [])},
        "index": index,
    }


def build_dcp_manifest(metadata: Metadata, results: list[list[WriteResult]], storage_meta: StorageMeta | None) -> dict:
    """The global flashwrite manifest of a DCP checkpoint, from every rank's WriteResults."""
    stored: dict[str, _Stored] = {}
    inline: dict[str, bytes] = {}
    index = []
    for wr in (wr for rank_results in results for wr in rank_results):
        sd = wr.storage_data
        if isinstance(sd, _Inline):
            inline[sd.key] = sd.data
        elif isinstance(sd, _Stored):
            stored[sd.key] = sd
        else:
            raise FlashwriteError(f"unexpected storage data {type(sd).__name__} for {wr.index}")
        off = None if wr.index.offset is None else [int(o) for o in wr.index.offset]
        index.append([wr.index.fqn, off, sd.key])
    if len({(s.block_bytes, s.writer_version) for s in stored.values()}) > 1:
        raise FlashwriteError("ranks wrote with different flashwrite versions or chunk_bytes")
    canon = {k: s for k, s in stored.items() if s.alias_of is None}
    names = sorted({s.file: (s.file_size, s.header_bytes) for s in canon.values()}.items())
    file_idx = {name: i for i, (name, _) in enumerate(names)}
    any_s = next(iter(canon.values()), None)
    tensors = {k: {"file": file_idx[s.file], "offset": s.offset, "nbytes": s.nbytes, "dtype": s.dtype,
                   "shape": list(s.shape), "device": s.device, "checksums": list(s.checksums)}
               for k, s in sorted(canon.items())}
    items = [[{"t": "str", "v": k}, {"t": "tensor", "k": stored[k].alias_of or k}] for k in sorted(stored)]
    items += [[{"t": "str", "v": k}, {"t": "bytes", "v": base64.b64encode(v).decode()}] for k, v in sorted(inline.items())]
    return {
        "format": "flashwrite",
        "format_version": FORMAT_VERSION,
        "writer_version": any_s.writer_version if any_s else "",
        "created_unix": time.time(),
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": any_s.block_bytes if any_s else 1 << 20},
        "files": [{"name": n, "size": sz, "header_bytes": hb} for n, (sz, hb) in names],
        "tensors": tensors,
        "aliases": {k: s.alias_of for k, s in sorted(stored.items()) if s.alias_of},
        "tree": {"t": "dict", "items": items},
        "metadata": {},
        "dcp": _encode_metadata(metadata, storage_meta, index),
    }


def _decode_metadata(d: Any, manifest: Any) -> Metadata:
    bad = lambda msg: CorruptCheckpointError(f"manifest: dcp: {msg}", file=MANIFEST_NAME)  # noqa: E731
    if not isinstance(d, dict) or d.get("section_version") != DCP_SECTION_VERSION:
        raise bad(f"section version {str(d.get('section_version') if isinstance(d, dict) else d)[:20]!r} "
                  f"is not supported (this flashwrite reads {DCP_SECTION_VERSION})")

    def ints(v: Any, what: str) -> list[int]:
        if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise bad(f"{what} must be a list of non-negative integers")
        return v

    sdm: dict[str, Any] = {}
    raw = d.get("state_dict_metadata")
    if not isinstance(raw, dict):
        raise bad("state_dict_metadata must be an object")
    for fqn, m in raw.items():
        if not isinstance(m, dict):
            raise bad(f"{fqn!r} is not an object")
        if m.get("type") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if m.get("type") != "tensor":
            raise bad(f"{fqn!r} has unknown type")
        try:
            dt = dtypes.dtype_from_name(m.get("dtype"))
        except ValueError as e:
            raise bad(f"{fqn!r}: {e}") from None
        mf = _MEMORY_FORMATS.get(m.get("memory_format"))
        if mf is None:
            raise bad(f"{fqn!r}: unknown memory format")
        size = ints(m.get("size"), f"{fqn}.size")
        chunks = m.get("chunks")
        if not isinstance(chunks, list):
            raise bad(f"{fqn!r}: chunks must be a list")
        cs = []
        for c in chunks:
            if not isinstance(c, list) or len(c) != 2:
                raise bad(f"{fqn!r}: a chunk must be [offsets, sizes]")
            off, sz = ints(c[0], f"{fqn}.chunk.offsets"), ints(c[1], f"{fqn}.chunk.sizes")
            if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                raise bad(f"{fqn!r}: chunk {off}+{sz} does not fit in {size}")
            cs.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
        props = TensorProperties(dtype=dt, layout=torch.strided, requires_grad=bool(m.get("requires_grad")),
                                 memory_format=mf, pin_memory=bool(m.get("pin_memory")))
        sdm[fqn] = TensorStorageMetadata(props, torch.Size(size), cs)

    inline: dict[str, bytes] = {}
    tree = manifest.tree
    if not isinstance(tree, dict) or tree.get("t") != "dict" or not isinstance(tree.get("items"), list):
        raise bad("the tree of a DCP checkpoint must be a flat dict")
    for it in tree["items"]:
        if isinstance(it, list) and len(it) == 2 and isinstance(it[1], dict) and it[1].get("t") == "bytes":
            key = it[0].get("v") if isinstance(it[0], dict) else None
            try:
                inline[key] = base64.b64decode(it[1].get("v"), validate=True)
            except (ValueError, TypeError):
                raise bad(f"inline item {str(key)[:80]!r} is not base64") from None

    storage_data: dict[MetadataIndex, Any] = {}
    block = manifest.block_bytes
    index = d.get("index")
    if not isinstance(index, list):
        raise bad("index must be a list")
    for row in index:
        if not isinstance(row, list) or len(row) != 3 or not isinstance(row[0], str) or not isinstance(row[2], str):
            raise bad("index rows must be [fqn, offsets, key]")
        fqn, off, key = row
        if off is not None:
            off = ints(off, f"{fqn}.offset")
        mi = MetadataIndex(fqn, off)
        if key in inline:
            storage_data[mi] = _Inline(key, inline[key])
            continue
        canon = manifest.aliases.get(key, key)
        e = manifest.tensors.get(canon)
        if e is None:
            raise bad(f"index names unknown item {key!r}")
        fe = manifest.files[e.file]
        storage_data[mi] = _Stored(canon, fe.name, fe.size, fe.header_bytes, e.offset, e.nbytes, e.dtype, e.shape,
                                   e.device, e.checksums, block, manifest.writer_version,
                                   None if canon == key else canon)
    sm = d.get("storage_meta") if isinstance(d.get("storage_meta"), dict) else {}
    modules = sm.get("modules") if isinstance(sm.get("modules"), list) else []
    storage_meta = StorageMeta(checkpoint_id=sm.get("checkpoint_id") if isinstance(sm.get("checkpoint_id"), str)
                               else None, save_id=sm.get("save_id") if isinstance(sm.get("save_id"), str) else None,
                               modules=[m for m in modules if isinstance(m, str)])
    version = d.get("version")
    def no_tensors(key: str) -> Any:
        raise bad("planner_data refers to a tensor")

    planner_data = unflatten(d.get("planner_data"), no_tensors)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data,
                    storage_meta=storage_meta, version=version if isinstance(version, str) else None)


class FlashwriteStorageReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by ``FlashwriteStorageWriter``.

    Reads with the native engine (O_DIRECT, many requests in flight), verifying
    every chunk's checksums (verify=False skips that), whole stripe files at a time,
    at most about ``max_read_bytes`` of them in host memory at once.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, verify: bool = True, backend: str = "auto",
                 direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH, max_read_bytes: int = DEFAULT_MAX_READ_BYTES):
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.verify = verify
        self.backend = backend
        self.direct = direct
        self.queue_depth = queue_depth
        self.max_read_bytes = max_read_bytes
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("no checkpoint path: pass it to FlashwriteStorageReader or as checkpoint_id")
        m = read_manifest(self.path)
        if "dcp" not in m.raw:
            raise CorruptCheckpointError(f"{self.path} was not written through DCP (no dcp section): load it "
                                         "with flashwrite.load", file=MANIFEST_NAME)
        md = _decode_metadata(m.raw["dcp"], m)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        by_file: dict[str, list] = {}
        sizes: dict[str, int] = {}
        for req in plan.items:
            sd = self.storage_data[req.storage_index]
            if isinstance(sd, _Inline):
                if req.type != LoadItemType.BYTE_IO:
                    raise CorruptCheckpointError(f"{req.storage_index.fqn} is stored as bytes, asked for as a tensor")
                planner.load_bytes(req, io.BytesIO(sd.data))
                continue
            by_file.setdefault(sd.file, []).append((req, sd))
            sizes[sd.file] = sd.file_size
        if by_file:
            # One manifest read per call, and every batch read through the same directory handle.
            with CheckpointDir(self.path) as ck:
                batch: list[str] = []
                held = 0
                for name in sorted(by_file):
                    if batch and held + sizes[name] > self.max_read_bytes:
                        self._read_batch(ck, batch, by_file, planner, narrow_tensor_by_index)
                        batch, held = [], 0
                    batch.append(name)
                    held += sizes[name]
                if batch:
                    self._read_batch(ck, batch, by_file, planner, narrow_tensor_by_index)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_batch(self, ck: CheckpointDir, names: list[str], by_file: dict, planner: LoadPlanner,
                    narrow: Any) -> None:
        keys = {sd.alias_of or sd.key for n in names for _, sd in by_file[n]}
        res = ck.read(keys=keys, verify=self.verify, backend=self.backend, direct=self.direct,
                      queue_depth=self.queue_depth)
        for n in names:
            for req, sd in by_file[n]:
                src = narrow(res.tensors[sd.alias_of or sd.key], req.storage_offsets, req.lengths)
                dst = planner.resolve_tensor(req).detach()
                if dst.size() != src.size():
                    raise CorruptCheckpointError(f"{req.storage_index.fqn}: stored chunk gives {tuple(src.size())}, "
                                                 f"the destination wants {tuple(dst.size())}", file=sd.file)
                dst.copy_(src)
                planner.commit_tensor(req, dst)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            return os.path.isfile(os.path.join(os.fspath(checkpoint_id), MANIFEST_NAME))
        except TypeError:
            return False

