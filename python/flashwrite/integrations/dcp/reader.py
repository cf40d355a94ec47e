"""DCP ``StorageReader`` for checkpoints written by ``FlashwriteStorageWriter``."""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ... import defaults
from ...errors import ChecksumMismatchError, CorruptCheckpointError
from ...format import MANIFEST_NAME
from ...loading.read import CheckpointDir
from ...targets.locate import Located, kind_of, locate
from ...targets.target import check_path
from . import read_once
from .section import InlineItem, StoredChunk, decode_metadata

__all__ = ["FlashwriteStorageReader", "DEFAULT_MAX_READ_BYTES"]

DEFAULT_MAX_READ_BYTES = 4 << 30  # host memory one read_data batch may hold


class FlashwriteStorageReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by ``FlashwriteStorageWriter``.

    Reads with the native engine (O_DIRECT, many requests in flight), verifying
    every chunk's checksums (verify=False skips that), whole stripe files at a time,
    at most about ``max_read_bytes`` of them in host memory at once. ``path`` may be an
    nfs:// URL: the manifest is fetched, the stripes are read from the server (as
    ``flashwrite.load`` of it does).

    read_once (default on): in a multi-rank load where several ranks' plans need the same
    stripe (a DDP model saved through DCP, an HSDP restart, a reshard), each stripe is
    read from storage by one of them and sent to the others over a gloo group of the
    load's ranks, verified where it lands (``integrations/dcp/read_once.py``). The ranks
    are those of ``process_group``: pass the group you pass to ``dcp.load`` (default: the
    world; a load whose plans do not match it reads as without read_once). timeout: the
    exchange's, in seconds (default flashwrite's coordination timeout); a peer lost
    mid-exchange raises ``DistributedLoadError`` on the others.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, verify: bool = True, backend: str = "auto",
                 direct: bool = True, queue_depth: int = defaults.READ_QUEUE_DEPTH, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                 read_once: bool = True, process_group: Any = None, timeout: float | None = None):
        super().__init__()
        self.path = None if path is None else check_path(path, "DCP reader")
        self._where: Located | None = None
        self.verify = verify
        self.backend = backend
        self.direct = direct
        self.queue_depth = queue_depth
        self.max_read_bytes = max_read_bytes
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.read_once = read_once
        self.process_group = process_group
        self.timeout = timeout
        self._sizes: dict[str, int] = {}      # stripe name -> bytes (read_metadata, on every rank)
        self._aliases: dict[str, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = check_path(checkpoint_id, "DCP reader")
            self._where = None
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("no checkpoint path: pass it to FlashwriteStorageReader or as checkpoint_id")
        m = self._located().read_manifest("DCP reader")
        if "dcp" not in m.raw:
            raise CorruptCheckpointError(f"{self.path} was not written through DCP (no dcp section): load it "
                                         "with flashwrite.load", file=MANIFEST_NAME)
        md = decode_metadata(m.raw["dcp"], m)
        self._sizes = {f.name: f.size for f in m.files}
        self._aliases = dict(m.aliases)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not (self.read_once and len(plans) > 1 and dist.is_available() and dist.is_initialized()
                and len(plans) == dist.get_world_size(self._group())):
            return plans
        return read_once.schedule(plans, self.storage_data, self._aliases, self._sizes, self.max_read_bytes)

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sched = plan.storage_data.get(read_once.PLAN_KEY) if isinstance(plan.storage_data, dict) else None
        by_file: dict[str, list[tuple[Any, StoredChunk]]] = {}
        for req in plan.items:
            sd = self.storage_data[req.storage_index]
            if isinstance(sd, InlineItem):
                if req.type != LoadItemType.BYTE_IO:
                    raise CorruptCheckpointError(f"{req.storage_index.fqn} is stored as bytes, asked for as a tensor")
                planner.load_bytes(req, io.BytesIO(sd.data))
                continue
            by_file.setdefault(sd.file, []).append((req, sd))
        if sched is not None:  # every rank takes part in the exchange, needing a stripe or not
            self._read_once(sched, by_file, planner)
        elif by_file:
            # One manifest read per call, and every batch read through the same directory handle.
            where = self._located()
            with CheckpointDir(where if not where.target.os_paths else where.given, what="DCP reader") as ck:
                sizes = {fe.name: fe.size for fe in ck.manifest.files}
                batch: list[str] = []
                held = 0
                for name in sorted(by_file):
                    if batch and held + sizes[name] > self.max_read_bytes:
                        self._read_batch(ck, batch, by_file, planner)
                        batch, held = [], 0
                    batch.append(name)
                    held += sizes[name]
                if batch:
                    self._read_batch(ck, batch, by_file, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_batch(self, ck: CheckpointDir, names: list[str], by_file: dict, planner: LoadPlanner) -> None:
        aliases = ck.manifest.aliases
        keys = {aliases.get(sd.key, sd.key) for n in names for _, sd in by_file[n]}
        res = ck.read(keys=keys, verify=self.verify, backend=self.backend, direct=self.direct,
                      queue_depth=self.queue_depth)
        self._apply([pair for n in names for pair in by_file[n]], res.tensors, aliases, planner)

    def _read_once(self, sched: dict, by_file: dict, planner: LoadPlanner) -> None:
        """Read the stripes this rank was given, round by round, and exchange (read_once.py)."""
        what = f"DCP load of {self.path}"
        group = read_once.exchange_group(self._group(), self.timeout)
        where = self._located()
        with CheckpointDir(where if not where.target.os_paths else where.given, what="DCP reader") as ck:
            m = ck.manifest
            for files in sched["rounds"]:
                keys = {k for f in files if sched["reader"][f] == sched["me"] for ks in sched["needs"][f].values()
                        for k in ks}
                have: dict[str, Any] = {}
                error = None
                try:
                    if keys:
                        have = dict(ck.read(keys=keys, verify=self.verify, backend=self.backend, direct=self.direct,
                                            queue_depth=self.queue_depth).tensors)
                except Exception as e:  # noqa: BLE001 - agreed on below, then raised on this rank
                    error = e
                read_once.agree(group, error, what)
                bad = None
                try:
                    got = read_once.exchange(group, sched, files, m, have, self.verify, what, str(self.path))
                except ChecksumMismatchError as e:  # what a peer sent differs from the manifest: every rank fails
                    bad, got = e, {}
                read_once.agree(group, bad, what, "check what they received")
                have.update(got)
                need = {k for f in files for k in sched["needs"][f].get(sched["me"], ())}
                have.update(read_once.empty_tensors(need - have.keys(), m))
                self._apply([pair for f in files for pair in by_file.get(f, ())], have, m.aliases, planner)

    @staticmethod
    def _apply(pairs: list, tensors: dict, aliases: dict, planner: LoadPlanner) -> None:
        """Each read item's slice of its stored chunk, copied into the planner's tensor."""
        for req, sd in pairs:
            src = narrow_tensor_by_index(tensors[aliases.get(sd.key, sd.key)], req.storage_offsets, req.lengths)
            dst = planner.resolve_tensor(req).detach()
            if dst.size() != src.size():
                raise CorruptCheckpointError(f"{req.storage_index.fqn}: stored chunk gives {tuple(src.size())}, "
                                             f"the destination wants {tuple(dst.size())}", file=sd.file)
            dst.copy_(src)
            planner.commit_tensor(req, dst)

    def _located(self) -> Located:
        """The checkpoint's target, resolved once per path."""
        if self._where is None:
            self._where = locate(self.path, "DCP reader")
        return self._where

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            kind_of(checkpoint_id, "DCP reader")  # a URL of another scheme: not ours
            where = locate(checkpoint_id, "DCP reader")
            return where.target.is_file(os.path.join(where.path, MANIFEST_NAME))
        except (TypeError, OSError, ValueError):
            return False
