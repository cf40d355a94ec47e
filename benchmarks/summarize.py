"""Turn a pytest-benchmark JSON file into the markdown tables of benchmarks/README.md.

    python benchmarks/summarize.py bench-results/sweep.json > bench-results/sweep.md

GB/s = bytes / median seconds. For the device-limit rows the device's own time
(fio's clock + fsync) is used, not the wall clock around fio, which includes
its start-up. "x device" compares each row with the device limit of the same
size measured in the same run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def seconds(b: dict) -> float:
    return b.get("extra_info", {}).get("seconds_median") or b["stats"]["median"]


def main(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    groups: dict[str, list[dict]] = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b["group"] or "-"].append(b)
    device = {}
    for g, bs in groups.items():
        if "device limit" in g:
            kind = "write" if g.startswith("save") else "read"
            for b in bs:
                device[(kind, b["extra_info"]["bytes"])] = seconds(b)
    m = data.get("machine_info", {})
    out = [f"Run {data.get('datetime', '?')[:19]} on {m.get('node', '?')}, {m.get('cpu', {}).get('count', '?')} CPUs, "
           f"Python {m.get('python_version', '?')}; medians of {data['benchmarks'][0]['stats']['rounds']} rounds."]
    for g in sorted(groups, key=lambda g: (not g.startswith("save"), "sweep" in g, g)):
        bs = groups[g]
        kind = "write" if g.startswith("save") else "read"
        has_stall = any("stall_median_s" in b.get("extra_info", {}) for b in bs)
        out += ["", f"### {g}", "",
                "| case | median s | GB/s | x device |" + (" stall s |" if has_stall else ""),
                "|---|---|---|---|" + ("---|" if has_stall else "")]
        for b in sorted(bs, key=lambda b: [(type(v).__name__, v) for v in (b.get("params") or {}).values()]):
            s = seconds(b)
            n = b["extra_info"].get("bytes", 0)
            dev = device.get((kind, n))
            ratio = f"{dev / s:.2f}" if dev and "device limit" not in g else "-"
            row = f"| {b['name'].split('[', 1)[-1].rstrip(']')} | {s:.3f} | {n / s / 1e9:.2f} | {ratio} |"
            if has_stall:
                st = b["extra_info"].get("stall_median_s")
                row += f" {st:.3f} |" if st is not None else " - |"
            out.append(row)
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(main(sys.argv[1]))
