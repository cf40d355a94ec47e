"""Loads against the device read limit, and the first save against later ones (issue 23).

In one run, per size and round, every figure from a fresh process with the page cache
dropped right before what it times (as root):

- the best fio read and write of several configurations (block size, depth, files);
- cold loads of one flashwrite checkpoint: ``fw.load`` (owned tensors), ``fw.load(into=)``
  existing tensors (allocated and written first, as a resume's model is),
  ``zero_copy=True``, ``torch.load`` of a ``torch.save`` file of the same state, and
  ``safetensors.torch.load_file`` of the checkpoint's stripes (valid safetensors files);
- the stall of a process's first save and of a later one, along the README's recipe:
  ``fw.save_async`` in a loop, and ``CheckpointManager.maybe_save`` at every step of a
  loop (the manager prepares its pool from the first state it sees); with each save's
  ``SaveStats.pool_wait_s``.

    python benchmarks/loads.py --gib 1 2 4 --rounds 3 --dir /work/loads-bench --json benchmarks/results/cold-load-and-first-save.json

Medians over rounds. Ratios: fio's time / the load's (above 1.0 is faster than fio).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (block, depth per file, files): fio's best over these is "the device".
FIO_CONFIGS = [(1 << 20, 32, 1), (1 << 20, 32, 4), (8 << 20, 16, 1), (8 << 20, 16, 4), (16 << 20, 32, 1),
               (16 << 20, 32, 4)]
LOADS = ["load", "load_into", "zero_copy", "torch_load", "safetensors_load_file"]
SAVES = ["save_async", "prepared", "manager"]
# With --baseline: these also run with another flashwrite (e.g. the code before a change),
# interleaved in the same rounds, as "<kind>@base".
BASE_LOADS = ["load", "load_into", "zero_copy"]
BASE_SAVES = ["manager"]


def _sizes(gib: float) -> dict[str, int]:
    n = int(gib * (1 << 30)) // 4
    per = 1 << 24  # 64 MiB tensors, like large layers
    return {f"w{i}": min(per, n - i * per) for i in range(-(-n // per))}


def make_state(gib: float, fast: bool = False) -> dict:
    """The state loaded (random bytes); fast: the same sizes, filled quickly (saves)."""
    import torch
    if fast:
        return {"model": {k: torch.full((n,), float(i)) for i, (k, n) in enumerate(_sizes(gib).items())}, "step": 1}
    g = torch.Generator().manual_seed(0)
    return {"model": {k: torch.randn(n, generator=g) for k, n in _sizes(gib).items()}, "step": 1}


# ------------------------------------------------------------------ children


def _drop() -> None:
    from flashwrite.ops.devicelimit import drop_caches
    why = drop_caches()
    if why:
        raise SystemExit(why)


def child_load(kind: str, gib: float, ck: str, torch_file: str) -> dict:
    import torch
    import flashwrite as fw
    if kind == "load_into":
        # A resume's destination: the model exists, its memory written already.
        dest = {"model": {k: torch.zeros(n) for k, n in _sizes(gib).items()}, "step": 0}
    _drop()
    t0 = time.perf_counter()
    if kind == "load":
        out = fw.load(ck)
    elif kind == "load_into":
        out = fw.load(ck, into=dest)
    elif kind == "zero_copy":
        out = fw.load(ck, zero_copy=True)
    elif kind == "torch_load":
        out = torch.load(torch_file)
    elif kind == "safetensors_load_file":
        from safetensors.torch import load_file
        out = {}
        for name in sorted(os.listdir(ck)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(ck, name)))
    else:
        raise ValueError(kind)
    # Every page touched inside the clock: mmap-based loaders (load_file maps the file)
    # pay for their reads here, as a training step would.
    for t in (out["model"].values() if "model" in out else out.values()):
        t.view(-1)[::4096 // t.element_size()].sum()
    s = time.perf_counter() - t0
    # A spot check (the tests check every byte): the first tensor, and every size.
    got = out["model"] if "model" in out else {k.split(".", 1)[1]: v for k, v in out.items()}
    assert {k: v.numel() for k, v in got.items()} == _sizes(gib), "loaded tensors differ"
    w0 = torch.randn(_sizes(gib)["w0"], generator=torch.Generator().manual_seed(0))
    assert torch.equal(got["w0"], w0), "loaded bytes differ"
    return {"s": s}


def child_save(kind: str, gib: float, root: str, steps: int, step_s: float) -> dict:
    """The first save of a fresh process and later ones. save_async: ``fw.save_async(state,
    path)`` three times in a row, nothing prepared (what a fresh pool costs). prepared: the
    README's recipe, ``fw.prepare(state, root)`` before a loop that runs ``step_s`` per step
    and calls ``fw.save_async`` every ``steps`` steps. manager: ``maybe_save`` at every
    step of a loop that runs ``step_s`` per step; a save is due every ``steps`` steps."""
    import flashwrite as fw
    state = make_state(gib, fast=True)
    stalls, waits = [], []
    if kind == "save_async":
        for i in range(3):
            fut = fw.save_async(state, os.path.join(root, f"s{i}"))
            stalls.append(fut.stats.stall_s)
            st = fut.result()
            waits.append(getattr(st, "pool_wait_s", float("nan")))
            shutil.rmtree(os.path.join(root, f"s{i}"))
    elif kind == "prepared":
        fw.prepare(state, root)
        for step in range(1, 3 * steps + 1):
            time.sleep(step_s)  # the training step
            if step % steps == 0:
                fut = fw.save_async(state, os.path.join(root, f"step-{step}"))
                stalls.append(fut.stats.stall_s)
                waits.append(fut.result().pool_wait_s)
                shutil.rmtree(os.path.join(root, f"step-{step}"))
    else:
        with fw.CheckpointManager(root, every_n_steps=steps, keep_last=1) as mgr:
            mgr.restore()
            for step in range(1, 3 * steps + 1):
                time.sleep(step_s)  # the training step
                fut = mgr.maybe_save(step, state)
                if fut is not None:
                    stalls.append(fut.stats.stall_s)
                    waits.append(getattr(fut.result(), "pool_wait_s", float("nan")))
    return {"first_stall_s": stalls[0], "later_stall_s": statistics.median(stalls[1:]),
            "first_pool_wait_s": waits[0], "later_pool_wait_s": statistics.median(waits[1:])}


def _child(args: list[str], pythonpath: str | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], check=True,
                         capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------- parent


def fio_best(directory: str, nbytes: int) -> dict:
    from flashwrite.ops.devicelimit import fio_write_read
    configs = []
    for block, depth in sorted({(b, d) for b, d, _ in FIO_CONFIGS}):
        files = tuple(n for b, d, n in FIO_CONFIGS if (b, d) == (block, depth))
        r = fio_write_read(directory, nbytes, block=block, depth=depth, files=files)
        for c in r["configs"]:
            configs.append({"block": block, "depth": depth, **c})
    return {"read_s": min(c["read_s"] for c in configs), "write_s": min(c["write_s"] for c in configs),
            "configs": configs}


def run_size(gib: float, rounds: int, d: str, steps: int, step_s: float, base: str | None,
             partial=lambda rows: None) -> dict:
    import torch
    import flashwrite as fw
    os.makedirs(d, exist_ok=True)
    ck, torch_file = os.path.join(d, "ck"), os.path.join(d, "state.pt")
    state = make_state(gib)
    fw.save(state, ck, overwrite=True)
    torch.save(state, torch_file)
    del state
    nbytes = int(gib * (1 << 30))
    per_round = []
    for r in range(rounds):
        row: dict = {"fio": fio_best(d, nbytes)}
        for kind in LOADS:
            row[kind] = _child(["load", kind, str(gib), ck, torch_file])
            if base and kind in BASE_LOADS:
                row[kind + "@base"] = _child(["load", kind, str(gib), ck, torch_file], base)
        for kind in SAVES:
            root = os.path.join(d, f"saves-{kind}")
            for tag, path in [("", None)] + ([("@base", base)] if base and kind in BASE_SAVES else []):
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(root)
                row[kind + tag] = _child(["save", kind, str(gib), root, str(steps), str(step_s)], path)
                shutil.rmtree(root, ignore_errors=True)
        per_round.append(row)
        partial(per_round)
        print(f"{gib} GiB round {r + 1}: " + json.dumps({k: v.get("s", v.get("read_s", v.get("first_stall_s")))
                                                         for k, v in row.items()}), file=sys.stderr, flush=True)
    shutil.rmtree(ck, ignore_errors=True)
    os.unlink(torch_file)

    def med(f):
        return statistics.median(f(row) for row in per_round)

    out = {"gib": gib, "rounds": per_round, "fio_read_s": med(lambda r: r["fio"]["read_s"]),
           "fio_write_s": med(lambda r: r["fio"]["write_s"])}
    kinds = [k for k in per_round[0] if k != "fio"]
    for kind in (k for k in kinds if k.split("@")[0] in LOADS):
        out[f"{kind}_s"] = med(lambda r: r[kind]["s"])
        # Per round, against that round's fio: the side-by-side ratio.
        out[f"{kind}_x_fio"] = med(lambda r: r["fio"]["read_s"] / r[kind]["s"])
    for kind in (k for k in kinds if k.split("@")[0] in SAVES):
        for f in ("first_stall_s", "later_stall_s", "first_pool_wait_s"):
            out[f"{kind}_{f}"] = med(lambda r: r[kind][f])
        out[f"{kind}_first_over_later"] = med(lambda r: r[kind]["first_stall_s"] / r[kind]["later_stall_s"])
    return out


def table(results: list[dict]) -> str:
    lines = ["| GiB | fio read s | load s (x fio) | load(into=) s (x fio) | zero_copy s (x fio) | torch.load s (x fio) "
             "| load_file s (x fio) | fio write s | save_async first / later stall s (ratio; first pool wait) "
             "| fw.prepare + save_async first / later stall s (ratio; first pool wait) "
             "| manager first / later stall s (ratio; first pool wait) |",
             "|" + "---|" * 11]
    for r in results:
        cells = [f"{r['gib']:g}", f"{r['fio_read_s']:.3f}"]
        cells += [f"{r[k + '_s']:.3f} ({r[k + '_x_fio']:.2f}x)" for k in LOADS]
        cells.append(f"{r['fio_write_s']:.3f}")
        for k in SAVES:
            cells.append(f"{r[k + '_first_stall_s']:.3f} / {r[k + '_later_stall_s']:.3f} "
                         f"({r[k + '_first_over_later']:.1f}x; {r[k + '_first_pool_wait_s']:.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    if any("load@base_s" in r for r in results):
        lines += ["", "Baseline (--baseline), same rounds:", "",
                  "| GiB | load s (x fio) | load(into=) s (x fio) | zero_copy s (x fio) "
                  "| manager first / later stall s (ratio; first pool wait) |", "|" + "---|" * 5]
        for r in results:
            cells = [f"{r['gib']:g}"] + [f"{r[k + '@base_s']:.3f} ({r[k + '@base_x_fio']:.2f}x)" for k in BASE_LOADS]
            k = "manager@base"
            cells.append(f"{r[k + '_first_stall_s']:.3f} / {r[k + '_later_stall_s']:.3f} "
                         f"({r[k + '_first_over_later']:.1f}x)")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        what, kind, gib = sys.argv[2], sys.argv[3], float(sys.argv[4])
        res = (child_load(kind, gib, sys.argv[5], sys.argv[6]) if what == "load"
               else child_save(kind, gib, sys.argv[5], int(sys.argv[6]), float(sys.argv[7])))
        print(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (not tmpfs)")
    ap.add_argument("--steps", type=int, default=10, help="manager: a save every this many steps")
    ap.add_argument("--step-s", type=float, default=0.5, help="manager: seconds per training step")
    ap.add_argument("--json")
    ap.add_argument("--baseline", help="PYTHONPATH of another flashwrite to run some columns with too")
    a = ap.parse_args()
    t0 = time.time()
    results: list[dict] = []

    def save(extra: dict | None = None) -> list[str]:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        doc = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
               "load_average_at_end": load, "results": results, **(extra or {})}
        if a.json:  # after every round: a long run that is stopped keeps what it measured
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
        return load

    for g in a.gib:
        results.append(run_size(g, a.rounds, os.path.join(a.dir, f"{g:g}GiB"), a.steps, a.step_s, a.baseline,
                                lambda rows, g=g: save({"in_progress": {"gib": g, "rounds": rows}})))
        load = save()
    print(table(results))
    print(f"load average at the end: {' '.join(load)}")


if __name__ == "__main__":
    main()
