"""The node-local tier (issue 15), in one run:

1. first and later saves, with and without ``Writer.reserve`` ahead of the first;
2. restore of the same state from local memory (a snapshot in /dev/shm, by a new
   ``CheckpointManager``), against ``flashwrite.load`` from storage with a cold
   page cache and ``torch.load`` (cold too);
3. the memory local snapshots cost: the shared-memory file against the private pool.

    python benchmarks/tiers.py --gib 1 4 --dir /work/tiers-bench [--json out.json]

Cold means the page cache is dropped before each storage load (root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch

import flashwrite as fw
from flashwrite.bench.devicelimit import drop_caches


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


def restores(state: dict, d: str, rounds: int) -> dict:
    shm = os.path.join("/dev/shm", f"fw-tiers-bench-{os.getpid()}")
    root = os.path.join(d, "ck")
    out: dict = {"local_s": [], "local_into_s": [], "flashwrite_cold_s": [], "flashwrite_cold_into_s": [],
                 "torch_cold_s": []}
    dest = {"model": {k: torch.empty_like(v).fill_(0) for k, v in state["model"].items()}, "step": 0}
    try:
        with fw.CheckpointManager(root, local_snapshots=True, local_dir=shm, keep_local=True) as m:
            m.save(1, state)
        pool = sum(os.path.getsize(os.path.join(shm, f)) for f in os.listdir(shm) if f.endswith(".pool"))
        tpath = os.path.join(d, "state.pt")
        torch.save(state, tpath)
        for _ in range(rounds):
            m2 = fw.CheckpointManager(root, local_snapshots=True, local_dir=shm, cleanup=False)
            t = timed(lambda: m2.restore())
            out["local_s"].append(t)
            out["local_into_s"].append(timed(lambda: m2.restore(into=dest)))
            m2._writer.close(keep_local=True)  # nothing of its own; the dead-owner rule is not in play
            drop_caches()
            out["flashwrite_cold_s"].append(timed(lambda: fw.load(m2.path_for(1))))
            drop_caches()
            out["flashwrite_cold_into_s"].append(timed(lambda: fw.load(m2.path_for(1), into=dest)))
            drop_caches()
            out["torch_cold_s"].append(timed(lambda: torch.load(tpath, weights_only=True)))
        res = {k: statistics.median(v) for k, v in out.items()}
        res["shm_pool_bytes"] = pool
        return res
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--dir", default="/work/tiers-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    results = []
    for gib in a.gib:
        state = make_state(gib)
        nbytes = sum(t.nbytes for t in state["model"].values())
        row = {"gib": gib, "bytes": nbytes}
        row["no_reserve"] = first_and_later(state, a.dir, False, a.rounds)
        row["reserve"] = first_and_later(state, a.dir, True, a.rounds)
        row["restore"] = restores(state, a.dir, a.rounds)
        results.append(row)
        nr, r, rs = row["no_reserve"], row["reserve"], row["restore"]
        print(f"{gib:g} GiB  stall first/later: {nr['first_stall_s']:.3f}/{nr['later_stall_s']:.3f} s without "
              f"reserve, {r['first_stall_s']:.3f}/{r['later_stall_s']:.3f} s after reserve "
              f"({r['reserve_s']:.3f} s in the background)")
        print(f"{gib:g} GiB  restore: local memory {rs['local_s']:.3f} s, flashwrite.load cold "
              f"{rs['flashwrite_cold_s']:.3f} s ({rs['flashwrite_cold_s'] / rs['local_s']:.1f}x), torch.load cold "
              f"{rs['torch_cold_s']:.3f} s ({rs['torch_cold_s'] / rs['local_s']:.1f}x); into existing tensors: "
              f"local {rs['local_into_s']:.3f} s, flashwrite.load cold {rs['flashwrite_cold_into_s']:.3f} s "
              f"({rs['flashwrite_cold_into_s'] / rs['local_into_s']:.1f}x); shm pool "
              f"{rs['shm_pool_bytes'] / 2**30:.2f} GiB for {nbytes / 2**30:.2f} GiB of state")
        del state
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
