"""``flashwrite demo``: save and load one synthetic training state with flashwrite and
with torch.save / torch.load, side by side, next to the device's own limit and a memcpy.

One process, one round, no other project: what a user runs first on their own
storage. The full comparison (every peer, rounds, CPU and memory figures, one process
per contender) is the repository's ``benchmarks/compare.py``; it draws its tables with
``render_table`` and checks loads with ``check_loaded``, both here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, TextIO

import torch

from ..loading.load import load
from ..saving.save import save_async
from ..system.sizes import fmt_bytes
from . import devicelimit
from .synthetic import make_state, planned_bytes, state_bytes, tensors_of

COLUMNS = ["contender", "stall s", "durable s", "GB/s", "x device", "cold load s", "x device read"]


def check_loaded(state: Any, loaded: Any) -> str:
    """'ok' when the loaded object holds every tensor byte of the state (checked on
    the largest tensors), else what differs."""
    src, got = tensors_of(state), tensors_of(loaded)
    got_bytes = sum(t.numel() * t.element_size() for t in got)
    if state_bytes(state) != got_bytes:
        return f"loaded {got_bytes} tensor bytes, saved {state_bytes(state)}"
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for t in got:
        by_shape.setdefault((tuple(t.shape), t.dtype), []).append(t)
    for s in sorted(src, key=lambda t: -t.numel())[:3]:
        if not any(torch.equal(s, t) for t in by_shape.get((tuple(s.shape), s.dtype), [])):
            return f"a {tuple(s.shape)} tensor came back different"
    return "ok"


def filesystem_of(directory: str) -> str:
    """'fstype (device on mountpoint)' of the mount holding directory, or '?'."""
    try:
        best = ("", "?")
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (directory + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                    best = (mnt, f"{fstype} ({dev} on {mnt})")
        return best[1]
    except OSError:
        return "?"


def _fsync(path: str) -> None:
    """fsync a new file and its directory (without the latter, the file may vanish in a crash)."""
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _torch_save(state: Any, path: str) -> dict:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
    _fsync(path)
    t = time.perf_counter() - t0
    return {"stall_s": t, "durable_s": t}


def _flashwrite_save(state: Any, path: str) -> dict:
    t0 = time.perf_counter()
    fut = save_async(state, path)
    stall = time.perf_counter() - t0
    st = fut.result()
    return {"stall_s": stall, "durable_s": time.perf_counter() - t0, "backend": st.backend, "direct": st.direct,
            "stripes": st.stripes}


# key: (name, how it was called, save, load, the warm-up: the same call on the same state, or a tiny state)
CONTENDERS: dict[str, tuple[str, str, Callable[[Any, str], dict], Callable[[str], Any], bool]] = {
    "torch_save": ("torch.save + fsync", "torch.save to one file, then fsync file and directory; torch.load",
                   _torch_save, lambda p: torch.load(p, map_location="cpu", weights_only=True), False),
    "flashwrite": ("flashwrite", "flashwrite.save_async with default settings, durable = committed; flashwrite.load",
                   _flashwrite_save, load, True),
}


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _measure(key: str, state: Any, workdir: str, drop: bool, cache: str) -> dict:
    """One contender: a warm-up save (a pool kept between saves starts at the second
    save, as in training), one measured save, one cold load."""
    name, label, save, load_fn, warm_whole = CONTENDERS[key]
    row: dict[str, Any] = {"key": key, "name": name, "label": label}
    path = os.path.join(workdir, key)
    try:
        save(state if warm_whole else make_state(1 << 20, seed=7), path + ".warmup")
        _remove(path + ".warmup")
        devicelimit.drop_caches() if drop else None
        row.update(save(state, path))
        devicelimit.drop_caches() if drop else None
        t0 = time.perf_counter()
        loaded = load_fn(path)
        row["load_s"] = time.perf_counter() - t0
        row["load_check"] = check_loaded(state, loaded)
        del loaded
        row.update(status="ok", cache=cache)
    except Exception as e:  # noqa: BLE001 - a failed save is a row of the table, then exit 1
        row["status"] = f"failed: {type(e).__name__}: {e}"
    finally:
        _remove(path)
        _remove(path + ".warmup")
    return row


def run(size: int, directory: str, device_tool: str = "auto", drop_caches: bool = True,
        log: Callable[[str], None] = print) -> dict:
    """The demo's figures: {"meta", "bytes", "device", "memcpy", "rows"} (the shape of
    ``benchmarks/compare.py``'s results, fewer fields)."""
    parent = os.path.abspath(directory)
    nbytes = planned_bytes(size)
    devicelimit.check_space(parent, 2 * nbytes)
    workdir = tempfile.mkdtemp(prefix=".flashwrite-demo-", dir=parent)
    why_not = devicelimit.drop_caches() if drop_caches else "not asked (--no-drop-caches)"
    cache = "page cache dropped before every save and load" if why_not is None else why_not
    meta = {"size_requested": size, "directory": parent, "filesystem": filesystem_of(parent),
            "cpus": len(os.sched_getaffinity(0)), "cold_cache": cache, "torch": torch.__version__}
    try:
        state = make_state(size)
        dev = devicelimit.device_limit(workdir, nbytes, device_tool)
        log(f"device limit ({dev['tool']}): write {dev['write_s']:.2f} s, read {dev['read_s']:.2f} s")
        dev["write_gbps"], dev["read_gbps"] = nbytes / dev["write_s"] / 1e9, nbytes / dev["read_s"] / 1e9
        m = devicelimit.memcpy_seconds(tensors_of(state))
        memcpy = {"name": f"memcpy, {m['threads']} threads", "stall_s": m["seconds"],
                  "label": f"memcpy of every tensor into one warm buffer, {m['threads']} threads (best of 3)"}
        rows = []
        for key in CONTENDERS:
            r = _measure(key, state, workdir, drop_caches and why_not is None, cache)
            if r.get("durable_s"):
                r["gbps"], r["vs_device"] = nbytes / r["durable_s"] / 1e9, dev["write_s"] / r["durable_s"]
                r["load_vs_device"] = dev["read_s"] / r["load_s"]
            log(f"{r['name']}: " + (f"stall {r['stall_s']:.3f} s, durable {r['durable_s']:.3f} s, "
                                    f"cold load {r['load_s']:.3f} s" if r["status"] == "ok" else r["status"]))
            rows.append(r)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"meta": meta, "bytes": nbytes, "device": dev, "memcpy": memcpy, "rows": rows}


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_rows(res: dict) -> list[list[str]]:
    dev = res["device"]
    rows = [[f"device limit ({dev['tool'].split(',')[0]})", "-", _f(dev.get("write_s"), ".2f"),
             _f(dev.get("write_gbps"), ".2f"), "1.00", _f(dev.get("read_s"), ".2f"), "1.00"],
            [res["memcpy"]["name"], _f(res["memcpy"]["stall_s"], ".3f")] + ["-"] * 5]
    for r in res["rows"]:
        if r.get("durable_s") is None:
            rows.append([f"{r['name']}: {r.get('status', '-')}"] + [""] * 6)
            continue
        rows.append([r["name"], _f(r["stall_s"], ".3f"), _f(r["durable_s"], ".2f"), _f(r.get("gbps"), ".2f"),
                     _f(r.get("vs_device"), ".2f"), _f(r.get("load_s"), ".2f"), _f(r.get("load_vs_device"), ".2f")])
    return rows


