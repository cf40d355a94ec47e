"""``flashwrite tune DIR``: measure the storage behind DIR within a time budget and
recommend Writer settings for it.

1. The raw device limit for the same bytes (fio when installed, else the in-tree
   probe of ``ops.devicelimit``), so every trial can be read as a fraction of it.
2. flashwrite saves of a synthetic state, one setting varied at a time around the
   best so far (stripes, then queue depth, then chunk size): a coordinate search
   that needs ~14 saves instead of a 100-point grid. Each Writer is warmed by one
   untimed save (its staging pool is allocated then) and reused, so trials time
   the steady state of a training run: save_async to durable and committed.

Trials that do not fit the budget are skipped and say so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

import torch

from .. import defaults
from ..targets.target import local_path
from . import devicelimit
from ..saving.save import Writer
from ..targets.tuning import mount_of
from .common import UsageError

STRIPES = (1, 2, 4, 8, 16)
QUEUE_DEPTHS = (4, 8, 16, 32, 64)
CHUNKS = (4 << 20, 8 << 20, 16 << 20, 32 << 20)
MIN_SIZE, MAX_SIZE = 32 << 20, 4 << 30
_TRIALS = len(STRIPES) + len(QUEUE_DEPTHS) + len(CHUNKS)


def _state(nbytes: int, pieces: int = 16) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // pieces // 4)
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.rand(n, generator=g) for i in range(pieces)}


def _free_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def pick_size(budget_s: float, rate_bps: float, directory: str) -> int:
    """Bytes per trial so that the device limit (about 4 writes' worth with fio's
    two layouts, plus reads) and every trial fit in ~80% of the budget."""
    want = 0.8 * budget_s * rate_bps / (_TRIALS + 3 + 8)
    free_disk = shutil.disk_usage(directory).free
    cap = min(MAX_SIZE, _free_memory() // 4, max(MIN_SIZE, (free_disk - (1 << 30)) // 3))
    size = int(min(max(want, MIN_SIZE), cap))
    return max(16 << 20, size // (16 << 20) * (16 << 20))


class Tuner:
    def __init__(self, directory: str, budget_s: float, progress: Any, device_tool: str = "auto",
                 size: int | None = None, log: Callable[[str], None] = lambda _m: None):
        if not os.path.isdir(local_path(directory, "tune")):
            if os.path.exists(directory):
                raise NotADirectoryError(20, "not a directory: tune measures the file system a directory is on; "
                                         "pass the directory checkpoints will go to", directory)
            raise FileNotFoundError(2, "no such directory", directory)
        if budget_s <= 0:
            raise UsageError("--budget-s must be positive")
        self.directory, self.budget_s, self.progress, self.tool = directory, budget_s, progress, device_tool
        self.size, self.log = size, log
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self._writers: dict[int, Any] = {}

    def _writer(self, chunk: int) -> Any:
        w = self._writers.get(chunk)
        if w is None:
            w = self._writers[chunk] = Writer(stripes=1, queue_depth=1, chunk_bytes=chunk)
        return w

    def _save(self, state: dict, stripes: int, qd: int, chunk: int) -> Any:
        w = self._writer(chunk)
        w.stripes, w.queue_depth = stripes, qd  # the pool is reused; only the plan and the queue change
        path = os.path.join(self.work, f"trial-{len(self.rows)}-{time.monotonic_ns()}")
        try:
            return w.save(state, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def trial(self, state: dict, nbytes: int, stripes: int, qd: int, chunk: int) -> dict | None:
        for r in self.rows:
            if (r["stripes"], r["queue_depth"], r["chunk_bytes"]) == (stripes, qd, chunk):
                return r
        first = chunk not in self._writers
        need = (2 if first else 1) * self.est_s
        if self.rows and time.monotonic() + need > self.deadline:  # the first trial always runs: a result needs one
            self.skipped.append(f"stripes={stripes} queue_depth={qd} chunk={chunk >> 20}MiB")
            return None
        if first:
            self._save(state, stripes, qd, chunk)  # warm-up: allocates this chunk size's pool
        st = self._save(state, stripes, qd, chunk)
        secs = st.total_s or 0.0
        self.est_s = max(self.est_s * 0.5, secs)
        row = {"stripes": stripes, "queue_depth": qd, "chunk_bytes": chunk, "seconds": secs,
               "gbps": nbytes / secs / 1e9 if secs else None, "stall_s": st.stall_s, "backend": st.backend,
               "direct": st.direct}
        if self.limit_gbps:
            row["of_limit"] = row["gbps"] / self.limit_gbps if row["gbps"] else None
        self.rows.append(row)
        self.progress.advance(nbytes)
        return row

    def run(self) -> dict:
        t0 = time.monotonic()
        self.deadline = t0 + self.budget_s
        self.work = tempfile.mkdtemp(prefix=".flashwrite-tune-", dir=self.directory)
        try:
            # Calibrate: one small save gives the rate that sizes the trials.
            probe = _state(MIN_SIZE)
            self._save(probe, defaults.STRIPES, defaults.WRITE_QUEUE_DEPTH, defaults.CHUNK_BYTES)
            ts = time.monotonic()
            self._save(probe, defaults.STRIPES, defaults.WRITE_QUEUE_DEPTH, defaults.CHUNK_BYTES)
            rate = MIN_SIZE / max(time.monotonic() - ts, 1e-3)
            del probe
            nbytes = self.size or pick_size(max(1.0, self.deadline - time.monotonic()), rate, self.directory)
            self.est_s = nbytes / rate
            self.progress.start(nbytes * (_TRIALS + 1), f"tune {self.directory}")
            limit: dict = {}
            self.limit_gbps = None
            if time.monotonic() + 6 * self.est_s < self.deadline:
                limit = devicelimit.device_limit(self.work, nbytes, self.tool)
                self.limit_gbps = nbytes / limit["write_s"] / 1e9 if limit.get("write_s") else None
            else:
                limit = {"tool": "skipped: no time left in the budget"}
            self.progress.advance(nbytes)
            state = _state(nbytes)
            best = {"stripes": defaults.STRIPES, "queue_depth": defaults.WRITE_QUEUE_DEPTH,
                    "chunk_bytes": defaults.CHUNK_BYTES}

            def sweep(name: str, values: tuple[int, ...]) -> None:
                for v in values:
                    self.trial(state, nbytes, **{"stripes": best["stripes"], "qd": best["queue_depth"],
                                                 "chunk": best["chunk_bytes"],
                                                 {"stripes": "stripes", "queue_depth": "qd",
                                                  "chunk_bytes": "chunk"}[name]: v})
                done = [r for r in self.rows if r["gbps"]]
                if done:
                    top = max(done, key=lambda r: (r["gbps"], -r["stripes"], -r["queue_depth"]))
                    best.update(stripes=top["stripes"], queue_depth=top["queue_depth"], chunk_bytes=top["chunk_bytes"])

            sweep("stripes", STRIPES)
            sweep("queue_depth", QUEUE_DEPTHS)
            sweep("chunk_bytes", CHUNKS)
        finally:
            for w in self._writers.values():
                w.close()
            shutil.rmtree(self.work, ignore_errors=True)
            self.progress.finish()
        top = max((r for r in self.rows if r["gbps"]), key=lambda r: r["gbps"], default=None)
        return {
            "directory": os.path.abspath(self.directory), "filesystem": mount_of(self.directory),
            "budget_s": self.budget_s, "elapsed_s": time.monotonic() - t0, "bytes_per_trial": nbytes,
            "device_limit": {**limit, "write_gbps": self.limit_gbps,
                             "read_gbps": nbytes / limit["read_s"] / 1e9 if limit.get("read_s") else None},
            "trials": self.rows, "skipped": self.skipped,
            "recommended": None if top is None else {k: top[k] for k in ("stripes", "queue_depth", "chunk_bytes")},
            "recommended_gbps": None if top is None else top["gbps"],
            "defaults": {"stripes": defaults.STRIPES, "queue_depth": defaults.WRITE_QUEUE_DEPTH,
                         "chunk_bytes": defaults.CHUNK_BYTES},
        }


def tune(directory: str, budget_s: float, progress: Any, device_tool: str = "auto", size: int | None = None) -> dict:
    res = Tuner(directory, budget_s, progress, device_tool, size).run()
    rec = res["recommended"]
    if rec:  # the flat fields scripts read
        res.update(stripes=rec["stripes"], queue_depth=rec["queue_depth"], chunk_bytes=rec["chunk_bytes"])
    return res
