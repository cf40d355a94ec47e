"""Neighbour copies (issue 15), with real ranks on one machine (gloo over loopback), in one run:

1. the save stall and the time to durable of a 2-rank CheckpointManager with local
   snapshots, without and with ``neighbour_copies=True`` (the copies go out while the
   stripes are written: what they add is what this measures);
2. a lost node: new processes restart after rank 1's local_dir is wiped; every rank's
   ``restore()`` is timed (rank 1 fetches its part from rank 0's memory, rank 0 takes
   its own snapshot), then each rank loads its part from storage with a cold page cache.

    python benchmarks/neighbours.py --gib 0.5 --rounds 3 --dir /work/nb-bench [--json out.json]

--gib is the state of each rank. Cold means the page cache is dropped first (root).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches

WORLD = 2


def make_state(gib: float, rank: int) -> dict:
    n = int(gib * (1 << 30)) // 4
    per = 1 << 24  # 64 MiB tensors, like large layers
    g = torch.Generator().manual_seed(rank)
    return {"model": {f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))}}


def _init(rank: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))


def saves(rank: int, a: argparse.Namespace) -> dict:
    state = make_state(a.gib, rank)
    out = {}
    for copies in (False, True):
        tag = "with" if copies else "without"
        root = os.path.join(a.dir, f"ck-{tag}")
        m = fw.CheckpointManager(root, local_snapshots=True, local_dir=os.path.join(a.shm, tag, f"r{rank}"),
                                 process_group=dist.group.WORLD, neighbour_copies=copies, keep_local=True)
        stalls, durables = [], []
        for step in range(a.rounds + 1):  # the first save allocates the pool: not counted
            dist.barrier()
            t0 = time.perf_counter()
            fut = m.save(step, state)
            stall = time.perf_counter() - t0
            m.wait()
            if step:
                stalls.append(stall)
                durables.append(time.perf_counter() - t0)
        m.close()
        out[tag] = {"stall_s": statistics.median(stalls), "durable_s": statistics.median(durables),
                    "runs": {"stall_s": stalls, "durable_s": durables}}
        del fut
    return out


def restores(rank: int, a: argparse.Namespace) -> dict:
    m = fw.CheckpointManager(os.path.join(a.dir, "ck-with"), local_snapshots=True,
                             local_dir=os.path.join(a.shm, "with", f"r{rank}"), process_group=dist.group.WORLD,
                             neighbour_copies=True, cleanup=False)
    time.sleep(a.settle)
    dist.barrier()
    t0 = time.perf_counter()
    step, got = m.restore()
    restore_s = time.perf_counter() - t0
    ok = all(torch.equal(got["model"][k], v) for k, v in make_state(a.gib, rank)["model"].items())
    del got
    if rank == 0:
        drop_caches()
    time.sleep(a.settle)
    dist.barrier()
    t0 = time.perf_counter()
    got = fw.load(m.path_for(step), process_group=dist.group.WORLD)
    load_s = time.perf_counter() - t0
    del got
    m.close()
    return {"step": step, "restore_s": restore_s, "bytes_ok": ok, "cold_load_s": load_s}


def rank_main(a: argparse.Namespace) -> None:
    _init(a.rank, a.init)
    res = saves(a.rank, a) if a.phase == "saves" else restores(a.rank, a)
    with open(f"{a.init}.rank{a.rank}.json", "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(a: argparse.Namespace, phase: str) -> list[dict]:
    init = os.path.join(a.dir, f"init-{phase}-{time.monotonic_ns()}")
    args = [sys.executable, os.path.abspath(__file__), "--gib", str(a.gib), "--rounds", str(a.rounds), "--dir",
            a.dir, "--shm", a.shm, "--settle", str(a.settle), "--phase", phase, "--init", init]
    procs = [subprocess.Popen(args + ["--rank", str(r)]) for r in range(WORLD)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank of the {phase} phase failed")
    out = []
    for r in range(WORLD):
        with open(f"{init}.rank{r}.json") as fh:
            out.append(json.load(fh))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5, help="state size of each rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/work/nb-bench")
    ap.add_argument("--shm", default=None, help="base of the ranks' local_dirs (default /dev/shm/fw-nb-bench-PID)")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--json")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        return rank_main(a)
    a.shm = a.shm or f"/dev/shm/fw-nb-bench-{os.getpid()}"
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    try:
        sv = _run_ranks(a, "saves")
        shutil.rmtree(os.path.join(a.shm, "with", "r1"))  # rank 1's node is lost with its memory
        rs = _run_ranks(a, "restores")
    finally:
        shutil.rmtree(a.shm, ignore_errors=True)
        shutil.rmtree(a.dir, ignore_errors=True)
    for tag in ("without", "with"):
        print(f"{WORLD} ranks x {a.gib:g} GiB, {tag} neighbour copies: stall {sv[0][tag]['stall_s']:.3f} s, "
              f"durable {sv[0][tag]['durable_s']:.3f} s (rank 0, medians of {a.rounds})")
    for r, x in enumerate(rs):
        how = "fetched from rank 0's memory" if r == 1 else "its own snapshot"
        print(f"rank {r}: restore of step {x['step']} {x['restore_s']:.3f} s ({how}; bytes "
              f"{'exact' if x['bytes_ok'] else 'WRONG'}), its part from storage cold {x['cold_load_s']:.3f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"world": WORLD, "gib_per_rank": a.gib, "rounds": a.rounds, "saves": sv, "restores": rs}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
