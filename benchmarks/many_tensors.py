"""States with many small tensors (optimizer states, MoE experts, per-layer buffers):
flashwrite against torch.save + fsync, torch.load and dcp.save, side by side in one run.
Median of --rounds after one warm-up save each; cold loads drop the page cache first.

    python benchmarks/many_tensors.py --tensors 20000 200000 --rounds 3 --dir /tmp/mt [--json out.json]

Reports stall (flashwrite: save_async until staged), time to durable, cold load, the
manifest + index bytes per tensor, and time per tensor (to see that nothing is quadratic).
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
from flashwrite.ops.devicelimit import drop_caches


def make_state(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    # 1 KiB each, nested like an optimizer state: {"state": {i: {"exp_avg", "exp_avg_sq"}}, "params": ...}
    return {"layers": {f"l{j}": {f"p{i}": torch.randn(256, generator=g) for i in range(min(8, n - 8 * j))}
                       for j in range(-(-n // 8))}}


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def run(n: int, rounds: int, directory: str, dcp_max: int) -> dict:
    state = make_state(n)
    w = fw.Writer()
    out: dict[str, list[float]] = {}

    def rec(k: str, v: float) -> None:
        out.setdefault(k, []).append(v)

    import torch.distributed.checkpoint as dcp
    for r in range(rounds + 1):  # round 0 warms up every contender
        p = os.path.join(directory, f"fw-{r}")
        t0 = time.perf_counter()
        fut = w.save_async(state, p)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        pt = os.path.join(directory, f"pt-{r}.pt")
        t3 = time.perf_counter()
        torch.save(state, pt)
        fsync_tree(pt)
        t4 = time.perf_counter()
        dp = os.path.join(directory, f"dcp-{r}")
        t5 = time.perf_counter()
        if n <= dcp_max:
            dcp.save(state, checkpoint_id=dp)
            fsync_tree(dp)
        t6 = time.perf_counter()
        drop_caches()
        t7 = time.perf_counter()
        fw.load(p)
        t8 = time.perf_counter()
        drop_caches()
        t9 = time.perf_counter()
        torch.load(pt, weights_only=True)
        t10 = time.perf_counter()
        if r:
            rec("flashwrite stall", t1 - t0)
            rec("flashwrite durable", t2 - t0)
            rec("torch.save + fsync", t4 - t3)
            if n <= dcp_max:
                rec("dcp.save + fsync", t6 - t5)
            rec("flashwrite cold load", t8 - t7)
            rec("torch.load cold", t10 - t9)
        meta = os.path.getsize(os.path.join(p, "flashwrite.json")) + \
            os.path.getsize(os.path.join(p, "model.safetensors.index.json"))
        for q in (p, dp):
            shutil.rmtree(q, ignore_errors=True)
        os.unlink(pt)
    w.close()
    med = {k: statistics.median(v) for k, v in out.items()}
    med["manifest+index bytes/tensor"] = meta / n
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[20000, 200000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fw-many-tensors")
    ap.add_argument("--json")
    ap.add_argument("--dcp-max", type=int, default=50000,
                    help="measure dcp.save only up to this many tensors (it takes ~1 ms per tensor)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    results = {}
    for n in a.tensors:
        res = run(n, a.rounds, a.dir, a.dcp_max)
        results[n] = res
        print(f"\n{n} tensors x 1 KiB ({n / 1024:.1f} MiB), median of {a.rounds} after a warm-up")
        for k, v in res.items():
            extra = "" if "bytes" in k else f"   ({v / n * 1e6:.1f} us/tensor)"
            print(f"  {k:<30} {v:10.3f}{extra}")
        r = res
        print(f"  ratios: durable/torch.save {r['flashwrite durable'] / r['torch.save + fsync']:.2f}, "
              f"cold load/torch.load {r['flashwrite cold load'] / r['torch.load cold']:.2f}")
    if len(results) > 1:
        lo, hi = min(results), max(results)
        print(f"\ntime per tensor, {hi} against {lo} tensors (1.0: linear)")
        for k in ("flashwrite stall", "flashwrite durable", "flashwrite cold load", "torch.save + fsync",
                  "torch.load cold"):
            print(f"  {k:<30} {results[hi][k] / hi / (results[lo][k] / lo):6.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