def notes(res: dict) -> list[str]:
    out = ["stall: seconds the caller could not touch its tensors; durable: until fsync'd (and committed); "
           "x device: device-limit time / contender time (1.0 = as fast as the device-limit run; above 1.0 = faster "
           "than it: one fio configuration in one run is a reference, not the device's ceiling).",
           f"device limit: {res['device']['tool']}, same bytes, same run (write + fsync, then cold read).",
           f"{res['memcpy']['name']}: {res['memcpy']['label']}"]
    for r in res["rows"]:
        what = [r["label"]]
        if r.get("backend"):
            what.append(f"backend {r['backend']}, O_DIRECT {r.get('direct')}, {r.get('stripes')} stripes")
        if r.get("load_check") not in (None, "ok"):
            what.append(f"LOAD CHECK FAILED: {r['load_check']}")
        out.append(f"{r['name']}: " + "; ".join(what))
    return out


def render_table(columns: list[str], rows: list[list[str]], heading: str, footnotes: list[str],
                 file: TextIO | None = None, plain: bool = False) -> None:
    """A table with its heading and notes: rich's on a terminal when installed (on a
    narrow one no word is cut: names and figures stay whole, headers wrap between
    their words, borders go), else aligned plain text."""
    file = file or sys.stdout
    if not plain:
        try:
            from rich import box
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if plain:
        print(heading, file=file)
        print(format_plain(rows, columns), file=file)
        for n in footnotes:
            print(n, file=file)
        return
    probe = Console(file=file)
    con = Console(file=file, width=probe.width if probe.is_terminal else 160)
    need = [max(len(str(r[i])) for r in rows) if rows else 0 for i in range(len(columns))]
    words = [max(len(w) for w in c.split()) for c in columns]
    narrow = sum(max(n, len(c)) + 3 for n, c in zip(need, columns)) > con.width
    t = Table(title=heading, title_justify="left", box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
              pad_edge=not narrow, collapse_padding=narrow)
    for i, c in enumerate(columns):
        fit = max(need[i], words[i])
        t.add_column(c, justify="left" if i == 0 else "right", overflow="fold", min_width=fit,
                     width=fit if narrow else None)
    for r in rows:
        t.add_row(*r)
    con.print(t)
    for n in footnotes:
        con.print(n, markup=False, highlight=False)


