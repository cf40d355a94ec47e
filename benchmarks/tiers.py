"""The node-local tier (issue 15), in one run:

1. first and later saves, with and without ``Writer.reserve`` ahead of the first;
2. restore of the same state from local memory (a snapshot in /dev/shm left by a
   process that exited after committing it, restored by a new ``CheckpointManager``):
   the default (the snapshot taken: its pages become the tensors), copied into fresh
   memory (``zero_copy=False``, what a snapshot that is the only copy of its step
   gets) and ``into=`` existing tensors, against ``flashwrite.load`` from storage with
   a cold page cache (owned, and into existing tensors) and ``torch.load`` (cold too);
   and, after the default and the copying restore, the first write of every byte (an
   optimizer step's), to show what each leaves to pay later;
3. the memory local snapshots cost: the shared-memory file against the private pool.

    python benchmarks/tiers.py --gib 1 4 --rounds 3 2 --dir /work/tiers-bench [--json out.json]

Cold means the page cache is dropped before each storage load (root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches


def make_state(gib: float) -> dict:
    n = int(gib * (1 << 30)) // 4
    per = 1 << 24  # 64 MiB tensors, like large layers
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))},
            "step": 1}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def first_and_later(state: dict, d: str, reserve: bool, rounds: int) -> dict:
    w = fw.Writer()
    try:
        reserve_s = None
        if reserve:
            reserve_s = timed(lambda: w.reserve(state, block=True))
        stalls = []
        for i in range(rounds + 1):
            p = os.path.join(d, f"s{i}")
            fut = w.save_async(state, p)
            stalls.append(fut.stats.stall_s)
            fut.result()
            shutil.rmtree(p)
        return {"reserve_s": reserve_s, "first_stall_s": stalls[0], "later_stall_s": statistics.median(stalls[1:])}
    finally:
        w.close()


def _stage_in_child(gib: float, root: str, shm: str) -> None:
    """A process that saves step 1 with a local snapshot, keeps it, and exits: the restore
    below is a restart's (the snapshot's owner is dead, its pool free)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import tiers, flashwrite as fw\n"
            f"with fw.CheckpointManager({root!r}, local_snapshots=True, local_dir={shm!r}, keep_local=True) as m:\n"
            f"    m.save(1, tiers.make_state({gib!r}))\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def restores(gib: float, state: dict, d: str, rounds: int, settle_s: float) -> dict:
    out: dict = {k: [] for k in ("local_s", "local_first_write_s", "local_copy_s", "local_copy_first_write_s",
                                 "local_into_s", "flashwrite_cold_s", "flashwrite_cold_into_s", "torch_cold_s")}
    dest = {"model": {k: torch.empty_like(v).fill_(0) for k, v in state["model"].items()}, "step": 0}
    tpath = os.path.join(d, "state.pt")
    pool = 0
    try:
        torch.save(state, tpath)

        def one(key: str, fn, cold: bool = False, then_write: str | None = None) -> None:
            # Freed memory goes back to the hypervisor after a moment (free page reporting):
            # every contender starts from memory that is not backed yet, as after a restart.
            time.sleep(settle_s)
            if cold:
                drop_caches()
            t0 = time.perf_counter()
            got = fn()
            out[key].append(time.perf_counter() - t0)
            if then_write:
                tensors = list(got[1]["model"].values())
                t0 = time.perf_counter()
                for t in tensors:
                    t.add_(1.0)
                out[then_write].append(time.perf_counter() - t0)
                del tensors
            del got

        for r in range(rounds):
            # A fresh snapshot each round, as a restart finds one: dropping the page cache
            # (before the cold loads) also leaves the pages of an existing /dev/shm file
            # slow to map for good (measured: touching 1 GiB of it 0.09 s before, 0.60 s
            # after), which no restart meets.
            shm = os.path.join("/dev/shm", f"fw-tiers-bench-{os.getpid()}-{r}")
            root = os.path.join(d, f"ck{r}")
            try:
                _stage_in_child(gib, root, shm)
                pool = sum(os.path.getsize(os.path.join(shm, f)) for f in os.listdir(shm) if f.endswith(".pool"))
                m2 = fw.CheckpointManager(root, local_snapshots=True, local_dir=shm, cleanup=False)
                one("local_copy_s", lambda: m2.restore(zero_copy=False), then_write="local_copy_first_write_s")
                one("local_into_s", lambda: m2.restore(into=dest))
                one("local_s", lambda: m2.restore(), then_write="local_first_write_s")  # takes it: last
                assert not m2.find_local_snapshots(), "the default restore did not take the snapshot"
                m2._writer.close()  # it saved nothing
                one("flashwrite_cold_s", lambda: fw.load(m2.path_for(1)), cold=True)
                one("flashwrite_cold_into_s", lambda: fw.load(m2.path_for(1), into=dest), cold=True)
                one("torch_cold_s", lambda: torch.load(tpath, weights_only=True), cold=True)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
                shutil.rmtree(root, ignore_errors=True)
        res = {k: statistics.median(v) for k, v in out.items()}
        res["runs"] = out
        res["shm_pool_bytes"] = pool
        return res
    finally:
        if os.path.exists(tpath):
            os.unlink(tpath)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--dir", default="/work/tiers-bench")
    ap.add_argument("--rounds", type=int, nargs="+", default=[3],
                    help="rounds per size, in the order of --gib (the last one repeats)")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait before each timed restore or load (freed memory goes back to the host)")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    results = []
    for i, gib in enumerate(a.gib):
        rounds = a.rounds[min(i, len(a.rounds) - 1)]
        state = make_state(gib)
        nbytes = sum(t.nbytes for t in state["model"].values())
        row = {"gib": gib, "bytes": nbytes, "rounds": rounds}
        row["no_reserve"] = first_and_later(state, a.dir, False, rounds)
        row["reserve"] = first_and_later(state, a.dir, True, rounds)
        row["restore"] = restores(gib, state, a.dir, rounds, a.settle)
        results.append(row)
        nr, r, rs = row["no_reserve"], row["reserve"], row["restore"]
        print(f"{gib:g} GiB  stall first/later: {nr['first_stall_s']:.3f}/{nr['later_stall_s']:.3f} s without "
              f"reserve, {r['first_stall_s']:.3f}/{r['later_stall_s']:.3f} s after reserve "
              f"({r['reserve_s']:.3f} s in the background)")
        fc = rs["flashwrite_cold_s"]
        print(f"{gib:g} GiB  restore from memory: {rs['local_s']:.3f} s ({fc / rs['local_s']:.1f}x) then first "
              f"write {rs['local_first_write_s']:.3f} s; copied (zero_copy=False) {rs['local_copy_s']:.3f} s "
              f"({fc / rs['local_copy_s']:.1f}x) then first write {rs['local_copy_first_write_s']:.3f} s; "
              f"flashwrite.load cold "
              f"{fc:.3f} s, torch.load cold {rs['torch_cold_s']:.3f} s; into existing tensors: local "
              f"{rs['local_into_s']:.3f} s, flashwrite.load cold {rs['flashwrite_cold_into_s']:.3f} s "
              f"({rs['flashwrite_cold_into_s'] / rs['local_into_s']:.1f}x); shm pool "
              f"{rs['shm_pool_bytes'] / 2**30:.2f} GiB for {nbytes / 2**30:.2f} GiB of state", flush=True)
        del state
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
