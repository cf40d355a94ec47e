"""Incremental saves (issue 26) on a LoRA-shaped state, in one run:

- a frozen bf16 base (``--base-gib``, default 2), trainable adapters (32 MiB fp32) and
  their AdamW moments (exp_avg, exp_avg_sq: 64 MiB); the base as a LoRA model's
  ``state_dict(keep_vars=True)`` holds it, ``nn.Parameter``\ s with ``requires_grad=False``
  (``--plain-base``: plain tensors, as ``state_dict()`` gives, which say nothing of
  what is frozen, so the first incremental save writes everything);
- ten saves, each after ten AdamW steps of the adapters; each save goes, in turn, to
  flashwrite full (``incremental=False``), flashwrite incremental, torch.save (+ fsync)
  and DCP (``torch.distributed.checkpoint.save``, one process); per save: time to
  durable, bytes written, stall (how long the training loop was blocked);
- a cold-cache load (page cache dropped, root) of the last full and the last
  incremental checkpoint, alternated ``--load-rounds`` times;
- a full-training state (every tensor changes, ``--base-gib`` of fp32) saved with
  incremental on and off, alternated ``--ab-rounds`` times: the comparison costs no
  more than the feature's absence (incremental=False runs exactly the old path).

Each contender keeps its last two checkpoints (so the incremental one has a base and
the disk does not fill). Each contender runs in a process of its own, one after the
other, with the same seeded training: on a VM whose fresh memory past ~6 GiB costs 15 s
per GiB (``fresh_memory.py``), four contenders' buffers in one process measured the
VM instead of the savers. "flashwrite incremental, hashing" is the incremental save
with ``FLASHWRITE_WRITE_WATCH=off``: every compared byte hashed, as before the watch.
"flashwrite incremental, re-hash every N" (``--recheck-every``, default 4, so that the
run holds re-hash saves; the library's default is 16) has the write watch's defence in
depth come round N times as often: every piece the watch vouched for is hashed again at
every Nth save. Its mean time per save against the plain incremental save's, over the same
saves, is the amortised cost; scaled by N/16, the cost at the default.

    python benchmarks/incremental.py --base-gib 2 --dir /work/incr-bench --json out.json
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

import torch

import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches

ADAPTER_BYTES = 32 << 20


PLAIN_BASE = False  # --plain-base


def lora_model(base_gib: float) -> tuple[dict, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    per = 32 << 20  # 64 MiB bf16 tensors, like large frozen layers
    n = int(base_gib * (1 << 30)) // 2
    base = {f"base.{i}": torch.randn(min(per, n - i * per), generator=g).to(torch.bfloat16)
            for i in range(-(-n // per))}
    if not PLAIN_BASE:
        base = {k: torch.nn.Parameter(t, requires_grad=False) for k, t in base.items()}
    k = 16
    adapters = [torch.nn.Parameter(torch.randn(ADAPTER_BYTES // 4 // k, generator=g) * 0.01) for _ in range(k)]
    return base, adapters


def state_of(base: dict, adapters: list, opt: torch.optim.Optimizer) -> dict:
    return {"model": {**base, **{f"lora.{i}": p.detach() for i, p in enumerate(adapters)}},
            "optim": opt.state_dict()}


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FlashwriteRun:
    def __init__(self, incremental: bool):
        self.w = fw.Writer(incremental=incremental)
        self.key = "flashwrite incremental" if incremental else "flashwrite full"

    def save(self, state: dict, path: str) -> dict:
        t0 = time.perf_counter()
        fut = self.w.save_async(state, path)
        stall = time.perf_counter() - t0
        s = fut.result()
        durable = time.perf_counter() - t0
        return {"stall_s": stall, "durable_s": durable, "written": s.bytes_written, "linked": s.bytes_linked,
                "compared": s.compared_bytes, "watched": s.watched_bytes, "rechecked": s.rechecked_bytes,
                "misses": s.watch_misses, "note": s.incremental}


class TorchSaveRun:
    key = "torch.save"

    def save(self, state: dict, path: str) -> dict:
        t0 = time.perf_counter()
        torch.save(state, path)
        fsync_path(path)
        fsync_path(os.path.dirname(path))
        t = time.perf_counter() - t0
        return {"stall_s": t, "durable_s": t, "written": os.path.getsize(path), "linked": 0}


class DcpRun:
    key = "DCP save"

    def save(self, state: dict, path: str) -> dict:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        fsync_path(path)
        t = time.perf_counter() - t0
        return {"stall_s": t, "durable_s": t, "written": dir_bytes(path), "linked": 0}


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


CONTENDERS = ["flashwrite full", "flashwrite incremental", "flashwrite incremental, hashing", "torch.save",
              "DCP save"]
RECHECK = "flashwrite incremental, re-hash every "  # + N


def contender_env(key: str) -> dict:
    if key.endswith("hashing"):
        return {"FLASHWRITE_WRITE_WATCH": "off"}
    if key.startswith(RECHECK):
        return {"FLASHWRITE_WATCH_RECHECK_EVERY": key[len(RECHECK):]}
    return {}


def make_run(key: str):
    if key.startswith("flashwrite"):
        r = FlashwriteRun("incremental" in key)
        r.key = key
        return r
    return TorchSaveRun() if key == "torch.save" else DcpRun()


def lora_contender(key: str, base_gib: float, saves: int, steps: int, root: str, log) -> dict:
    """One contender's ten saves of the seeded LoRA training (run in a process of its own)."""
    base, adapters = lora_model(base_gib)
    opt = torch.optim.AdamW(adapters, lr=1e-3)
    g = torch.Generator().manual_seed(2)
    r = make_run(key)
    rows, paths = [], []
    for i in range(1, saves + 1):
        for _ in range(steps):
            for p in adapters:
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
            opt.step()
        state = state_of(base, adapters, opt)
        name = key.replace(" ", "_").replace(".", "_").replace(",", "")
        path = os.path.join(root, name, f"step-{i:04d}" + (".pt" if isinstance(r, TorchSaveRun) else ""))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        res = r.save(state, path)
        rows.append(res)
        paths.append(path)
        while len(paths) > 2:
            remove(paths.pop(0))
        log(f"save {i:2d} {key:32s} stall {res['stall_s']:.3f} s durable {res['durable_s']:.3f} s "
            f"written {res['written'] / 2**20:9.1f} MiB linked {res['linked'] / 2**20:9.1f} MiB")
    if isinstance(r, FlashwriteRun):
        r.w.close()
    total = sum(t.nbytes for t in state_of(base, adapters, opt)["model"].values())
    return {"rows": rows, "last": paths[-1], "state_bytes": total}


