"""DCP ``StorageWriter`` (and ``AsyncStager``) writing through flashwrite's native engine.

See the package doc (``flashwrite.dcp``) for what lands on disk and how
``stage()`` snapshots for ``dcp.async_save``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ...saving import commit
from ...saving.distributed import failure_text, settle_failure
from ...system.coord import coordinator
from ...errors import FlashwriteError
from ...format import build_index, parse_manifest
from ...future import SaveStats
from ...layout.plan import rank_prefix
from ...saving.save import default_writer
from ...saving.session import Commit, SaveSession
from ...targets.locate import kind_of, resolve
from ...targets.target import Target, check_path, shown
from ...saving.write import StripeWrite
from . import contract, replica_check
from .replica_check import replicated_keys
from ...incremental.wiring import Wiring
from .section import InlineItem, StoredChunk, as_ranks_base, build_manifest, item_key, stored_chunks

__all__ = ["FlashwriteStorageWriter"]


@dataclasses.dataclass(frozen=True)
class _LocalData:
    rank: int
    staged_tmp: str | None
    check: bool = False      # check_replicas, and the rank's tensor item keys for it
    keys: tuple = ()


@dataclasses.dataclass(frozen=True)
class _GlobalData:
    tmp: str
    rank: int        # whose plan this is (its stripes are named rank_prefix(rank)-...)
    world_size: int
    compare: frozenset | None = None  # check_replicas: the item keys several ranks hold


@dataclasses.dataclass
class _Staged:
    """One ``stage()``: the native save already running for this rank's items."""

    final: str
    tmp: str
    session: SaveSession  # its life cycle, up to durable (DCP's finish commits)
    sw: StripeWrite | None  # None when this rank has no tensor to write
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


def _stage(session: SaveSession, writer: Any, tensors: dict[str, Any], rank: int, size: int) -> StripeWrite:
    """Start this rank's write of ``tensors``; with a Writer(incremental=True) its
    stripes that did not change since the newest committed DCP checkpoint beside the
    target (saved by as many ranks) are linked from that checkpoint's part of this rank
    (``incremental.Planner``; SaveStats.incremental says what happened)."""
    wiring = None
    if getattr(writer, "incremental", False):
        if not session.strategy.target.scannable:
            wiring = Wiring.refuse("off: DCP saves to nfs:// are not incremental yet (the save writes every stripe)")
        elif not hasattr(writer, "incremental_wiring"):
            wiring = Wiring.refuse(f"off: {type(writer).__name__} has no incremental planner (the save writes every stripe)")
        else:
            wiring = writer.incremental_wiring(view=as_ranks_base, rank=(rank, size))
    return session.stage(tensors, prefix=rank_prefix(rank), incremental=wiring)


def _resolve_items(planner: SavePlanner, items: list) -> tuple[dict[str, Any], dict[str, bytes]]:
    """DCP's write items resolved to their data, by item key: (tensors to stage, bytes kept inline)."""
    tensors, inline = {}, {}
    for it in items:
        data = planner.resolve_data(it)
        if it.type == WriteItemType.BYTE_IO:
            inline[item_key(it.index)] = data.getvalue()
        else:
            tensors[item_key(it.index)] = data
    return tensors, inline


def _chunk_bytes(item: Any) -> int:
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * torch._utils._element_size(item.tensor_data.properties.dtype)


class DcpCommit(Commit):
    """The commit strategy of a DCP save: the stripes go into the directory every rank
    agreed on; DCP's ``finish`` (on the coordinator) commits the manifest it built from
    every rank's results."""

    def __init__(self, final: str, tmp: str, overwrite: bool, target: Target):
        super().__init__(final, target)
        self.tmp, self.overwrite = tmp, overwrite

    def prepare(self) -> str:
        self.target.make_dirs(self.tmp)  # every rank: the name is agreed, so whoever comes first creates it
        return self.tmp

    def abandon(self, error: BaseException) -> None:
        """Nothing to undo here: the ranks agree on a failure (stage) or DCP reports it, and
        the next save removes the directory."""

    def discard(self) -> None:
        commit.discard(self.tmp, self.target)

    def commit(self, sw: StripeWrite | None, manifest: dict) -> SaveStats | None:
        try:
            parse_manifest(json.dumps(manifest).encode())  # what a reader will check, before it is visible
            contract.check_target(self.final, self.overwrite, self.target)  # DCP's rule; finalize then replaces
            commit.finalize(self.tmp, self.final, manifest, build_index(manifest), True, target=self.target)
        except BaseException:
            self.discard()
            raise
        return sw.stats if sw is not None else None


class FlashwriteStorageWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` (and ``AsyncStager``) writing through flashwrite's native engine.

    path: the checkpoint directory (or pass ``checkpoint_id`` to dcp.save); a local path or
    an nfs:// URL (the stripes then go from the staging pool straight to the server, as a
    ``flashwrite.save`` to it does).
    overwrite: DCP's contract, as torch's ``FileSystemWriter``: True by default, the
    checkpoint at the path is replaced atomically (the earlier one stays whole until the
    new one is committed); with False a checkpoint there is refused with DCP's own
    "Checkpoint already exists" error (a ``RuntimeError`` and a ``CheckpointExistsError``)
    and an empty directory is written into. Unlike the rest of flashwrite (``save``,
    ``Writer.save``, ``CheckpointManager.save`` default to False), since code written for
    DCP saves to one path again and again. See ``flashwrite.dcp.contract``.
    writer: a ``flashwrite.Writer`` to use; otherwise the shared one for ``writer_options``
    (stripes, queue_depth, chunk_bytes, backend, direct, max_staging_bytes, copy_threads; incremental:
    link the stripes that did not change, see ``flashwrite.dcp``).
    process_group: the group passed to ``dcp.async_save`` (default: the default group);
    ``stage()`` agrees with its ranks, on flashwrite's own gloo group for them
    (``coordination_group`` for a subgroup, see ``flashwrite.system.coord.coordinator``).
    timeout: seconds a rank waits for its peers in that exchange.
    check_replicas: check that ranks holding the same item (DDP's tensors, HSDP's
    replicated shards, which DCP writes once) hold the same bytes, from digests only, and
    fail the save on every rank with ``DivergedReplicasError`` before anything is written
    when they do not (``integrations/dcp/replica_check.py``). Off by default: it hashes
    the replicated bytes on every holder and costs one collective. Every rank must set it alike.
    """

    _synchronize_after_execute = False  # stage() returns only once staged

    def __init__(self, path: str | os.PathLike | None = None, *, overwrite: bool = True, writer: Any = None,
                 process_group: Any = None, coordination_group: Any = None, timeout: float | None = None,
                 check_replicas: bool = False, **writer_options: Any):
        super().__init__()
        self._fixed_path = shown(check_path(path, "DCP writer")) if path is not None else None
        self.path: str | None = self._fixed_path
        self.overwrite = overwrite
        self.writer = writer if writer is not None else default_writer(**writer_options)
        self.timeout = timeout
        self.process_group = process_group
        self.coordination_group = coordination_group
        self.check_replicas = check_replicas
        self._local_items: list = []  # this rank's plan before DCP's dedup (check_replicas)
        self.save_id = uuid.uuid4().hex
        self._targets: dict[str, tuple[Target, str]] = {}
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: Any = None
        self._pending: collections.deque[_Staged] = collections.deque()
        self._current: _Staged | None = None
        self._copy_cache: Any = None
        self._tmp: str | None = None
        self._use_collectives = True  # set_up_storage_writer says

    # ------------------------------------------------------------ AsyncStager

    def _resolved(self, path: str) -> tuple[Target, str]:
        """(target, the checkpoint's name there) of ``path``, resolved once per path."""
        if path not in self._targets:
            self._targets[path] = resolve(path, "DCP writer")
        return self._targets[path]

    def __reduce__(self) -> Any:
        # DCP's process executor pickles the writer; the staged saves and the Writer live in this process.
        raise TypeError(f"cannot pickle {type(self).__name__}: {contract.PROCESS_MESSAGE}")

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        contract.refuse_process_executor()  # before anything is staged
        if self._fixed_path is None:
            return self._copy_stage(state_dict)
        t0 = time.perf_counter()
        coord = None
        rank, size = 0, 1
        if dist.is_available() and dist.is_initialized():
            coord = coordinator(self.process_group, self.timeout, self.coordination_group)
            rank, size = coord.rank, coord.size
        target, final = self._resolved(self._fixed_path)
        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, None, rank == 0)
        local = planner.create_local_plan()
        mine_sizes = [(it.index, _chunk_bytes(it)) for it in local.items]
        proposal = commit.temp_dir_for(final)
        refuse = contract.target_problem(final, self.overwrite, target)

        def exchange(obj: Any) -> list:
            if coord is None:
                return [obj]
            out: list = [None] * size
            coord.run(dist.all_gather_object, out, obj, group=coord.group).result()
            return out

        gathered = exchange((mine_sizes, final, proposal, refuse))
        if len({g[1] for g in gathered}) != 1:
            raise ValueError(f"ranks stage into different paths: {sorted({g[1] for g in gathered})}")
        contract.raise_problem(gathered[0][3], final, target)
        owner = _assign_owners([g[0] for g in gathered])
        if self.check_replicas:  # every rank raises alike, before anything is staged
            compare = replicated_keys([[item_key(idx) for idx, _ in g[0]] for g in gathered])
            ranks = dist.get_process_group_ranks(coord.group) if coord is not None else [0]
            replica_check.check(local.items, planner, compare, exchange, ranks)
        tmp = gathered[0][2]
        sw, tensors, inline, error = None, {}, {}, None
        try:
            tensors, inline = _resolve_items(planner, [it for it in local.items if owner[it.index] == rank])
            session = SaveSession(self.writer, DcpCommit(final, tmp, self.overwrite, target), None, t0)
            if tensors:
                sw = _stage(session, self.writer, tensors, rank, size)
                session.wait_staged()
            else:
                session.strategy.prepare()
        except BaseException as e:  # noqa: BLE001 - agreed on below, then raised
            error = e
        # Every rank learns whether every rank staged, so a failure raises on all of
        # them here instead of leaving the others waiting in DCP's collectives; then the
        # failure agreement of every multi-rank save (whose exchange is also the point after
        # which no rank writes, so rank 0 removes the directory only then).
        if any(t is not None for t in exchange(failure_text(error))):
            settle_failure(exchange, rank, sw, error, lambda: commit.discard(tmp, target), final)
        self._pending.append(_Staged(self._fixed_path, tmp, session, sw, owner, set(tensors), inline, t0))
        return _copy_containers(state_dict)

    def _copy_stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Fallback staging when the path is not known yet: copy into cached host buffers."""
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
                st.sw.stop()

    # ------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = shown(check_path(checkpoint_id, "DCP writer"))
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # The first call of every save (DCP calls reset() only when given a checkpoint_id).
        self._current = self._pending.popleft() if self._pending else None
        self._tmp = None
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else _rank_and_size()[0]
        self._use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self._use_collectives:
            raise NotImplementedError("FlashwriteStorageWriter needs use_collectives=True (one committed checkpoint)")
        if self.path is None:
            raise ValueError("no checkpoint path: pass it to FlashwriteStorageWriter or as checkpoint_id")
        cur = self._current
        if cur is not None and cur.final != self.path:
            raise ValueError(f"stage() wrote into a temporary directory for {cur.final}, but this save is for "
                             f"{self.path}: create one FlashwriteStorageWriter per checkpoint path")
        check = self.check_replicas and cur is None  # a staged save was checked in stage()
        self._local_items = list(plan.items) if check else []
        keys = tuple(item_key(it.index) for it in plan.items if it.tensor_data is not None) if check else ()
        return dataclasses.replace(plan, storage_data=_LocalData(self.rank, cur.tmp if cur else None, check, keys))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        staged = {p.storage_data.staged_tmp for p in plans}
        if len(staged) != 1:
            raise FlashwriteError("some ranks staged this save and others did not")
        tmp = staged.pop()
        checks = {p.storage_data.check for p in plans}
        if len(checks) != 1:
            raise FlashwriteError("some ranks' FlashwriteStorageWriter has check_replicas=True and others' not")
        compare = frozenset(replicated_keys([p.storage_data.keys for p in plans])) if checks.pop() else None
        target, final = self._resolved(self.path)
        with _unfinished_lock:
            for old in _unfinished.pop(self.path, set()) - {tmp}:
                commit.discard(old, target)
        contract.check_target(final, self.overwrite, target)
        if tmp is None:
            tmp = commit.prepare(final, True, target)  # DCP's rule checked above
        with _unfinished_lock:
            _unfinished[self.path].add(tmp)
        if self._current is not None:
            plans = self._move_to_owners(plans, self._current.owner)
        return [dataclasses.replace(p, storage_data=_GlobalData(tmp, i, len(plans), compare))
                for i, p in enumerate(plans)]

    @staticmethod
    def _move_to_owners(plans: list[SavePlan], owner: dict[MetadataIndex, int]) -> list[SavePlan]:
        """DCP's planner dedups replicated items by its own rule; staging already wrote
        each where ``owner`` says, so the plans follow the staging."""
        items: list[list] = [[] for _ in plans]
        for i, p in enumerate(plans):
            for it in p.items:
                items[owner.get(it.index, i)].append(it)
        return [dataclasses.replace(p, items=its) for p, its in zip(plans, items)]

    def _check_replicas(self, items: list, planner: SavePlanner, compare: frozenset) -> None:
        coord = coordinator(self.process_group, self.timeout, self.coordination_group)

        def gather(obj: Any) -> list:
            out: list = [None] * coord.size
            coord.run(dist.all_gather_object, out, obj, group=coord.group).result()
            return out

        replica_check.check(items, planner, set(compare), gather, dist.get_process_group_ranks(coord.group))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        g: _GlobalData = plan.storage_data
        self._tmp = g.tmp
        cur, self._current = self._current, None
        sw, session = None, None
        if g.compare is not None:  # every rank, before anything is written
            self._check_replicas(self._local_items, planner, g.compare)
        try:
            if cur is not None:
                session, sw, inline = cur.session, cur.sw, dict(cur.inline)
                want = {item_key(it.index) for it in plan.items}
                have = cur.tensor_keys | set(inline)
                if want != have:
                    diff = sorted(want ^ have)[:5]
                    raise FlashwriteError(f"rank {self.rank}: DCP's plan differs from what stage() snapshotted "
                                          f"(e.g. {diff}); async_save with this writer needs DCP's default planner")
            else:
                tensors, inline = _resolve_items(planner, plan.items)
                if tensors:
                    target, final = self._resolved(self.path)
                    session = SaveSession(self.writer, DcpCommit(final, g.tmp, self.overwrite, target), None,
                                          time.perf_counter())
                    sw = _stage(session, self.writer, tensors, g.rank, g.world_size)
            stored: dict[str, StoredChunk] = {}
            if session is not None and sw is not None:
                part = session.durable()
                self.last_stats = sw.stats
                stored = stored_chunks(part)
            results = []
            for it in plan.items:
                key = item_key(it.index)
                if it.type == WriteItemType.BYTE_IO:
                    data = inline[key]
                    results.append(WriteResult(index=it.index, size_in_bytes=len(data),
                                               storage_data=InlineItem(key, data)))
                else:
                    s = stored[key]
                    results.append(WriteResult(index=it.index, size_in_bytes=s.length, storage_data=s))
        except BaseException:
            if sw is not None and session is not None:
                sw.stop()
                for f in sw.files:
                    try:
                        session.strategy.target.remove_file(os.path.join(g.tmp, f.name))
                    except OSError:
                        pass
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tmp = self._tmp
        try:
            target, final = self._resolved(self.path)
            strategy = DcpCommit(final, tmp, self.overwrite, target)
            try:
                manifest = build_manifest(metadata, results, self.storage_meta())
            except BaseException:
                strategy.discard()
                raise
            strategy.commit(None, manifest)
        finally:
            with _unfinished_lock:
                _unfinished.get(self.path, set()).discard(tmp)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        s = os.fspath(checkpoint_id)
        try:
            return isinstance(s, str) and kind_of(s, "DCP writer") is not None
        except ValueError:  # a URL of a scheme flashwrite does not handle
            return False