def format_plain(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def title(res: dict) -> str:
    m = res["meta"]
    return f"{fmt_bytes(res['bytes'])} training state; {m['filesystem']}; {m['cpus']} CPUs; {m['cold_cache']}"


def in_short(res: dict) -> str | None:
    """The table in one sentence, when both saves ran."""
    rows = {r["key"]: r for r in res["rows"]}
    fw, ts = rows.get("flashwrite", {}), rows.get("torch_save", {})
    if not (fw.get("durable_s") and ts.get("durable_s")):
        return None

    def than(ours: float, theirs: float, what: str) -> str:
        r = theirs / ours if ours else float("inf")
        return f"{r:.1f}x sooner than {what}" if r >= 1 else f"{1 / r:.1f}x later than {what}"

    return (f"In short: with flashwrite, training could go on after {fw['stall_s']:.3f} s, where torch.save held "
            f"it for {ts['stall_s']:.2f} s. The checkpoint was safely on disk after {fw['durable_s']:.2f} s, "
            f"{than(fw['durable_s'], ts['durable_s'], 'torch.save + fsync')}, and it loaded back from a cold cache "
            f"in {fw['load_s']:.2f} s, {than(fw['load_s'], ts['load_s'], 'torch.load')}.")


def main(size: int, directory: str, device_tool: str = "auto", drop_caches: bool = True, plain: bool = False,
         quiet: bool = False, json_path: str | None = None) -> int:
    """The command: the table, the sentence, the JSON; 1 when a save or load failed."""
    print(f"flashwrite demo: saving and loading a {fmt_bytes(size)} synthetic training state "
          f"(GPT-like parameters + Adam moments + optimizer fields) in {os.path.abspath(directory)}", flush=True)
    log = (lambda _msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    res = run(size, directory, device_tool, drop_caches, log)
    render_table(COLUMNS, table_rows(res), title(res), notes(res), plain=plain)
    short = in_short(res)
    if short:
        print("\n" + short)
    print("\nEvery peer, rounds, CPU and memory: python benchmarks/compare.py (in a source checkout).")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
            f.write("\n")
    bad = [r for r in res["rows"] if r.get("status") != "ok" or r.get("load_check") != "ok"]
    for r in bad:
        what = r["status"] if r["status"] != "ok" else f"load check failed: {r['load_check']}"
        print(f"error: {r['name']}: {what}", file=sys.stderr)
    return 1 if bad else 0
