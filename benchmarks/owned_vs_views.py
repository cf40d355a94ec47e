"""Cold load of the same checkpoint with owned CPU tensors (the default) and with
zero_copy=True (views of whole-stripe buffers), each in a fresh process after the page
cache is dropped, interleaved, median of --rounds. Owned tensors are filled by the
native job out of its bounce chunks (csrc/read/host_placer.*) and should be within
~10% of views.

    python benchmarks/owned_vs_views.py --gib 1 2 --rounds 3 --dir /tmp/ovv   (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import torch

import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches

CHILD = """
import json, sys, time, flashwrite as fw
t0 = time.perf_counter()
out = fw.load(sys.argv[1], zero_copy=sys.argv[2] == "1")
dt = time.perf_counter() - t0
print(json.dumps({"s": dt, "bytes": sum(t.nbytes for t in out.values())}))
"""


def make_state(gib: float) -> dict:
    n = int(gib * (1 << 30)) // 4
    per = n // 64  # 64 tensors, like a model's layers
    return {f"layer{i}.weight": torch.full((per,), float(i)) for i in range(64)}


def cold(path: str, zero_copy: bool) -> float:
    drop_caches()
    r = subprocess.run([sys.executable, "-c", CHILD, path, "1" if zero_copy else "0"], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/owned_vs_views")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    for gib in args.gib:
        path = os.path.join(args.dir, f"ck-{gib:g}g")
        fw.save(make_state(gib), path)
        times: dict[str, list[float]] = {"views": [], "owned": []}
        for _ in range(args.rounds):
            times["views"].append(cold(path, True))
            times["owned"].append(cold(path, False))
        v, o = statistics.median(times["views"]), statistics.median(times["owned"])
        print(json.dumps({"gib": gib, "views_s": round(v, 3), "owned_s": round(o, 3), "owned_over_views": round(o / v, 3),
                          "all": {k: [round(x, 3) for x in xs] for k, xs in times.items()}}), flush=True)
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
