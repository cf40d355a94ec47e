"""Incremental multi-rank saves (issue 26, process_group=): per save and rank, time to
durable, stall and bytes written, for flashwrite full and incremental, in one run.

Each of ``--ranks`` processes (gloo on localhost) holds a frozen bf16 base of
``--base-mib`` MiB and 32 MiB of fp32 adapters that change before every save; ``--saves``
saves alternate full (``incremental=False``) and incremental, each mode into its own
root, keeping its last two checkpoints (the incremental one has a base, the disk does
not fill). The first save of each mode is left out of the medians (no base yet; the
second incremental save only regroups the stripes).

    python benchmarks/incremental_dist.py --ranks 2 --base-mib 512 --dir /work/incr-dist --json out.json

With ``--url nfs://HOST/EXPORT/ROOT?...`` the saves go to that nfs:// root instead, and
``--dir`` is the same root seen on this machine (the export's own directory, e.g. from
``sudo python3 tools/nfs_server.py --export DIR``), where old checkpoints are removed; name
a fresh root each run.
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
import torch.multiprocessing as mp

import flashwrite as fw

ADAPTER_BYTES = 32 << 20


def state_of(rank: int, base: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"model": {**base, "lora": torch.randn(ADAPTER_BYTES // 4, generator=g)}, "step": step}


def target_of(args: argparse.Namespace, rel: str) -> str:
    """Where checkpoint ``rel`` of the run is saved: under --dir, or under the --url root."""
    if not args.url:
        return os.path.join(args.dir, rel)
    base, _, query = args.url.partition("?")
    return f"{base.rstrip('/')}/{rel}" + (f"?{query}" if query else "")


def run_rank(rank: int, args: argparse.Namespace, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    per = 32 << 20  # 64 MiB bf16 tensors
    n = args.base_mib * (1 << 20) // 2
    base = {f"base.{i}": torch.randn(min(per, n - i * per), generator=g).to(torch.bfloat16)
            for i in range(-(-n // per))}
    rows = []
    with fw.Writer(stripes=args.stripes) as w:
        for step in range(1, 2 * args.saves + 1):
            mode = "incremental" if step % 2 == 0 else "full"
            root = os.path.join(args.dir, mode)
            sd = state_of(rank, base, step)
            dist.barrier()
            t0 = time.perf_counter()
            fut = w.save_async(sd, target_of(args, f"{mode}/step-{step:04d}"), process_group=dist.group.WORLD,
                               incremental=mode == "incremental")
            stall = time.perf_counter() - t0
            st = fut.result()
            rows.append({"mode": mode, "step": step, "rank": rank, "durable_s": st.durable_s, "stall_s": stall,
                         "bytes": st.bytes, "written": st.bytes_written if mode == "incremental" else st.bytes,
                         "linked": st.bytes_linked, "incremental": st.incremental})
            dist.barrier()
            if rank == 0:
                for old in sorted(os.listdir(root))[:-2]:
                    shutil.rmtree(os.path.join(root, old))
    out[rank] = rows
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--base-mib", type=int, default=512)
    ap.add_argument("--saves", type=int, default=5, help="saves per mode")
    ap.add_argument("--stripes", type=int, default=4)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--url", help="an nfs:// root to save to; --dir is then its directory on this machine")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.url and os.path.exists(args.dir):  # removed behind the server's back, it may still serve it from cache
        ap.error(f"--dir {args.dir} exists: with --url, name a fresh root each run")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    init = os.path.join(args.dir, ".init")
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(run_rank, args=(args, init, out), nprocs=args.ranks)
        rows = [r for rank in sorted(out.keys()) for r in out[rank]]
    print(f"{'mode':12} {'rank':>4} {'durable s':>10} {'stall s':>8} {'written MiB':>12} {'linked MiB':>11}")
    for mode in ("full", "incremental"):
        for rank in range(args.ranks):
            mine = [r for r in rows if r["mode"] == mode and r["rank"] == rank][1 + (mode == "incremental"):]
            med = {k: statistics.median(r[k] for r in mine) for k in ("durable_s", "stall_s", "written", "linked")}
            print(f"{mode:12} {rank:>4} {med['durable_s']:>10.3f} {med['stall_s']:>8.3f} "
                  f"{med['written'] / 2**20:>12.1f} {med['linked'] / 2**20:>11.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