RESULT = "RESULT "  # the line a child process answers with


def _child(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env={**os.environ, **(env or {})},
                         capture_output=True, text=True)
    lines = out.stdout.splitlines()
    sys.stdout.write("".join(line + "\n" for line in lines if not line.startswith(RESULT)))
    if out.returncode:
        raise RuntimeError(f"{args}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads([line for line in lines if line.startswith(RESULT)][-1][len(RESULT):])


def lora_run(base_gib: float, saves: int, steps: int, root: str, log) -> dict:
    rows: dict[str, list[dict]] = {}
    last: dict[str, str] = {}
    total = 0
    for key in CONTENDERS:
        res = _child(["--child-lora", key, "--base-gib", str(base_gib), "--saves", str(saves), "--steps", str(steps),
                      "--dir", root, *(["--plain-base"] if PLAIN_BASE else [])], contender_env(key))
        rows[key], last[key], total = res["rows"], res["last"], res["state_bytes"]
    changed = ADAPTER_BYTES * 3  # adapters + exp_avg + exp_avg_sq
    # Cold loads of the last full and incremental checkpoints, alternated, each in a fresh process.
    loads: dict[str, list[float]] = {k: [] for k in ("flashwrite full", "flashwrite incremental") if k in last}
    for _ in range(LOAD_ROUNDS):
        for key in loads:
            dropped = drop_caches()
            loads[key].append(_child(["--child-load", last[key]])["load_s"])
            if dropped:
                log(f"warning: page cache not dropped: {dropped}")
    return {"base_gib": base_gib, "state_bytes": total, "changed_bytes": changed, "saves": rows,
            "cold_load_s": loads}


def full_training_one(incremental: bool, gib: float, rounds: int, root: str, log) -> list[dict]:
    """Everything changes between saves: ``rounds`` saves after a first that sizes the pool."""
    g = torch.Generator().manual_seed(1)
    per = 16 << 20
    n = int(gib * (1 << 30)) // 4
    state = {f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))}
    key = "on" if incremental else "off"
    out = []
    with fw.Writer(incremental=incremental) as w:
        for i in range(rounds + 1):
            for t in state.values():
                t.add_(1.0)
            path = os.path.join(root, f"full-{key}", f"s{i:03d}")
            t0 = time.perf_counter()
            fut = w.save_async(state, path)
            stall = time.perf_counter() - t0
            s = fut.result()
            res = {"stall_s": stall, "durable_s": time.perf_counter() - t0, "compared": s.compared_bytes}
            if i:  # the first save sizes the pool: left out
                out.append(res)
            remove(os.path.join(root, f"full-{key}", f"s{i - 2:03d}"))
            log(f"full-training {i} incremental={key}: stall {stall:.3f} s durable {res['durable_s']:.3f} s "
                f"compared {s.compared_bytes / 2**20:.0f} MiB")
        remove(os.path.join(root, f"full-{key}"))
    return out


