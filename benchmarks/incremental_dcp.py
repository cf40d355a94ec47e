"""Incremental DCP saves (issue 26, ``dcp.async_save`` through ``FlashwriteStorageWriter``):
per save and rank, time to durable, stall and bytes written, full against incremental, in
one run.

Each of ``--ranks`` processes (gloo on localhost) holds the same DDP-like state: a frozen
bf16 base of ``--base-mib`` MiB and 32 MiB of fp32 adapters that change before every save
(DCP writes each replicated item once, spread over the ranks). ``--saves`` saves alternate
full (a ``Writer(incremental=False)``) and incremental (a ``Writer(incremental=True)``),
each mode into its own root, keeping its last two checkpoints. The first save of each mode
is left out of the medians (no base yet), and so is the second incremental one (it only
regroups the stripes).

    python benchmarks/incremental_dcp.py --ranks 2 --base-mib 512 --dir /work/incr-dcp --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import flashwrite as fw
from flashwrite.integrations.dcp import FlashwriteStorageWriter

ADAPTER_BYTES = 32 << 20


def run_rank(rank: int, args: argparse.Namespace, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(backend="gloo")  # async_save's collectives run on their own thread
    g = torch.Generator().manual_seed(0)  # the same base on every rank (replicated)
    per = 32 << 20  # 64 MiB bf16 tensors
    n = args.base_mib * (1 << 20) // 2
    base = {f"base.{i}": torch.randn(min(per, n - i * per), generator=g).to(torch.bfloat16)
            for i in range(-(-n // per))}
    rows = []
    writers = {"full": fw.Writer(stripes=args.stripes), "incremental": fw.Writer(stripes=args.stripes, incremental=True)}
    for step in range(1, 2 * args.saves + 1):
        mode = "incremental" if step % 2 == 0 else "full"
        root = os.path.join(args.dir, mode)
        gs = torch.Generator().manual_seed(step)
        sd = {"model": {**base, "lora": torch.randn(ADAPTER_BYTES // 4, generator=gs)}, "step": step}
        sw = FlashwriteStorageWriter(os.path.join(root, f"step-{step:04d}"), writer=writers[mode])
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=sw, process_group=group)
        stall = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        st = sw.last_stats
        rows.append({"mode": mode, "step": step, "rank": rank, "durable_s": st.durable_s, "total_s": total,
                     "stall_s": stall, "bytes": st.bytes, "written": st.bytes_written, "linked": st.bytes_linked,
                     "incremental": st.incremental})
        dist.barrier()
        if rank == 0:
            for old in sorted(os.listdir(root))[:-2]:
                shutil.rmtree(os.path.join(root, old))
    for w in writers.values():
        w.close()
    out[rank] = rows
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--base-mib", type=int, default=512)
    ap.add_argument("--saves", type=int, default=5, help="saves per mode")
    ap.add_argument("--stripes", type=int, default=4)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    init = os.path.join(args.dir, ".init")
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(run_rank, args=(args, init, out), nprocs=args.ranks)
        rows = [r for rank in sorted(out.keys()) for r in out[rank]]
    print(f"{'mode':12} {'rank':>4} {'durable s':>10} {'to commit s':>12} {'stall s':>8} {'written MiB':>12} "
          f"{'linked MiB':>11}")
    for mode in ("full", "incremental"):
        for rank in range(args.ranks):
            mine = [r for r in rows if r["mode"] == mode and r["rank"] == rank][1 + (mode == "incremental"):]
            med = {k: statistics.median(r[k] for r in mine) for k in ("durable_s", "total_s", "stall_s", "written",
                                                                       "linked")}
            print(f"{mode:12} {rank:>4} {med['durable_s']:>10.3f} {med['total_s']:>12.3f} {med['stall_s']:>8.3f} "
                  f"{med['written'] / 2**20:>12.1f} {med['linked'] / 2**20:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
