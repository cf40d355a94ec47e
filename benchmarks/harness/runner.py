"""The side-by-side comparison: every contender saves (then loads) the same
synthetic training state, in one run, next to the device limit and a memcpy.

Isolation: by default each contender runs in a fresh subprocess (one per
contender per round), so peak RSS and CPU time belong to that contender alone
(no allocator caches, pools or threads left behind by another library) and an
import of one peer cannot slow another. Rounds interleave the contenders, so
disk noise hits all of them alike; the report shows medians over rounds, and
ratios are taken within a round before the median.

Each checkpoint is read back twice, cold: by the process that saved it (state and any
pool still held) and by a fresh process that does only that (the restart load).

Contenders that keep state across saves (staging pools, writer processes) do
one unmeasured warm-up save first, as a training run would have done by its
second checkpoint; the first save's figures are kept in the JSON ("first").
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from flashwrite.ops import devicelimit
from flashwrite.ops.demo import check_loaded, filesystem_of
from flashwrite.ops.synthetic import make_state, planned_bytes, state_bytes, tensors_of

from . import peers
from .measure import Meter, resident_bytes, run_in_subprocess

GiB = 1 << 30


def _contender(spec: dict) -> peers.Contender:
    key = spec["contender"]
    if key == "flashwrite" and spec.get("flashwrite_options"):
        return peers.Flashwrite(**spec["flashwrite_options"])
    return peers.contenders(spec.get("dcp_threads", peers.DCP_THREADS))[key]


def _checkpoint_path(spec: dict) -> str:
    return os.path.join(spec["dir"], peers.file_name(spec["contender"]))


def _timed_load(c: peers.Contender, path: str, template: Any) -> tuple[Any, float, float]:
    """c's load of path into template: (what it returned, wall seconds, CPU seconds)."""
    with Meter() as m:
        t0 = time.perf_counter()
        loaded = c.load(path, template)
        seconds = time.perf_counter() - t0
    return loaded, seconds, m.cpu_s


def _failure(e: Exception) -> str:
    text = str(e).strip()
    return f"failed: {type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def run_worker(spec: dict, state: Any = None) -> dict:
    """Run one contender (or the memcpy reference) on a state: warm-up save if it
    needs one, one measured save, one cold load. Returns the measured figures."""
    key = spec["contender"]
    if state is None:
        state = make_state(spec["size"], seed=spec.get("seed", 0))
    nbytes = state_bytes(state)
    out: dict[str, Any] = {"key": key, "bytes": nbytes}
    if key == "memcpy":
        m = devicelimit.memcpy_seconds(tensors_of(state))
        out.update(status="ok", name=f"memcpy, {m['threads']} threads", stall_s=m["seconds"],
                   label=f"memcpy of every tensor into one warm buffer, {m['threads']} threads (best of 3)")
        return out
    c = _contender(spec)
    out.update(name=c.name, label=c.label, note=c.note())
    why = c.available()
    if why:
        out["status"] = f"skipped: {why}"
        return out
    path = _checkpoint_path(spec)
    drop = spec.get("drop_caches", True)
    base = resident_bytes()
    try:
        warm = path + ".warmup"
        if c.needs_warmup:
            # A pool or worker kept between saves: the steady state starts at the second save.
            devicelimit.drop_caches() if drop else None
            with Meter() as m:
                r = c.save(state, warm)
            out["first"] = {"stall_s": r["stall_s"], "durable_s": r["durable_s"], "cpu_s": m.cpu_s,
                            "rss_growth": m.peak_bytes - base}
        else:
            # Stateless: a tiny save pays the lazy imports and first-call set-up only.
            c.save(make_state(1 << 20, seed=7), warm)
        peers.remove(warm)
        why_not = devicelimit.drop_caches() if drop else spec.get("cache_note", "page cache not dropped")
        with Meter() as m:
            r = c.save(state, path)
        out.update(r)
        out["cpu_s"] = m.cpu_s
        # Against the memory before any save: a pool kept from the warm-up counts.
        out["rss_growth"] = m.peak_bytes - base
        if spec.get("load", True):
            why_not = (devicelimit.drop_caches() if drop else why_not) or why_not
            template = c.load_template(state, lambda: make_state(spec["size"], seed=spec.get("seed", 0) + 1))
            loaded, out["load_s"], out["load_cpu_s"] = _timed_load(c, path, template)
            out["load_check"] = check_loaded(state, loaded)
            del loaded, template
        out["cache"] = "dropped" if why_not is None else why_not
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash of the run
        out["status"] = _failure(e)
        out["traceback"] = traceback.format_exc()[-4000:]
    finally:
        c.close()
        if not (spec.get("keep_checkpoint") and out.get("status") == "ok"):
            peers.remove(path)
        peers.remove(path + ".warmup")
    return out


