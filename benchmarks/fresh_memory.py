"""What fresh memory costs on this machine as a process grows (issue 23's limit).

A first save faults in a staging pool as large as the state; an owned load faults in its
destinations. Both pay for memory the process has never touched. On the benchmark VM that
cost depends on how much memory is in use, not on flashwrite: the host backs the first few
GiB a guest touches quickly, and memory beyond them (or reported free to the host) slowly.
This grows one process by --step-mib at a time up to --gib, faulting each step in
(madvise MADV_POPULATE_WRITE, 4 KiB pages), and prints the CPU and wall time per GiB.

    python benchmarks/fresh_memory.py --gib 8 --json benchmarks/results/fresh-memory-8GiB-<date>.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--step-mib", type=int, default=512)
    ap.add_argument("--json")
    a = ap.parse_args()
    step = a.step_mib << 20
    held, rows = [], []
    while len(held) * step < a.gib * (1 << 30):
        m = mmap.mmap(-1, step, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(MADV_NOHUGEPAGE)
        w, c = time.perf_counter(), time.thread_time()
        m.madvise(MADV_POPULATE_WRITE)
        w, c = time.perf_counter() - w, time.thread_time() - c
        held.append(m)
        gib_at = len(held) * step / (1 << 30)
        rows.append({"gib_held": gib_at, "wall_s_per_gib": w * (1 << 30) / step, "cpu_s_per_gib": c * (1 << 30) / step})
        print(f"{gib_at:5.1f} GiB held: {rows[-1]['wall_s_per_gib']:6.2f} s/GiB wall, "
              f"{rows[-1]['cpu_s_per_gib']:6.2f} s/GiB CPU", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/fresh_memory.py --gib %g --step-mib %d" % (a.gib, a.step_mib),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
