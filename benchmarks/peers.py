"""Benchmark adapters for peers whose use needs their internals.

``benchmarks/compare.py`` takes this file (see ``harness.peers.external``): it adds
DCP's async stager, torch_checkpointing and DeepSpeed FastPersist to the table, and
torch_checkpointing to ``benchmarks/overhead.py``. Install the peers with
``pip install -e ".[bench]"`` (DeepSpeed separately). The wheel never ships or imports
this file.

Interface: ``contenders(dcp_threads) -> list[Contender]`` (in table order, before
flashwrite) and ``OVERHEAD_SAVERS = {mode: (label, saver class)}``.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch

from harness.peers import DCP_THREADS, Contender, DcpAsyncSave, fsync_tree


class DcpAsyncStagedSave(DcpAsyncSave):
    key = "dcp_async_staged"
    needs_warmup = True

    def __init__(self, threads: int = DCP_THREADS):
        super().__init__(threads)
        self._stager = None
        self.name = "dcp.async_save + async stager"
        self.label = (f"dcp.async_save, DefaultStager(StagingOptions(use_async_staging=True)) reused across saves, "
                      f"FileSystemWriter(thread_count={threads}, sync_files=True); stall = until staging completes")

    def stager(self) -> Any:
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager

    def close(self):
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class TorchCheckpointing(Contender):
    key, name = "torch_checkpointing", "torch_checkpointing + fsync"
    label = "torch_checkpointing CheckpointManager.save (async), stall = until staging completes, fsync added"
    needs_warmup = True
    asynchronous = True

    def __init__(self, direct: bool = False):
        self.direct = direct
        self.mgr = None
        if not direct:
            self.label = self.label.replace("(async)", "(async, use_direct_io=False)")

    def available(self):
        return None if importlib.util.find_spec("torch_checkpointing") else \
            "torch_checkpointing not installed (pip install torch-checkpointing)"

    def note(self):
        return "" if self.direct else ("use_direct_io=False: its default O_DIRECT writer fails with EINVAL on ext4 "
                                       "(unaligned write through a buffered wrapper); it never fsyncs, so fsync is added")

    def save(self, state, path):
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        if self.mgr is None:
            self.mgr = CheckpointManager(CheckpointManager.Config(
                storage_config=LocalFileSystemStorageConfig(use_direct_io=self.direct)))
        t0 = time.perf_counter()
        fut = self.mgr.save(path, state)
        # save() returns at once; the caller may mutate its tensors only once staging is done.
        if self.mgr._staging_future is not None:
            self.mgr._staging_future.result()
        stall = time.perf_counter() - t0
        fut.result()
        written = time.perf_counter() - t0
        fsync_tree(path)
        durable = time.perf_counter() - t0
        return {"stall_s": stall, "durable_s": durable, "written_s": written}

    def load_template(self, state, fresh):
        return dict.fromkeys(state)  # its load wants the item names

    def load(self, path, template):
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        mgr = CheckpointManager(CheckpointManager.Config(items={k: ItemSpec() for k in template},
                                                         save=SyncCheckpointSaverConfig()))
        try:
            return mgr.load(path)
        finally:
            mgr.close()

    def close(self):
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None


class DeepSpeedFastPersist(Contender):
    key, name = "deepspeed", "DeepSpeed FastPersist"
    label = "DeepSpeed FastFileWriter (libaio, 1 MiB blocks, depth 8, 64 MiB double buffer) + torch.save"
    needs_warmup = True

    def __init__(self):
        self.handle = None
        self.pinned = None

    def available(self):
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed not installed (optional: pip install deepspeed, apt install libaio-dev)"
        try:
            from deepspeed.ops.op_builder import AsyncIOBuilder
            if not AsyncIOBuilder().is_compatible(verbose=False):
                return "deepspeed's aio op is not buildable here (libaio-dev missing?)"
        except Exception as e:  # noqa: BLE001 - any import failure means: not runnable here
            return f"deepspeed aio op unavailable: {type(e).__name__}: {e}"
        return None

    def _setup(self):
        import deepspeed.io.fast_file_writer as ffw
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not torch.cuda.is_available():
            # Its UtilsBuilder has no CPU-accelerator build; the generic one works (found while
            # setting up this peer; DeepSpeed's docs do not say so).
            from deepspeed.ops.op_builder.utils import UtilsBuilder
            ffw.UtilsBuilder = UtilsBuilder
        self.handle = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, True, 1)
        # Tensor.pin_memory() needs CUDA; the aio handle's locked allocator does not.
        self.pinned = self.handle.new_cpu_locked_tensor(64 << 20, torch.empty(0, dtype=torch.uint8))

    def save(self, state, path):
        from deepspeed.io import FastFileWriter, FastFileWriterConfig
        if self.handle is None:
            self._setup()
        t0 = time.perf_counter()
        w = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=self.handle, pinned_tensor=self.pinned))
        torch.save(state, w)
        w.close()  # flushes the double buffer and fsyncs
        t = time.perf_counter() - t0
        return {"stall_s": t, "durable_s": t}

    def load(self, path, template):
        return torch.load(path, map_location="cpu", weights_only=True)

    def close(self):
        if self.pinned is not None and self.handle is not None:
            try:
                self.handle.free_cpu_locked_tensor(self.pinned)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self.handle = self.pinned = None

class TorchCheckpointingSaver:
    """torch_checkpointing for ``benchmarks/overhead.py``: one save in flight at a time."""

    def __init__(self):
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        self.mgr = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.pending = None

    def save(self, state: dict, path: str) -> None:
        self.wait()
        fut = self.mgr.save(path, state)
        if self.mgr._staging_future is not None:
            self.mgr._staging_future.result()  # before the optimizer may touch the parameters
        self.pending = (fut, path)

    def wait(self) -> None:
        p, self.pending = self.pending, None
        if p is not None:
            p[0].result()
            fsync_tree(p[1])

    def close(self) -> None:
        self.wait()
        self.mgr.close()


def contenders(dcp_threads: int = DCP_THREADS) -> list[Contender]:
    return [DcpAsyncStagedSave(dcp_threads), TorchCheckpointing(), DeepSpeedFastPersist()]


OVERHEAD_SAVERS = {"torch_checkpointing": ("torch_checkpointing", TorchCheckpointingSaver)}
