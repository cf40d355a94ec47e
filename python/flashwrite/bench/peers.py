"""One contender per class: how each peer saves (stall, time to durable) and loads.

Every save is timed from the call until the caller may mutate its tensors
(stall) and until the bytes are durable (fsync'd, fsync added where the peer
has none). Peers are called as PEERS.md describes, with their own best settings
where one is documented (DCP thread_count, torch_checkpointing without its
default O_DIRECT, which fails on ext4).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
import warnings
from typing import Any

import torch

from .state import flat_tensors

DCP_THREADS = 4


def fsync_tree(path: str) -> None:
    """fsync every file and directory under path, then path's parent: what a
    peer that never fsyncs would need before its checkpoint survives a crash."""
    if os.path.isfile(path):
        files, dirs = [path], []
    else:
        files, dirs = [], [path]
        for root, dnames, fnames in os.walk(path):
            files += [os.path.join(root, f) for f in fnames]
            dirs += [os.path.join(root, d) for d in dnames]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in [*reversed(dirs), os.path.dirname(os.path.abspath(path))]:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: str) -> None:
    """fsync a new file and its directory (without the latter, the file may vanish in a crash)."""
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


class Contender:
    key = ""
    name = ""    # short, for the table
    label = ""   # how it was called, for the notes
    needs_warmup = False   # keeps state across saves (pools, workers): measure the steady state
    asynchronous = False

    def available(self) -> str | None:
        """None when it can run here, else why not."""
        return None

    def note(self) -> str:
        return ""

    def save(self, state: Any, path: str) -> dict:
        """Save and wait until durable. Returns {"stall_s", "durable_s", ...}."""
        raise NotImplementedError

    def load(self, path: str, template: Any) -> Any:
        """Read the checkpoint back into usable CPU tensors."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchSave(Contender):
    key, name, label = "torch_save", "torch.save + fsync", "torch.save to one file, then fsync file and directory"

    def save(self, state, path):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
        fsync_file(path)
        t = time.perf_counter() - t0
        return {"stall_s": t, "durable_s": t}

    def load(self, path, template):
        return torch.load(path, map_location="cpu", weights_only=True)


class SafetensorsSave(Contender):
    key, name, label = "safetensors", "safetensors + fsync", "safetensors.torch.save_file (flattened keys, other " \
        "leaves as JSON metadata), then fsync file and directory"

    def available(self):
        return None if importlib.util.find_spec("safetensors") else "safetensors not installed"

    def save(self, state, path):
        from safetensors.torch import save_file
        t0 = time.perf_counter()
        tensors, other = flat_tensors(state)
        save_file(tensors, path, metadata={"other": json.dumps(other)})
        fsync_file(path)
        t = time.perf_counter() - t0
        return {"stall_s": t, "durable_s": t}

    def load(self, path, template):
        from safetensors.torch import load_file
        return load_file(path, device="cpu")


def _dcp_quiet():
    # One process, no process group: DCP warns that it assumes a single process.
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*single process.*")
    return ctx


class DcpSave(Contender):
    key = "dcp_save"

    def __init__(self, threads: int = DCP_THREADS):
        self.threads = threads
        self.name = "dcp.save"
        self.label = f"dcp.save, FileSystemWriter(thread_count={threads}, sync_files=True)"

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        ctx = _dcp_quiet()
        try:
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=self.threads, sync_files=True))
            t = time.perf_counter() - t0
        finally:
            ctx.__exit__(None, None, None)
        return {"stall_s": t, "durable_s": t}

    def load(self, path, template):
        import torch.distributed.checkpoint as dcp
        ctx = _dcp_quiet()
        try:
            # DCP loads in place: into the (already allocated) template, like a resumed trainer's model.
            dcp.load(template, checkpoint_id=path)
        finally:
            ctx.__exit__(None, None, None)
        return template


class DcpAsyncSave(DcpSave):
    key = "dcp_async"
    asynchronous = True

    def __init__(self, threads: int = DCP_THREADS, async_staging: bool = False):
        super().__init__(threads)
        self.async_staging = async_staging
        self.stager = None
        if async_staging:
            self.key = "dcp_async_staged"
            self.needs_warmup = True
            self.name = "dcp.async_save + async stager"
            self.label = (f"dcp.async_save, DefaultStager(StagingOptions(use_async_staging=True)) reused across saves, "
                          f"FileSystemWriter(thread_count={threads}, sync_files=True); stall = until staging completes")
        else:
            self.name = "dcp.async_save"
            self.label = (f"dcp.async_save with its default (synchronous, unpinned) staging, "
                          f"FileSystemWriter(thread_count={threads}, sync_files=True)")

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        if self.async_staging and self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
        ctx = _dcp_quiet()
        try:
            t0 = time.perf_counter()
            r = dcp.async_save(state, storage_writer=FileSystemWriter(path, thread_count=self.threads, sync_files=True),
                               async_stager=self.stager)
            if hasattr(r, "staging_completion"):
                r.staging_completion.result()
                upload = r.upload_completion
            else:
                upload = r
            stall = time.perf_counter() - t0
            upload.result()
            durable = time.perf_counter() - t0
        finally:
            ctx.__exit__(None, None, None)
        return {"stall_s": stall, "durable_s": durable}

    def close(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None


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
            # Its UtilsBuilder has no CPU-accelerator build; the generic one works (PEERS.md).
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


class Flashwrite(Contender):
    key, name, label = "flashwrite", "flashwrite", "flashwrite.save_async with default settings; durable = committed"
    needs_warmup = True
    asynchronous = True

    def __init__(self, **options):
        self.options = options
        if options:
            self.label = "flashwrite.save_async(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"

    def save(self, state, path):
        import flashwrite as fw
        t0 = time.perf_counter()
        fut = fw.save_async(state, path, **self.options)
        stall = time.perf_counter() - t0
        st = fut.result()
        durable = time.perf_counter() - t0
        return {"stall_s": stall, "durable_s": durable, "backend": st.backend, "direct": st.direct,
                "stripes": st.stripes, "engine_durable_s": st.durable_s, "pool_bytes": st.pool_bytes}

    def load(self, path, template):
        import flashwrite as fw
        return fw.load(path)


def contenders(dcp_threads: int = DCP_THREADS) -> dict[str, Contender]:
    """Every contender, in table order."""
    cs = [TorchSave(), SafetensorsSave(), DcpSave(dcp_threads), DcpAsyncSave(dcp_threads),
          DcpAsyncSave(dcp_threads, async_staging=True), TorchCheckpointing(), DeepSpeedFastPersist(), Flashwrite()]
    return {c.key: c for c in cs}


DEFAULT_CONTENDERS = ["torch_save", "safetensors", "dcp_save", "dcp_async", "dcp_async_staged", "torch_checkpointing",
                      "deepspeed", "flashwrite"]


def file_name(key: str) -> str:
    """Checkpoint path for a contender: a file for single-file writers, else a directory."""
    return {"torch_save": "ckpt.pt", "safetensors": "ckpt.safetensors", "deepspeed": "ckpt-ds.pt"}.get(key, "ckpt")
