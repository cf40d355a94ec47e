"""One contender per class: how each peer saves (stall, time to durable) and loads.

Every save is timed from the call until the caller may mutate its tensors
(stall) and until the bytes are durable (fsync'd, fsync added where the peer
has none). Each peer is called through its public API as its own documentation
shows, with its own best settings where one is documented (DCP thread_count,
torch_checkpointing without its default O_DIRECT, which fails on ext4).

Here: the peers called through their public API alone (torch.save, safetensors,
DCP's public API, flashwrite). Adapters that reach into other projects' internals
(DCP's async stager, torch_checkpointing, DeepSpeed's op builders) live in
``benchmarks/peers.py`` beside this folder, or in the file named by
``benchmarks/compare.py --peers FILE`` (see ``external``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any, Callable

import torch

DCP_THREADS = 4


def flat_tensors(obj, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by dotted key, other leaves as strings): what safetensors can hold."""
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, str] = {}

    def walk(o, key):
        if isinstance(o, torch.Tensor):
            tensors[key] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(o, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in o):
            for i, v in enumerate(o):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            other[key] = repr(o)

    walk(obj, prefix)
    return tensors, other


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

    def load_template(self, state: Any, fresh: Callable[[], Any]) -> Any:
        """What ``load`` gets as its template: None, or ``fresh()`` (a newly allocated state
        like the saved one) for peers that load in place."""
        return None

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

    def load_template(self, state, fresh):
        return fresh()  # DCP loads in place: a resumed trainer has its model allocated already

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

    def __init__(self, threads: int = DCP_THREADS):
        super().__init__(threads)
        self.name = "dcp.async_save"
        self.label = (f"dcp.async_save with its default (synchronous, unpinned) staging, "
                      f"FileSystemWriter(thread_count={threads}, sync_files=True)")

    def stager(self) -> Any:
        """The async_stager to pass (None: DCP's default staging)."""
        return None

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        stager = self.stager()
        ctx = _dcp_quiet()
        try:
            t0 = time.perf_counter()
            r = dcp.async_save(state, storage_writer=FileSystemWriter(path, thread_count=self.threads, sync_files=True),
                               async_stager=stager)
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


class Flashwrite(Contender):
    key, name, label = "flashwrite", "flashwrite", "flashwrite.save_async with default settings; durable = committed"
    needs_warmup = True
    asynchronous = True

    def __init__(self, **options):
        self.options = options
        if options:
            self.label = "flashwrite.save_async(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"

    def save(self, state, path):
        import flashwrite as fw  # like every contender's library: imported in its own subprocess, at first use
        t0 = time.perf_counter()
        fut = fw.save_async(state, path, **self.options)
        stall = time.perf_counter() - t0
        st = fut.result()
        durable = time.perf_counter() - t0
        return {"stall_s": stall, "durable_s": durable, "backend": st.backend, "direct": st.direct,
                "stripes": st.stripes, "engine_durable_s": st.durable_s, "pool_bytes": st.pool_bytes}

    def load(self, path, template):
        import flashwrite as fw  # like every contender's library: imported in its own subprocess, at first use
        return fw.load(path)


def _builtin(dcp_threads: int) -> list[Contender]:
    return [TorchSave(), SafetensorsSave(), DcpSave(dcp_threads), DcpAsyncSave(dcp_threads)]


# benchmarks/peers.py, beside this folder.
PEERS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers.py")


PEERS_ENV = "FLASHWRITE_PEERS_FILE"


def use_peers_file(path: str | os.PathLike) -> str:
    """Take the peer adapters from ``path`` (``--peers FILE``), in this process and in the
    workers it starts (they inherit ``FLASHWRITE_PEERS_FILE``)."""
    full = os.path.abspath(os.fspath(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"--peers {full}: not a file")
    os.environ[PEERS_ENV] = full
    external.cache_clear()
    return full


@functools.lru_cache(maxsize=None)
def external() -> Any:
    """The adapters for peers whose use needs their internals (DCP's async stager,
    torch_checkpointing, DeepSpeed's op builders): the file named explicitly
    (``--peers FILE``, i.e. ``FLASHWRITE_PEERS_FILE``), else ``benchmarks/peers.py`` beside
    this harness; None when neither is there. Never a file found in the current
    directory or the benchmark's --dir. flashwrite itself never imports those projects."""
    named = os.environ.get(PEERS_ENV)
    path = os.path.abspath(named) if named else PEERS_FILE
    if not os.path.isfile(path):
        if named:
            raise FileNotFoundError(f"{PEERS_ENV} names {path}, which is not a file")
        return None
    spec = importlib.util.spec_from_file_location("flashwrite_benchmarks_peers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def contenders(dcp_threads: int = DCP_THREADS) -> dict[str, Contender]:
    """Every contender, in table order: this file's, the external peers' (see
    ``external``), flashwrite last."""
    ext = external()
    cs = [*_builtin(dcp_threads), *(ext.contenders(dcp_threads) if ext else []), Flashwrite()]
    return {c.key: c for c in cs}


def default_contenders() -> list[str]:
    """What ``benchmarks/compare.py`` runs by default (``--contenders all``): every contender known here."""
    return list(contenders())


def overhead_savers() -> dict[str, Any]:
    """{mode: (label, saver class)} of the external peers for the training-overhead benchmark."""
    ext = external()
    return dict(getattr(ext, "OVERHEAD_SAVERS", {})) if ext else {}


def file_name(key: str) -> str:
    """Checkpoint path for a contender: a file for single-file writers, else a directory."""
    return {"torch_save": "ckpt.pt", "safetensors": "ckpt.safetensors", "deepspeed": "ckpt-ds.pt"}.get(key, "ckpt")
