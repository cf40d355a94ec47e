"""Aggregate write throughput of a multi-rank checkpoint: 1, 2 and 4 ranks.

Every rank saves its own share of ``--total-mib`` (float32 tensors of
``--tensor-mib``, names unique per rank so DCP deduplicates nothing) into one
checkpoint, with each contender in the same run, interleaved per repeat:

  flashwrite      fw.save(state, path, process_group=WORLD): per-rank stripes,
                  io_uring + O_DIRECT, committed by rank 0 (manifest, rename, fsyncs)
  flashwrite-dcp  dcp.save(state, storage_writer=FlashwriteStorageWriter(path))
  dcp-fs          dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))

A save is timed from a barrier before it to a barrier after every rank has
returned (durable and committed), aggregate GB/s = total bytes / that time. One
untimed save per contender warms staging pools and process groups first, as in a
training loop that checkpoints repeatedly. Each checkpoint is deleted after it is
timed. Ranks are processes on this machine, joined by gloo over localhost.

    python benchmarks/ranks_throughput.py                 # 512 MiB, ranks 1 2 4, 3 repeats
    python benchmarks/ranks_throughput.py --total-mib 2048 --dir /mnt/nfs/bench
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

METHODS = ("flashwrite", "flashwrite-dcp", "dcp-fs")


def _worker(rank: int, world_size: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import flashwrite as fw
    from flashwrite.integrations.dcp import FlashwriteStorageWriter

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    per_rank = (args["total_mib"] << 20) // world_size
    tensor = args["tensor_mib"] << 20
    sd, left, i = {}, per_rank, 0
    g = torch.Generator().manual_seed(rank)
    while left > 0:
        n = min(tensor, left)
        sd[f"rank{rank}.t{i}"] = torch.randn(n // 4, generator=g)
        left -= n
        i += 1
    nbytes = torch.tensor([sum(t.numel() * 4 for t in sd.values())], dtype=torch.int64)
    dist.all_reduce(nbytes)

    def save(method: str, path: str) -> None:
        if method == "flashwrite":
            fw.save(sd, path, process_group=dist.group.WORLD, stripes=args["stripes"])
        elif method == "flashwrite-dcp":
            dcp.save(sd, storage_writer=FlashwriteStorageWriter(path, stripes=args["stripes"]))
        else:
            dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=True))

    root = args["dir"]
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(-1, args["repeats"]):  # rep -1: warm-up, not timed
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]
        for m in order:
            path = os.path.join(root, f"{m}-{world_size}-{rep}")
            dist.barrier()
            t0 = time.perf_counter()
            save(m, path)
            dist.barrier()
            dt = time.perf_counter() - t0
            if rank == 0:
                if rep >= 0:
                    times[m].append(dt)
                shutil.rmtree(path)
            dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": int(nbytes.item()), "times": times, "backend": fw.backend_info()["backend"]}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world_size: int, args: dict) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = multiprocessing.get_context("forkserver")
    out = os.path.join(args["dir"], f"result-{world_size}.json")
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, args, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"{world_size} ranks: a worker failed (exit codes {bad})")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mib", type=int, default=512, help="checkpoint size, all ranks together")
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stripes", type=int, default=4, help="flashwrite stripes per rank")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under the cwd)")
    ap.add_argument("--json", default=None, help="also write the raw timings here")
    a = ap.parse_args()
    base = a.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".ranks-bench-", dir=base)
    args = {"total_mib": a.total_mib, "tensor_mib": a.tensor_mib, "repeats": a.repeats, "stripes": a.stripes,
            "dir": work}
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "torch.distributed.checkpoint", "flashwrite", "flashwrite.dcp"])
    print(f"{a.total_mib} MiB per checkpoint, {a.tensor_mib} MiB tensors, {a.repeats} timed repeats each, "
          f"written to {work} ({os.cpu_count()} CPUs)", flush=True)
    results = {}
    try:
        for n in a.ranks:
            t = time.perf_counter()
            results[n] = run_ranks(n, args)
            print(f"  {n} rank(s) done in {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def gbps(res: dict, m: str) -> tuple[float, float, float]:
        v = [res["bytes"] / t / 1e9 for t in res["times"][m]]
        return statistics.median(v), min(v), max(v)

    head = f"{'ranks':>5}  " + "  ".join(f"{m + ' GB/s':>22}" for m in METHODS) + f"  {'fw / dcp-fs':>11}"
    print()
    print("aggregate write throughput, median (min-max) over repeats, time to durable + committed")
    print(head)
    print("-" * len(head))
    for n, res in results.items():
        cells = []
        for m in METHODS:
            med, lo, hi = gbps(res, m)
            cells.append(f"{med:6.2f} ({lo:.2f}-{hi:.2f})".rjust(22))
        ratio = gbps(res, "flashwrite")[0] / gbps(res, "dcp-fs")[0]
        print(f"{n:>5}  " + "  ".join(cells) + f"  {ratio:10.2f}x")
    print(f"\nflashwrite backend: {next(iter(results.values()))['backend']}; "
          f"python {sys.version.split()[0]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
