"""Real multi-process torch.distributed for the tests.

``Cluster(n)`` spawns n worker processes that join one gloo process group on
localhost and then run, on every rank at once, whatever function the test sends
(``cluster.run(fn, *args)`` returns the per-rank results). The rendezvous store
lives in the test process and listens on a port the kernel picked, so parallel
test runs never race for a port. Workers are forked from multiprocessing's fork
server (never from the test process, which has native threads), where torch and
flashwrite are imported once, and a cluster is reused by the tests of a module:
starting Python + torch costs seconds on a small machine.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

RANK_TIMEOUT_S = 120


class WorkerError(AssertionError):
    """A rank raised (its traceback is the message) or died."""


def _worker(rank: int, world_size: int, port: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)  # n ranks share 2 cores
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - shipped to the test process
            out = ("err", "".join(traceback.format_exception(e)))
        conn.send(out)
    os._exit(0)  # skip interpreter teardown: the test process only waits for the exit


# Imported once by multiprocessing's fork server; each worker is then a fork of
# that single-threaded process, which saves every worker the seconds of importing
# torch (more with 4 ranks on 2 cores). Nothing native runs in the server itself.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.checkpoint.state_dict", "flashwrite", "flashwrite.dcp", "dist_helpers"]


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class Cluster:
    def __init__(self, world_size: int, start_timeout: float = 120):
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        ctx = _context()
        self.procs, self.conns, self.pids = [], [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, self.store.port, child), daemon=True,
                            name=f"fwtest-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        deadline = time.monotonic() + start_timeout
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise WorkerError(f"rank {r} did not start within {start_timeout} s")
            tag, pid = c.recv()
            self.pids.append(pid)

    def run_raw(self, fn: Callable, *args: Any, timeout: float = RANK_TIMEOUT_S, silent: tuple[int, ...] = (),
                **kwargs: Any) -> list[tuple]:
        """Run fn on every rank; [("ok", value) | ("err", traceback) | ("dead", exitcode) | ("timeout", None)]
        per rank. Ranks in ``silent`` are expected not to answer (stopped on purpose): not waited for."""
        for c in self.conns:
            c.send((fn, args, kwargs))
        out: list[tuple] = []
        deadline = time.monotonic() + timeout
        for r, (c, p) in enumerate(zip(self.conns, self.procs)):
            try:
                ready = c.poll(0.5 if r in silent else max(0.0, deadline - time.monotonic()))
                out.append(c.recv() if ready else ("timeout", None))
            except (EOFError, OSError):
                p.join(5)
                out.append(("dead", p.exitcode))
        return out

    def run(self, fn: Callable, *args: Any, timeout: float = RANK_TIMEOUT_S, **kwargs: Any) -> list:
        res = self.run_raw(fn, *args, timeout=timeout, **kwargs)
        bad = [(r, tag, v) for r, (tag, v) in enumerate(res) if tag != "ok"]
        if bad:
            raise WorkerError("\n".join(f"--- rank {r}: {tag}\n{v}" for r, tag, v in bad))
        return [v for _, v in res]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        for c in self.conns:
            c.close()

    def kill(self) -> None:
        """End every worker now (for clusters a test has broken on purpose)."""
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill() if exc[0] is not None else self.close()


def replica_boards() -> list[str]:
    """The read-once exchange's boards now in shared memory (flashwrite.loading.shm_exchange),
    by name: a test that ends with any left has leaked one."""
    from flashwrite.loading import shm_exchange
    return sorted(n for n in os.listdir(shm_exchange.SHM_DIR) if n.startswith(shm_exchange.PREFIX))