def full_training_ab(gib: float, rounds: int, root: str, log) -> dict:
    """Incremental off and on, in processes of their own, alternated round by round."""
    out: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(rounds):
        for key in out:
            out[key] += _child(["--child-ab", key, "--full-gib", str(gib), "--ab-rounds", "2", "--dir", root])
    return out


LOAD_ROUNDS = 3


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def recheck_lines(saves: dict[str, list[dict]]) -> list[str]:
    """The write watch's periodic re-hash (saves 4 to the last): what a re-hash save costs
    more than the other saves of the same run, and that spread over the default interval
    (``write_watch.RECHECK_EVERY``, 16); the mean against the default contender's."""
    keys = [k for k in saves if k.startswith(RECHECK) or k == "flashwrite incremental"]
    if not any(k.startswith(RECHECK) for k in keys):
        return []
    out = ["", "The write watch's periodic re-hash (saves 4 to the last; \"re-hash\" saves are those with "
           "SaveStats.rechecked_bytes > 0; the extra cost of one, spread over 16 saves, is the amortised cost at the "
           "default FLASHWRITE_WATCH_RECHECK_EVERY=16):", "",
           "| contender | re-hash saves | re-hashed MiB per re-hash save | stall s: other saves / re-hash saves | "
           "durable s: other / re-hash | amortised at every 16: stall s | durable s | durable s (mean, all) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in keys:
        rs = saves[k][3:]
        re_, other = [r for r in rs if r.get("rechecked")], [r for r in rs if not r.get("rechecked")]
        so, sr = mean([r["stall_s"] for r in other]), mean([r["stall_s"] for r in re_])
        do, dr = mean([r["durable_s"] for r in other]), mean([r["durable_s"] for r in re_])
        if re_ and other:
            mib = f"{mean([r['rechecked'] for r in re_]) / 2**20:.0f}"
            cells = f"{so:.3f} / {sr:.3f} | {do:.3f} / {dr:.3f} | {(sr - so) / 16:+.4f} | {(dr - do) / 16:+.4f}"
        else:
            mib, cells = "-", f"{so:.3f} / - | {do:.3f} / - | - | -"
        out.append(f"| {k} | {len(re_)} | {mib} | {cells} | {mean([r['durable_s'] for r in rs]):.3f} |")
    return out


def markdown(res: dict) -> str:
    lora = res["lora"]
    gib = lora["base_gib"]
    lines = [f"LoRA-shaped state: {gib:g} GiB frozen bf16 base + 32 MiB fp32 adapters + AdamW moments "
             f"({lora['state_bytes'] / 2**30:.2f} GiB of tensors; {lora['changed_bytes'] / 2**20:.0f} MiB change "
             "per save). Ten saves, each after ten AdamW steps; each contender in a process of its own; medians of "
             "saves 4-10 (the first has no base and sizes flashwrite's pool; the second regroups the stripes the "
             "first mixed; the third is the first whose compare the write watch can spare):", "",
             "| contender | durable s (median) | × full | stall s (median) | written MiB per save (median) | "
             "linked MiB (median) | hashed MiB (median) |", "|---|---:|---:|---:|---:|---:|---:|"]
    full = med([r['durable_s'] for r in lora["saves"].get("flashwrite full", next(iter(lora["saves"].values())))[3:]])
    for key, rows in lora["saves"].items():
        rs = rows[3:]
        d = med([r['durable_s'] for r in rs])
        hashed = med([r.get('compared', 0) for r in rs]) / 2**20
        lines.append(f"| {key} | {d:.3f} | {d / full:.2f} | {med([r['stall_s'] for r in rs]):.3f} | "
                     f"{med([r['written'] for r in rs]) / 2**20:.1f} | {med([r['linked'] for r in rs]) / 2**20:.1f} | "
                     f"{hashed:.0f} |")
    lines += ["", "Per save (durable s / stall s / written MiB):", "",
              "| save | " + " | ".join(lora["saves"]) + " |", "|---:|" + "---:|" * len(lora["saves"])]
    n = len(next(iter(lora["saves"].values())))
    for i in range(n):
        cells = [f"{r[i]['durable_s']:.2f} / {r[i]['stall_s']:.3f} / {r[i]['written'] / 2**20:.0f}"
                 for r in lora["saves"].values()]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines += recheck_lines(lora["saves"])
    cl = lora["cold_load_s"]
    if len(cl) == 2:
        lines += ["", "Cold load (page cache dropped) of the last checkpoint, median of "
                  f"{len(cl['flashwrite full'])}: full {med(cl['flashwrite full']):.3f} s, incremental "
                  f"{med(cl['flashwrite incremental']):.3f} s."]
    ab = res.get("full_training")
    if ab:
        lines += ["", f"Full-training state ({res['full_training_gib']:g} GiB fp32, every tensor changes), "
                  f"median of {len(ab['off'])} saves, off and on alternated in processes of their own:", "",
                  "| incremental | durable s | stall s | hashed to compare, MiB per save (median) |",
                  "|---|---:|---:|---:|"]
        for key in ("off", "on"):
            rs = ab[key]
            lines.append(f"| {key} | {med([r['durable_s'] for r in rs]):.3f} | {med([r['stall_s'] for r in rs]):.3f} "
                         f"| {med([r['compared'] for r in rs]) / 2**20:.0f} |")
    return "\n".join(lines)


def main() -> None:
    global LOAD_ROUNDS, PLAIN_BASE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-gib", type=float, default=2.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--load-rounds", type=int, default=3)
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--full-gib", type=float, default=None, help="size of the full-training A/B (default: base-gib)")
    ap.add_argument("--recheck-every", type=int, default=4,
                    help="the re-hash contender's FLASHWRITE_WATCH_RECHECK_EVERY (0: leave that contender out)")
    ap.add_argument("--only", help="the LoRA run's contenders, separated by \";\" (default: all)")
    ap.add_argument("--plain-base", action="store_true", help="the frozen base as plain tensors, not Parameters")
    ap.add_argument("--dir", default="/work/incr-bench")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--child-lora", help=argparse.SUPPRESS)
    ap.add_argument("--child-load", help=argparse.SUPPRESS)
    ap.add_argument("--child-ab", help=argparse.SUPPRESS)
    a = ap.parse_args()
    LOAD_ROUNDS = a.load_rounds
    PLAIN_BASE = a.plain_base
    if a.recheck_every:
        CONTENDERS.insert(2, f"{RECHECK}{a.recheck_every}")
    if a.only:
        CONTENDERS[:] = [k for k in CONTENDERS if k in a.only.split(";")]
    if a.child_lora or a.child_load or a.child_ab:
        if a.child_lora:
            res = lora_contender(a.child_lora, a.base_gib, a.saves, a.steps, a.dir, print)
        elif a.child_load:
            t0 = time.perf_counter()
            fw.load(a.child_load)
            res = {"load_s": time.perf_counter() - t0}
        else:
            res = full_training_one(a.child_ab == "on", a.full_gib or a.base_gib, a.ab_rounds, a.dir, print)
        print(RESULT + json.dumps(res), flush=True)
        return
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        res = {"lora": lora_run(a.base_gib, a.saves, a.steps, a.dir, log)}
        if a.ab_rounds:
            res["full_training_gib"] = a.full_gib or a.base_gib
            res["full_training"] = full_training_ab(res["full_training_gib"], a.ab_rounds, a.dir, log)
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    md = markdown(res)
    print("\n" + md)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(md + "\n")


if __name__ == "__main__":
    main()