def restart_worker(spec: dict) -> dict:
    """The restart load: the checkpoint run_worker kept, read back cold by a process that
    has done nothing else (as a restarted job does), holding only what the contender's load
    needs (a template for peers that load in place). The state is made again from its seed
    to check the bytes, after the clock."""
    c = _contender(spec)
    size, seed = spec["size"], spec.get("seed", 0)
    try:
        why_not = devicelimit.drop_caches() if spec.get("drop_caches", True) else "page cache not dropped"
        # A small state of the same structure stands for the saved one (a peer may want its
        # names); the full one is made after the clock, so the load holds no extra memory.
        template = c.load_template(make_state(1 << 20, seed=seed), lambda: make_state(size, seed=seed + 1))
        loaded, seconds, cpu_s = _timed_load(c, _checkpoint_path(spec), template)
        del template
        return {"status": "ok", "restart_s": seconds, "restart_cpu_s": cpu_s,
                "restart_check": check_loaded(make_state(size, seed=seed), loaded),
                "restart_cache": "dropped" if why_not is None else why_not}
    except Exception as e:  # noqa: BLE001 - a peer's failure is a result
        return {"status": _failure(e)}
    finally:
        c.close()


def _restart(spec: dict, r: dict, isolation_timeout_s: float) -> None:
    """Run restart_worker on the checkpoint r's worker kept, fold its figures into r, and
    remove the checkpoint."""
    try:
        rr = run_in_subprocess("harness.runner:restart_worker", spec, isolation_timeout_s, {})
        if rr.get("status") == "ok":
            r.update({k: v for k, v in rr.items() if k != "status"})
        else:  # shown where the load checks are
            r["restart_check"] = "restart load " + rr.get("status", "failed")
    finally:
        peers.remove(_checkpoint_path(spec))


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def compare(size: int, contenders: list[str], directory: str | None = None, rounds: int = 1,
            isolation: str = "subprocess", load: bool = True, device_tool: str = "auto",
            dcp_threads: int = peers.DCP_THREADS, drop_caches: bool = True, seed: int = 0,
            flashwrite_options: dict | None = None, log: Callable[[str], None] = print,
            timeout_s: float = 1800) -> dict:
    """Run the comparison and return the results (see report.py for their shape)."""
    known = peers.contenders(dcp_threads)
    for k in contenders:
        if k not in known:
            raise ValueError(f"unknown contender {k!r}; known: {', '.join(known)}")
    parent = os.path.abspath(directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    # Each contender's checkpoint is removed before the next one starts; a warm-up copy may sit beside it.
    devicelimit.check_space(parent, 2 * planned_bytes(size))
    workdir = tempfile.mkdtemp(prefix=".flashwrite-bench-", dir=parent)
    can_drop = devicelimit.drop_caches() if drop_caches else "not asked (--no-drop-caches)"
    meta = {"size_requested": size, "rounds": rounds, "isolation": isolation, "directory": parent,
            "filesystem": filesystem_of(parent), "cpus": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
            "python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release(),
            "cold_cache": "page cache dropped before every save and load" if can_drop is None else can_drop,
            "dcp_threads": dcp_threads, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import flashwrite  # the report names the build it found; a broken one still gets its report
        meta["flashwrite"] = flashwrite.__version__
        meta["flashwrite_backend"] = flashwrite.backend_info(parent)
    except Exception as e:  # noqa: BLE001
        meta["flashwrite"] = f"unavailable: {e}"
    shared_state = make_state(size, seed=seed) if isolation == "inprocess" else None
    nbytes = planned_bytes(size)
    per: dict[str, list[dict]] = {k: [] for k in ["memcpy", *contenders]}
    devices: list[dict] = []
    try:
        for rnd in range(rounds):
            for key in ["device", "memcpy", *contenders]:
                spec = {"contender": key, "size": size, "seed": seed, "dir": workdir, "load": load,
                        "drop_caches": drop_caches and can_drop is None, "cache_note": can_drop,
                        "dcp_threads": dcp_threads,
                        "flashwrite_options": flashwrite_options or {}, "keep_checkpoint": load}
                t0 = time.perf_counter()
                if key == "device":
                    d = devicelimit.device_limit(workdir, nbytes, device_tool)
                    d["bytes"] = nbytes
                    devices.append(d)
                    log(f"[round {rnd + 1}/{rounds}] device limit ({d['tool']}): write {d['write_s']:.2f} s, "
                        f"read {d['read_s']:.2f} s")
                    continue
                why = known[key].available() if key in known else None
                if why:
                    # No need to start a process to learn that a peer is missing.
                    c = known[key]
                    r = {"key": key, "name": c.name, "label": c.label, "status": f"skipped: {why}"}
                elif isolation == "subprocess":
                    r = run_in_subprocess("harness.runner:run_worker", spec, timeout_s, {"key": spec["contender"]})
                else:
                    r = run_worker(spec, shared_state)
                if r.get("status") == "ok" and spec["keep_checkpoint"]:
                    _restart(spec, r, timeout_s)
                per[key].append(r)
                msg = r.get("status", "?")
                if msg == "ok" and "durable_s" in r:
                    msg = (f"stall {r['stall_s']:.3f} s, durable {r['durable_s']:.3f} s"
                           + (f", cold load {r['load_s']:.3f} s" if "load_s" in r else "")
                           + (f", restart load {r['restart_s']:.3f} s" if "restart_s" in r else ""))
                elif msg == "ok":
                    msg = f"{r['stall_s']:.3f} s"
                log(f"[round {rnd + 1}/{rounds}] {r.get('name', key)}: {msg} ({time.perf_counter() - t0:.0f} s)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(meta, nbytes, devices, per)


def summarize(meta: dict, nbytes: int, devices: list[dict], per: dict[str, list[dict]]) -> dict:
    """Medians over rounds; ratios to the device limit taken within each round."""
    dev = {"tool": devices[0]["tool"] if devices else "?",
           "write_s": _median([d["write_s"] for d in devices]), "read_s": _median([d["read_s"] for d in devices]),
           "rounds": devices}
    if dev["write_s"]:
        dev["write_gbps"] = nbytes / dev["write_s"] / 1e9
    if dev["read_s"]:
        dev["read_gbps"] = nbytes / dev["read_s"] / 1e9
    mem = [r for r in per.pop("memcpy", []) if r.get("status") == "ok"]
    memcpy = {"name": mem[0]["name"], "label": mem[0]["label"],
              "stall_s": _median([r["stall_s"] for r in mem])} if mem else None
    rows = []
    for key, runs in per.items():
        ok = [(i, r) for i, r in enumerate(runs) if r.get("status") == "ok"]
        first = runs[0] if runs else {"key": key}
        row: dict[str, Any] = {"key": key, "name": first.get("name", key), "label": first.get("label", key),
                               "note": first.get("note", ""),
                               "rounds_ok": len(ok), "runs": runs}
        if not ok:
            row["status"] = first.get("status", "not run")
            rows.append(row)
            continue
        row["status"] = "ok" if len(ok) == len(runs) else f"ok in {len(ok)}/{len(runs)} rounds: " + next(
            r["status"] for r in runs if r.get("status") != "ok")
        rs = [r for _, r in ok]
        for f in ("stall_s", "durable_s", "cpu_s", "rss_growth", "load_s", "load_cpu_s", "restart_s",
                  "restart_cpu_s"):
            row[f] = _median([r.get(f) for r in rs])
        row["gbps"] = nbytes / row["durable_s"] / 1e9 if row["durable_s"] else None
        row["cpu_s_per_gib"] = row["cpu_s"] / (nbytes / GiB) if row["cpu_s"] is not None else None
        row["vs_device"] = _median([devices[i]["write_s"] / r["durable_s"] for i, r in ok
                                    if i < len(devices) and r.get("durable_s")])
        row["load_vs_device"] = _median([devices[i]["read_s"] / r["load_s"] for i, r in ok
                                         if i < len(devices) and r.get("load_s")])
        row["restart_vs_device"] = _median([devices[i]["read_s"] / r["restart_s"] for i, r in ok
                                            if i < len(devices) and r.get("restart_s")])
        row["load_check"] = ", ".join(sorted({r[f] for r in rs for f in ("load_check", "restart_check") if f in r}
                                             or {"-"}))
        row["cache"] = ", ".join(sorted({r.get("cache", "?") for r in rs}))
        for f in ("backend", "direct", "stripes", "written_s"):
            if f in rs[0]:
                row[f] = rs[0][f]
        firsts = [r["first"] for r in rs if "first" in r]
        if firsts:
            row["first"] = {f: _median([x[f] for x in firsts]) for f in firsts[0]}
        rows.append(row)
    res = {"meta": meta, "bytes": nbytes, "device": dev, "memcpy": memcpy, "rows": rows}
    res["targets"] = targets(res)
    return res


def targets(res: dict) -> list[dict]:
    """flashwrite against its performance targets, from this run's figures: durable at
    0.9x the device's write limit or better, a stall at most 1.5x a multi-threaded memcpy,
    a cold load (in the saving process, and in a fresh one: the restart) at 0.9x the
    device's read or better, and ahead of every peer."""
    rows = {r["key"]: r for r in res["rows"]}
    fw = rows.get("flashwrite")
    if not fw or fw.get("durable_s") is None:
        return []
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "met": bool(ok), "detail": detail})

    if fw.get("vs_device") is not None:
        add("durable >= 0.9 x device limit", fw["vs_device"] >= 0.9, f"{fw['vs_device']:.2f} x")
    if res.get("memcpy") and res["memcpy"]["stall_s"]:
        ratio = fw["stall_s"] / res["memcpy"]["stall_s"]
        add("stall <= 1.5 x multi-threaded memcpy", ratio <= 1.5,
            f"{fw['stall_s']:.3f} s = {ratio:.1f} x memcpy ({res['memcpy']['stall_s']:.3f} s)")
    if fw.get("load_vs_device") is not None:
        add("cold load >= 0.9 x device read", fw["load_vs_device"] >= 0.9, f"{fw['load_vs_device']:.2f} x")
    if fw.get("restart_vs_device") is not None:
        add("restart load >= 0.9 x device read", fw["restart_vs_device"] >= 0.9, f"{fw['restart_vs_device']:.2f} x")
    peers_ok = [r for k, r in rows.items() if k != "flashwrite" and r.get("durable_s") is not None]
    if peers_ok:
        best_d = min(peers_ok, key=lambda r: r["durable_s"])
        best_s = min(peers_ok, key=lambda r: r["stall_s"])
        add("faster to durable than every peer", fw["durable_s"] < best_d["durable_s"],
            f"{fw['durable_s']:.2f} s vs best peer {best_d['name']} {best_d['durable_s']:.2f} s")
        add("shorter stall than every peer", fw["stall_s"] < best_s["stall_s"],
            f"{fw['stall_s']:.3f} s vs best peer {best_s['name']} {best_s['stall_s']:.3f} s")
        loads = [r for r in peers_ok if r.get("load_s") is not None]
        if loads and fw.get("load_s") is not None:
            best_l = min(loads, key=lambda r: r["load_s"])
            add("faster cold load than every peer", fw["load_s"] < best_l["load_s"],
                f"{fw['load_s']:.2f} s vs best peer {best_l['name']} {best_l['load_s']:.2f} s")
        restarts = [r for r in peers_ok if r.get("restart_s") is not None]
        if restarts and fw.get("restart_s") is not None:
            best_r = min(restarts, key=lambda r: r["restart_s"])
            add("faster restart load than every peer", fw["restart_s"] < best_r["restart_s"],
                f"{fw['restart_s']:.2f} s vs best peer {best_r['name']} {best_r['restart_s']:.2f} s")
    return out
