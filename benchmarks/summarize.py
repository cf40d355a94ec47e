"""Turn a pytest-benchmark JSON file into the markdown tables of benchmarks/README.md.

    python benchmarks/summarize.py bench-results/sweep.json > bench-results/sweep.md

GB/s = bytes / median seconds of the timed rows, which are all flashwrite saves
and loads. The device limit is not a timed row: each row carries the device's own
time for its bytes (fio's clock + fsync, measured once per size in the same run,
see conftest.device_limit) in extra_info, and it is listed here in a table of its
own. "x device" = device seconds / the row's median seconds (above 1: faster than
the fio job).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def seconds(b: dict) -> float:
    # seconds_median: rows written by older suites, which timed fio's wall clock
    return b.get("extra_info", {}).get("seconds_median") or b["stats"]["median"]


def device_seconds(b: dict, kind: str) -> float | None:
    return b.get("extra_info", {}).get(f"device_{kind}_s")


def main(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    groups: dict[str, list[dict]] = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b["group"] or "-"].append(b)
    device: dict[tuple[str, int], float] = {}
    tools = set()
    for g, bs in groups.items():
        kind = "write" if g.startswith("save") else "read"
        for b in bs:
            if "device limit" in g:  # an older suite's timed row
                device[(kind, b["extra_info"]["bytes"])] = seconds(b)
            elif device_seconds(b, kind):
                device.setdefault((kind, b["extra_info"]["bytes"]), device_seconds(b, kind))
                tools.add(b["extra_info"].get("device_tool", "?"))
    m = data.get("machine_info", {})
    out = [f"Run {data.get('datetime', '?')[:19]} on {m.get('node', '?')}, {m.get('cpu', {}).get('count', '?')} CPUs, "
           f"Python {m.get('python_version', '?')}; medians of {data['benchmarks'][0]['stats']['rounds']} rounds."]
    if device:
        out += ["", "### device limit (not timed by pytest-benchmark: fio's own clock + fsync, same run)", "",
                f"{'; '.join(sorted(tools))}", "", "| bytes | write s | write GB/s | read s | read GB/s |",
                "|---|---|---|---|---|"]
        for n in sorted({n for _, n in device}):
            w, r = device.get(("write", n)), device.get(("read", n))
            out.append(f"| {n} | {w:.3f} | {n / w / 1e9:.2f} | " if w else f"| {n} | - | - | ")
            out[-1] += f"{r:.3f} | {n / r / 1e9:.2f} |" if r else "- | - |"
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
