"""Markdown tables from ``benchmarks/nfs.py --json`` results: the rows of one run, and
optionally the nfs:// row of an earlier build's run (``--before``), each with its ratio
to the ``nfs-cp`` and ``fio local disk`` rows of its own run (the machine is shared and
noisy, so only ratios within one run compare).

    python benchmarks/nfs_table.py AFTER.json [--before BEFORE.json]
"""

from __future__ import annotations

import argparse
import json


def _rows(res: dict, label: str, only: set[str] | None = None) -> list[str]:
    out = []
    for gib, size in res["sizes"].items():
        r = size["results"]
        n = size["bytes"]
        cp, fio = r.get("nfs-cp"), r.get("fio local disk")
        for name, m in r.items():
            if only and name not in only:
                continue
            cpu_s = f"{m['save_cpu_s']:.2f} + {m.get('save_server_cpu_s', 0):.2f}"
            cpu_l = f"{m['load_cpu_s']:.2f} + {m.get('load_server_cpu_s', 0):.2f}"
            vs_cp = f"{cp['save_s'] / m['save_s']:.2f}× / {cp['load_s'] / m['load_s']:.2f}×" if cp else "-"
            vs_fio = f"{fio['save_s'] / m['save_s']:.2f}× / {fio['load_s'] / m['load_s']:.2f}×" if fio else "-"
            out.append(f"| {gib} GiB | {name}{label} | {m['save_s']:.2f} s | {n / m['save_s'] / 2**20:.0f} | "
                       f"{m['load_s']:.2f} s | {n / m['load_s'] / 2**20:.0f} | {vs_cp} | {vs_fio} | {cpu_s} | {cpu_l} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("after")
    ap.add_argument("--before")
    a = ap.parse_args()
    after = json.load(open(a.after))
    print("| size | path | durable | MiB/s | cold load | MiB/s | vs nfs-cp (save / load) | vs fio (save / load) "
          "| CPU s save (client + server) | CPU s load (client + server) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    lines = _rows(after, "")
    if a.before:
        lines += _rows(json.load(open(a.before)), " (before: staged in /dev/shm)", {"nfs://", "nfs-cp"})
    for line in sorted(lines, key=lambda s: s.split("|")[1]):
        print(line)
    sw = after.get("sweep") or {}
    if sw.get("results"):
        n = sw["bytes"]
        print(f"\n`connections` at {sw['gib']:g} GiB:\n")
        print("| connections | durable | MiB/s | cold load | MiB/s | CPU s save (client + server) |")
        print("|---|---|---|---|---|---|")
        for c, m in sw["results"].items():
            print(f"| {c} | {m['save_s']:.2f} s | {n / m['save_s'] / 2**20:.0f} | {m['load_s']:.2f} s | "
                  f"{n / m['load_s'] / 2**20:.0f} | {m['save_cpu_s']:.2f} + {m['save_server_cpu_s']:.2f} |")


if __name__ == "__main__":
    main()
