"""CPU time and memory of a process and its children, around one operation.

CPU: user + system seconds of this process, of children it has reaped, and of
children still alive (torch_checkpointing's writer process, for one), read from
/proc. Memory: a sampling thread sums, over this process and its live children,
anonymous + file-backed resident memory, and counts shared memory once (a
shared-memory staging pool is resident in both the trainer and its writer).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Live descendants of pid (children started by any of its threads)."""
    out: list[int] = []
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    for k in kids:
        out.append(k)
        out += _children(k)
    return out


def _cpu_of(pid: int) -> float:
    """utime + stime of a live process (its reaped children are added by its own parent's view)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _mem_of(pid: int) -> tuple[int, int]:
    """(anonymous + file resident bytes, shared-memory resident bytes)."""
    anon = file = shm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) << 10
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) << 10
                elif line.startswith("RssShmem:"):
                    shm = int(line.split()[1]) << 10
    except OSError:
        pass
    return anon + file, shm


def resident_bytes() -> int:
    """Resident memory of this process and its live children (shared memory counted once)."""
    me = os.getpid()
    total, shm = 0, 0
    for p in [me, *_children(me)]:
        priv, s = _mem_of(p)
        total += priv
        shm = max(shm, s)
    return total + shm


class Meter:
    """with Meter() as m: work()  ->  m.cpu_s, m.peak_bytes (peak resident during the work)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.cpu_s = 0.0
        self.peak_bytes = 0
        self.start_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _cpu_now(self) -> tuple[float, dict[int, float]]:
        # getrusage has microsecond resolution (os.times and /proc count 10 ms ticks).
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        live = {p: _cpu_of(p) for p in _children(os.getpid())}
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, live

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, resident_bytes())

    def __enter__(self) -> Meter:
        gc.collect()
        self.start_bytes = self.peak_bytes = resident_bytes()
        self._own0, self._live0 = self._cpu_now()
        self._thread = threading.Thread(target=self._sample, name="fwbench-meter", daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        own1, live1 = self._cpu_now()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, resident_bytes())
        # A child alive at both ends counts its growth; one that appeared counts whole.
        # (A child that exited and was reaped in between is in own1's children_* fields.)
        self.cpu_s = (own1 - self._own0) + sum(c - self._live0.get(p, 0.0) for p, c in live1.items())


# The benchmarks/ folder: put first on a worker's path, so it imports this harness (and
# flashwrite from wherever the parent got it) and nothing from the folder it runs in.
BENCHMARKS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = """import importlib, json, sys
sys.path.insert(0, {bench!r})
mod, _, fn = {target!r}.partition(":")
with open(sys.argv[1]) as f:
    spec = json.load(f)
res = getattr(importlib.import_module(mod), fn)(spec)
with open(sys.argv[2], "w") as f:
    json.dump(res, f)
"""


def run_in_subprocess(target: str, spec: dict, timeout_s: float, ident: dict) -> dict:
    """Run ``target`` ("harness.module:function", called with spec) in a fresh process
    (clean RSS and CPU accounting) and return its JSON result, or ``ident`` plus a failed
    status. The child runs in spec["dir"], a fresh folder the parent made."""
    with tempfile.TemporaryDirectory(prefix="fwbench-worker-") as d:
        sp, op = os.path.join(d, "spec.json"), os.path.join(d, "out.json")
        with open(sp, "w") as f:
            json.dump(spec, f)
        code = _WORKER.format(bench=BENCHMARKS_DIR, target=target)
        try:
            p = subprocess.run([sys.executable, "-c", code, sp, op],
                               capture_output=True, text=True, timeout=timeout_s, cwd=spec["dir"])
        except subprocess.TimeoutExpired:
            return {**ident, "status": f"failed: timed out after {timeout_s:.0f} s"}
        if p.returncode != 0 or not os.path.exists(op):
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return {**ident, "status": f"failed: worker exited {p.returncode}: {tail[0][:200]}",
                    "stderr": p.stderr[-4000:]}
        with open(op) as f:
            return json.load(f)
