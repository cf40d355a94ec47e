#!/usr/bin/env python3
"""How long fork() takes beside a staging pool (issue 27, item 1).

PyTorch DataLoader workers are forked, by default at every epoch. A fork copies the
page tables of every private mapping, so a populated pool of tens of GiB made each
fork slow (and with CUDA pinning, worse: see csrc/core/aligned_buffer.hpp). The pool's
private slabs are MADV_DONTFORK now, so a fork skips them.

Measured, with one process and the same bytes each time (median of --rounds forks,
each child exiting at once):
  - nothing:        the baseline fork;
  - tensor:         a faulted-in torch tensor of --gib GiB (4 KiB pages);
  - thp mapping:    a faulted-in anonymous mapping advised MADV_HUGEPAGE, as the
                    pool's slabs are (what a pool was before MADV_DONTFORK);
  - flashwrite:     a flashwrite staging pool of --gib GiB (Writer.reserve).

    python benchmarks/fork_time.py --gib 2 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time


def fork_s(rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    import flashwrite as fw
    nbytes = int(args.gib * (1 << 30))
    res = {"gib": args.gib, "rounds": args.rounds, "nothing_s": fork_s(args.rounds)}
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # faulted in, as a reserved pool is
    res["tensor_s"] = fork_s(args.rounds)
    del t
    m = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    for off in range(0, nbytes, 4096):  # fault in (huge pages where THP allows)
        m[off] = 1
    res["thp_mapping_s"] = fork_s(args.rounds)
    m.close()
    w = fw.Writer()
    w.reserve(nbytes, block=True)
    res["pool_bytes"] = w.pool_bytes
    res["flashwrite_s"] = fork_s(args.rounds)
    w.close()
    for k in ("nothing_s", "tensor_s", "thp_mapping_s", "flashwrite_s"):
        print(f"fork beside {k[:-2]:<12} {res[k] * 1e3:8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
