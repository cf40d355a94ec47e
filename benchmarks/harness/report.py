"""Results as a table (rich when installed, plain text otherwise), JSON, and a PNG chart."""

from __future__ import annotations

import json
from typing import Any, TextIO

from flashwrite.ops.demo import render_table
from flashwrite.system.sizes import fmt_bytes

GiB = 1 << 30

COLUMNS = ["contender", "stall s", "durable s", "GB/s", "x device", "CPU s/GiB", "RSS +GiB", "cold load s",
           "x device read", "restart load s", "x read"]


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_rows(res: dict) -> list[list[str]]:
    dev = res["device"]
    rows = [["device limit (" + dev["tool"].split(",")[0] + ")", "-", _f(dev.get("write_s"), ".2f"), _f(dev.get("write_gbps"), ".2f"),
             "1.00", "-", "-", _f(dev.get("read_s"), ".2f"), "1.00", _f(dev.get("read_s"), ".2f"), "1.00"]]
    if res.get("memcpy"):
        rows.append([res["memcpy"]["name"], _f(res["memcpy"]["stall_s"], ".3f")] + ["-"] * (len(COLUMNS) - 2))
    for r in res["rows"]:
        if r.get("durable_s") is None:
            rows.append([f"{r['name']}: {r.get('status', '-')}"] + [""] * (len(COLUMNS) - 1))
            continue
        rows.append([r["name"] + ("" if r["status"] == "ok" else f" ({r['status']})"), _f(r["stall_s"], ".3f"),
                     _f(r["durable_s"], ".2f"), _f(r.get("gbps"), ".2f"), _f(r.get("vs_device"), ".2f"),
                     _f(r.get("cpu_s_per_gib"), ".2f"), _f(None if r.get("rss_growth") is None
                                                           else r["rss_growth"] / GiB, ".2f"),
                     _f(r.get("load_s"), ".2f"), _f(r.get("load_vs_device"), ".2f"),
                     _f(r.get("restart_s"), ".2f"), _f(r.get("restart_vs_device"), ".2f")])
    return rows


def title(res: dict) -> str:
    m = res["meta"]
    return (f"{fmt_bytes(res['bytes'])} training state, {m['rounds']} round(s), medians; {m['filesystem']}; "
            f"{m['cpus']} CPUs; {m['cold_cache']}")


def footnotes(res: dict, targets: bool = True) -> list[str]:
    """The notes under the table; targets: also the project's own pass/fail target lines
    (the demo, a user's tool, has none)."""
    out = ["stall: seconds the caller could not touch its tensors; durable: until fsync'd (and committed); "
           "x device: device-limit time / contender time (1.0 = as fast as the device-limit run; above 1.0 = faster "
           "than it: one fio configuration in one run is a reference, not the device's ceiling).",
           f"device limit: {res['device']['tool']}, same bytes, same run (write + fsync, then cold read)."]
    if res.get("memcpy"):
        out.append(f"{res['memcpy']['name']}: {res['memcpy']['label']}")
    out += [
           "RSS +GiB: peak resident memory of the process and its children over what it had before its first "
           "save (a staging pool kept between saves counts); CPU s/GiB: user+system seconds, children included.",
           "cold load: read back by the process that saved, its state and any staging pool still held; restart "
           "load: by a fresh process that does nothing else, as a restarted job would (page cache dropped for both)."]
    for r in res["rows"]:
        what = [r["label"]]
        if r.get("note"):
            what.append(r["note"])
        if r.get("backend"):
            what.append(f"backend {r['backend']}, O_DIRECT {r.get('direct')}, {r.get('stripes')} stripes")
        if r.get("first"):
            f = r["first"]
            what.append(f"first save (warm-up, not in the table): stall {f['stall_s']:.3f} s, "
                        f"durable {f['durable_s']:.2f} s, RSS +{f['rss_growth'] / GiB:.2f} GiB")
        if r.get("load_check") not in (None, "ok", "-"):  # "-": loads were not run
            what.append(f"LOAD CHECK FAILED: {r['load_check']}")
        out.append(f"{r['name']}: " + "; ".join(what))
    for t in res.get("targets", []) if targets else ():
        out.append(f"target {'met ' if t['met'] else 'MISSED'}: {t['target']}: {t['detail']}")
    return out


