"""Replica groups at 4 ranks (issue 43): bytes to storage, restart reads, time to durable,
restart time and the stall, flashwrite with ``replica_group=`` against today's
``process_group=`` save/load and against DCP ``async_save`` + ``dcp.load``, in one run.

Four gloo ranks (processes on this machine), each holding ``--gib`` of float32 state:

  ddp   every rank holds the same state: one replica group of 4 (R=4)
  hsdp  2 shards x 2 replicas: ranks {0, 2} hold shard 0, {1, 3} shard 1 (R=2)

Contenders, interleaved per round:

  fw-today    fw.save_async(sd, path, process_group=WORLD); fw.load(path, process_group=WORLD)
  fw-replica  ... replica_group=<the rank's replica group>, on save and load
  dcp         dcp.async_save(sd, checkpoint_id=path) (its default stager and FileSystemWriter);
              dcp.load(sd, checkpoint_id=path). DCP deduplicates the replicated items when
              it plans the save (for hsdp the keys name the shard, so it keeps one per shard).
              Local disk only: DCP cannot reach nfs:// here (no kernel NFS client).
  dcp-fw      DCP through flashwrite: dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path))
              on a gloo group of its own; dcp.load(sd, storage_reader=FlashwriteStorageReader(path)),
              which reads each stripe once and sends it to the ranks that need it (read_once).
              Local disk only, with dcp (--no-dcp drops both).

Targets: the local disk (--dir), and nfs:// over a veth pair shaped with tbf to --rate
Mbit/s both ways, nfs-ganesha inside the namespace (tests/nfs_netns.py), with --nfs.

Per contender (medians over --rounds): bytes on storage (the checkpoint directory's stripe
bytes), bytes read from storage at restart per rank (/proc/self/io read_bytes for local
loads, after the page cache is dropped; for nfs:// the bytes the link carried from the
server, all ranks together), time to durable (the slowest rank's save_async call to its
result()), restart time (the slowest rank's load), stall (the slowest rank's save_async).

    python benchmarks/replicas.py --gib 1 --rounds 3 [--nfs --rate 1000] [--json out.json]
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

WORLD = 4
TENSOR_MIB = 32


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _worker(rank: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import flashwrite as fw
    from flashwrite.dcp import FlashwriteStorageReader, FlashwriteStorageWriter

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=900))
    a, b = dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")
    layouts = {"ddp": (dist.group.WORLD, 0), "hsdp": (a if rank in (0, 2) else b, rank % 2)}
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background save coordinates on a group of its own
    per = TENSOR_MIB << 18  # float32 elements per tensor
    n = int(args["gib"] * 1024) // TENSOR_MIB
    results: list[dict] = []
    writer = fw.Writer()

    def state(shard: int) -> dict:
        g = torch.Generator().manual_seed(shard)
        return {"model": {f"s{shard}.layer{i}": torch.randn(per, generator=g) for i in range(n)}}

    for kind in args["layouts"]:
        group, shard = layouts[kind]
        sd = state(shard)
        for target in args["targets"]:
            methods = ["fw-today", "fw-replica"] + (["dcp", "dcp-fw"] if target == "local" and args["dcp"] else [])
            base = args["nfs_url"] if target == "nfs" else args["dir"]
            for rnd in range(-1, args["rounds"]):  # -1: a warm-up (pools, process groups), not kept
                order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                for m in order:
                    name = f"{kind}-{target}-{m}-{rnd}"
                    path = (base.split("?")[0] + "/" + name + ("?" + base.split("?")[1] if "?" in base else "")
                            if target == "nfs" else os.path.join(base, name))
                    rec = {"layout": kind, "target": target, "method": m, "round": rnd, "rank": rank}
                    dist.barrier()
                    t0 = time.perf_counter()
                    if m == "dcp":
                        fut = dcp.async_save(sd, checkpoint_id=path)
                        rec["stall_s"] = time.perf_counter() - t0
                        fut.result()
                    elif m == "dcp-fw":
                        fut = dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path, process_group=dcp_pg),
                                             process_group=dcp_pg)
                        rec["stall_s"] = time.perf_counter() - t0
                        fut.result()
                    else:
                        extra = {"replica_group": group} if m == "fw-replica" else {}
                        fut = writer.save_async(sd, path, process_group=dist.group.WORLD, **extra)
                        rec["stall_s"] = time.perf_counter() - t0
                        fut.result()
                    rec["durable_s"] = time.perf_counter() - t0
                    dist.barrier()
                    if rank == 0:
                        rec["dropped"] = _drop_caches()
                        if target == "local":
                            rec["stored"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                                if f.endswith(".safetensors") or f.endswith(".distcp"))
                        else:
                            d = os.path.join(args["export"], name)
                            rec["stored"] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                                                if f.endswith(".safetensors"))
                            rec["rx0"] = _net(args["host_dev"], "rx")
                    dist.barrier()
                    r0, t0 = _read_bytes(), time.perf_counter()
                    if m == "dcp":
                        dst = {"model": {k: torch.empty_like(v) for k, v in sd["model"].items()}}
                        dcp.load(dst, checkpoint_id=path)
                    elif m == "dcp-fw":
                        dst = {"model": {k: torch.empty_like(v) for k, v in sd["model"].items()}}
                        dcp.load(dst, storage_reader=FlashwriteStorageReader(path))
                    else:
                        extra = {"replica_group": group} if m == "fw-replica" else {}
                        dst = fw.load(path, process_group=dist.group.WORLD, **extra)
                    rec["load_s"] = time.perf_counter() - t0
                    rec["read"] = _read_bytes() - r0
                    assert all(torch.equal(dst["model"][k], v) for k, v in sd["model"].items()), (name, rank)
                    del dst
                    dist.barrier()
                    if rank == 0:
                        if target == "nfs":
                            rec["link_read"] = _net(args["host_dev"], "rx") - rec.pop("rx0")
                            shutil.rmtree(os.path.join(args["export"], name))
                        else:
                            shutil.rmtree(path)
                    dist.barrier()
                    if rnd >= 0:
                        results.append(rec)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    writer.close()
    dist.barrier()
    dist.destroy_process_group()


def _net(dev: str, which: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/{which}_bytes") as f:
        return int(f.read())


def run(args: dict) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = multiprocessing.get_context("forkserver")
    out = os.path.join(args["dir"], "result")
    procs = [ctx.Process(target=_worker, args=(r, store.port, args, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"a worker failed (exit codes {bad})")
    recs = []
    for r in range(WORLD):
        with open(f"{out}.{r}") as f:
            recs += json.load(f)
        os.unlink(f"{out}.{r}")
    return recs


def summarize(recs: list[dict], gib: float) -> list[dict]:
    rows = []
    keys = sorted({(r["layout"], r["target"], r["method"]) for r in recs},
                  key=lambda k: (k[0], k[1], ["fw-today", "fw-replica", "dcp", "dcp-fw"].index(k[2])))
    for kind, target, m in keys:
        mine = [r for r in recs if (r["layout"], r["target"], r["method"]) == (kind, target, m)]
        rounds = sorted({r["round"] for r in mine})
        per_round = []
        for rnd in rounds:
            rs = [r for r in mine if r["round"] == rnd]
            r0 = next(r for r in rs if r["rank"] == 0)
            per_round.append({"stall_s": max(r["stall_s"] for r in rs), "durable_s": max(r["durable_s"] for r in rs),
                              "load_s": max(r["load_s"] for r in rs), "stored": r0["stored"],
                              "read_max": max(r["read"] for r in rs), "read_sum": sum(r["read"] for r in rs),
                              "link_read": r0.get("link_read")})
        med = {k: statistics.median(p[k] for p in per_round) for k in per_round[0] if per_round[0][k] is not None}
        unique = gib * (1 << 30) * (1 if kind == "ddp" else 2)
        med.update(layout=kind, target=target, method=m, unique=unique, rounds=len(rounds))
        rows.append(med)
    return rows


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    out = ["| layout | target | method | stored MiB (x unique) | read at restart MiB: all ranks / max rank (x ckpt) "
           "| durable s | restart s | stall s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        read_all = r.get("link_read", r["read_sum"]) if r["target"] == "nfs" else r["read_sum"]
        per = "" if r["target"] == "nfs" else f" / {r['read_max'] / mib:.0f} ({r['read_max'] / r['stored']:.2f}x)"
        out.append(f"| {r['layout']} | {r['target']} | {r['method']} | {r['stored'] / mib:.0f} "
                   f"({r['stored'] / r['unique']:.2f}x) | {read_all / mib:.0f} ({read_all / r['stored']:.2f}x){per} "
                   f"| {r['durable_s']:.2f} | {r['load_s']:.2f} | {r['stall_s']:.3f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state per rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=["ddp", "hsdp"])
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--no-dcp", action="store_true")
    ap.add_argument("--nfs", action="store_true", help="also over a shaped link to nfs-ganesha")
    ap.add_argument("--rate", type=int, default=1000, help="the link's rate, Mbit/s")
    ap.add_argument("--dir", default=None, help="local directory (default: a temporary one under the cwd)")
    ap.add_argument("--json")
    a = ap.parse_args()
    base = a.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".replicas-bench-", dir=base)
    args = {"gib": a.gib, "rounds": a.rounds, "layouts": a.layouts, "dir": work, "dcp": not a.no_dcp,
            "targets": ([] if a.no_local else ["local"]) + (["nfs"] if a.nfs else [])}
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "torch.distributed.checkpoint", "flashwrite"])
    t = time.perf_counter()
    try:
        if a.nfs:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from nfs_netns import LinkedNfsServer, ShapedLink
            from nfs_server import Export
            export = os.path.join(work, "export")
            os.makedirs(export)
            with ShapedLink(rate_mbit=a.rate) as link, \
                    LinkedNfsServer(link=link, exports=[Export(export)], workdir=os.path.join(work, "server")) as srv:
                args.update(nfs_url=srv.url_ports(""), export=export, host_dev=link.host_dev)
                recs = run(args)
        else:
            recs = run(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(recs, a.gib)
    print(f"{WORLD} ranks, {a.gib} GiB per rank, {a.rounds} rounds, {time.perf_counter() - t:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "records": recs, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