def print_table(res: dict, file: TextIO | None = None, plain: bool = False, targets: bool = True) -> None:
    render_table(COLUMNS, table_rows(res), title(res), footnotes(res, targets), file=file, plain=plain)


def markdown(res: dict) -> str:
    """The table as GitHub markdown (for READMEs and issue notes)."""
    rows = table_rows(res)
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("traceback", "stderr")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def write_json(res: dict, path: str, keep_tracebacks: bool = True) -> None:
    with open(path, "w") as f:
        json.dump(res if keep_tracebacks else _strip(res), f, indent=1, default=str)
        f.write("\n")


def plot(res: dict, path: str) -> str | None:
    """A PNG of the side-by-side figures. None when done, else why not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    rows = [r for r in res["rows"] if r.get("durable_s") is not None]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, max(3.5, 0.45 * len(rows) + 1.5)), sharey=True)
    y = list(range(len(rows)))
    dev = res["device"]
    panels = [("save: stall and time to durable (s)", [("durable", "durable_s", "#9ecae1"), ("stall", "stall_s", "#08519c")],
               dev.get("write_s"), "device limit"),
              ("CPU seconds per GiB written", [("CPU", "cpu_s_per_gib", "#fdae6b")], None, None),
              ("cold load (s)", [("in the saving process", "load_s", "#a1d99b"),
                                 ("restart (fresh process)", "restart_s", "#31a354")], dev.get("read_s"), "device read")]
    for ax, (ttl, series, ref, ref_label) in zip(axes, panels):
        h = 0.8 / len(series)
        for j, (lab, field, color) in enumerate(series):
            vals = [r.get(field) or 0 for r in rows]
            ax.barh([i + (j - (len(series) - 1) / 2) * h for i in y], vals, height=h, color=color, label=lab)
        if ref:
            ax.axvline(ref, color="#e6550d", linestyle="--", label=f"{ref_label} ({ref:.2f} s)")
        if ttl.startswith("save") and res.get("memcpy"):
            ax.axvline(res["memcpy"]["stall_s"], color="#756bb1", linestyle=":", label="memcpy")
        ax.set_title(ttl, fontsize=10)
        ax.legend(fontsize=8, loc="best")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=9)
    axes[0].invert_yaxis()
    fig.suptitle(title(res), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


OVERHEAD_COLUMNS = ["mode", "train s", "slowdown %", "blocked %", "checkpoints", "stall/ckpt s (median)",
                    "total stall s", "x torch.save"]


def print_overhead(res: dict, file: TextIO | None = None, plain: bool = False) -> None:
    head = (f"training overhead: {res['meta']['model']}, {res['meta']['steps']} steps, checkpoint every "
            f"{res['meta']['every']} steps ({fmt_bytes(res['meta']['checkpoint_bytes'])} each), "
            f"{res['meta']['rounds']} round(s), medians")
    render_table(OVERHEAD_COLUMNS, overhead_rows(res), head, res.get("notes", []), file=file, plain=plain)


def overhead_rows(res: dict) -> list[list[str]]:
    out = []
    for r in res["rows"]:
        if r.get("train_s") is None:
            out.append([f"{r['name']}: {r.get('status', '-')}"] + [""] * (len(OVERHEAD_COLUMNS) - 1))
            continue
        out.append([r["name"], _f(r["train_s"], ".2f"), _f(r.get("slowdown_pct"), ".1f"), _f(r.get("stall_pct"), ".1f"),
                    str(r.get("checkpoints", 0)),
                    _f(r.get("stall_median_s"), ".3f"), _f(r.get("stall_total_s"), ".2f"),
                    _f(r.get("overhead_vs_torch_save"), ".3f")])
    return out


def overhead_markdown(res: dict) -> str:
    header = OVERHEAD_COLUMNS
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in overhead_rows(res)]
    return "\n".join(out)
