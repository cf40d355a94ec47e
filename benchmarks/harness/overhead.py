"""The number the project exists for: how much slower training gets when it checkpoints.

A small MLP is trained on CPU (Adam, fixed random batch) for a fixed number of
steps, with a checkpoint of {model, optimizer, step} every K steps, once per
mode: no checkpoints (the baseline), torch.save + fsync, dcp.async_save and
flashwrite.save_async. Each mode runs in a fresh subprocess with the same seed;
rounds interleave the modes. Before the timed steps every mode trains a few
steps and takes one untimed checkpoint, so pools, worker threads and imports
are set up as they would be in a long run. Training uses one intra-op thread
by default: on a small shared box, two OpenMP threads stall each other whenever
any other process takes a core (steps vary 5x), and a GPU trainer's CPU side is
mostly one busy thread too; the other cores are what a checkpointer may use. An asynchronous mode waits for its
previous checkpoint before starting the next one, and the timed run ends when
the last checkpoint is durable.

slowdown % = (time with checkpoints - baseline time) / baseline time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

from . import peers
from .measure import run_in_subprocess

MODES = {"none": "no checkpoints (baseline)", "torch_save": "torch.save + fsync", "dcp_async": "dcp.async_save",
         "flashwrite": "flashwrite.save_async"}
DEFAULT_MODES = ["none", "torch_save", "dcp_async", "flashwrite"]


def all_modes() -> dict[str, str]:
    """Every mode: the ones above, and the external peers' (benchmarks/peers.py, e.g. torch_checkpointing)."""
    return {**MODES, **{m: label for m, (label, _) in peers.overhead_savers().items()}}


def _model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


class _Saver:
    def __init__(self, mode: str, directory: str, dcp_threads: int = 4):
        self.mode, self.dir, self.pending, self.dcp_threads = mode, directory, None, dcp_threads
        external = peers.overhead_savers().get(mode)
        self.external = external[1]() if external else None

    def save(self, state: dict, step: int) -> None:
        path = os.path.join(self.dir, f"step-{step:06d}")
        if self.external is not None:
            self.external.save(state, path)
            return
        if self.mode == "torch_save":
            with open(path + ".pt", "wb") as f:
                torch.save(state, f)
            peers.fsync_file(path + ".pt")
            return
        self.wait()
        if self.mode == "dcp_async":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*single process.*")
                self.pending = dcp.async_save(state, storage_writer=FileSystemWriter(
                    path, thread_count=self.dcp_threads, sync_files=True))
        elif self.mode == "flashwrite":
            import flashwrite as fw  # like the DCP mode's imports above: only the mode measured is loaded
            self.pending = fw.save_async(state, path)
        else:
            raise ValueError(f"unknown mode {self.mode!r}")

    def wait(self) -> None:
        if self.external is not None:
            self.external.wait()
            return
        p, self.pending = self.pending, None
        if p is not None:
            p.result()

    def close(self) -> None:
        self.wait()
        if self.external is not None:
            self.external.close()


def train(spec: dict) -> dict:
    """One mode, in this process. Returns the timed run's figures."""
    torch.manual_seed(spec.get("seed", 0))
    torch.set_num_threads(spec.get("threads", 1))
    width, depth, batch = spec["width"], spec["depth"], spec["batch"]
    model = _model(width, depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> float:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss.item()

    def state(s: int) -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": s}

    mode = spec["mode"]
    saver = None if mode == "none" else _Saver(mode, spec["dir"], spec.get("dcp_threads", 4))
    for _ in range(3):
        step()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for st in opt.state_dict()["state"].values() for v in st.values()
        if isinstance(v, torch.Tensor))
    if saver is not None:
        saver.save(state(0), 0)
        saver.wait()
    stalls: list[float] = []
    t0 = time.perf_counter()
    for s in range(1, spec["steps"] + 1):
        loss = step()
        if saver is not None and s % spec["every"] == 0:
            ts = time.perf_counter()
            saver.save(state(s), s)
            stalls.append(time.perf_counter() - ts)
    drain_t = time.perf_counter()
    if saver is not None:
        saver.close()
    total = time.perf_counter() - t0
    return {"mode": mode, "train_s": total, "drain_s": time.perf_counter() - drain_t, "stalls": stalls,
            "checkpoints": len(stalls), "checkpoint_bytes": nbytes, "final_loss": loss}


def run(steps: int = 60, every: int = 10, rounds: int = 1, directory: str | None = None,
        modes: list[str] | None = None, width: int = 2048, depth: int = 6, batch: int = 64, threads: int = 1,
        log: Callable[[str], None] = print) -> dict:
    modes = list(modes or DEFAULT_MODES)
    known = all_modes()
    for m in modes:
        if m not in known:
            raise ValueError(f"unknown mode {m!r}; known: {', '.join(known)}")
    if "none" not in modes:
        modes.insert(0, "none")
    parent = os.path.abspath(directory or os.getcwd())
    per: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(rounds):
        for m in modes:
            workdir = tempfile.mkdtemp(prefix=".flashwrite-overhead-", dir=parent)
            try:
                spec = {"mode": m, "steps": steps, "every": every, "width": width, "depth": depth, "batch": batch,
                        "threads": threads, "dir": workdir, "seed": 0}
                r = run_in_subprocess("harness.overhead:train", spec, 1800, {"mode": spec["mode"]})
                if "status" not in r:
                    r["status"] = "ok"
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            per[m].append(r)
            msg = r["status"] if r["status"] != "ok" else (
                f"{r['train_s']:.2f} s, {r['checkpoints']} checkpoints, median stall "
                f"{statistics.median(r['stalls']) if r['stalls'] else 0:.3f} s")
            log(f"[overhead round {rnd + 1}/{rounds}] {known[m]}: {msg}")
    return summarize(per, {"steps": steps, "every": every, "rounds": rounds, "width": width, "depth": depth,
                           "batch": batch, "threads": threads,
                           "model": f"MLP {depth} x Linear({width}, {width}), Adam, batch {batch}, CPU, "
                                    f"{threads} training thread(s)"})


def summarize(per: dict[str, list[dict]], meta: dict) -> dict:
    base = [r for r in per.get("none", []) if r.get("status") == "ok"]
    base_s = statistics.median(r["train_s"] for r in base) if base else None
    nbytes = next((r["checkpoint_bytes"] for rs in per.values() for r in rs if "checkpoint_bytes" in r), 0)
    meta = {**meta, "checkpoint_bytes": nbytes}
    rows: list[dict[str, Any]] = []
    torch_overhead = None
    known = all_modes()
    for m, runs in per.items():
        ok = [r for r in runs if r.get("status") == "ok"]
        row: dict[str, Any] = {"key": m, "name": known[m], "runs": runs}
        if not ok:
            row["status"] = runs[0].get("status", "not run") if runs else "not run"
            rows.append(row)
            continue
        row["status"] = "ok"
        row["train_s"] = statistics.median(r["train_s"] for r in ok)
        row["checkpoints"] = ok[0]["checkpoints"]
        stalls = [s for r in ok for s in r["stalls"]]
        row["stall_median_s"] = statistics.median(stalls) if stalls else None
        row["stall_total_s"] = statistics.median(sum(r["stalls"]) for r in ok) if stalls else None
        if base_s and stalls:
            # The blocking part alone: less noisy than the wall-clock difference below.
            row["stall_pct"] = row["stall_total_s"] / base_s * 100
        if base_s:
            # Per round against that round's baseline, then the median: rounds see different noise.
            pairs = [(r["train_s"], b["train_s"]) for r, b in zip(ok, base)]
            row["slowdown_pct"] = statistics.median((t - b) / b * 100 for t, b in pairs)
            row["overhead_s"] = statistics.median(t - b for t, b in pairs)
        if m == "torch_save":
            torch_overhead = row.get("overhead_s")
        rows.append(row)
    for row in rows:
        if torch_overhead and row.get("overhead_s") is not None and row["key"] != "none":
            row["overhead_vs_torch_save"] = row["overhead_s"] / torch_overhead
    notes = ["slowdown %: (training time with checkpoints - baseline) / baseline, per round, median; "
             "blocked %: the checkpoint calls' total stall / baseline (the part that does not depend on noise); "
             "x torch.save: this mode's added seconds / torch.save's added seconds (target for flashwrite: <= 0.1).",
             "stall/ckpt: seconds each checkpoint call blocked the loop (for async modes: until snapshotted, plus any "
             "wait for the previous checkpoint); the timed run ends when the last checkpoint is durable."]
    if base and len(base) > 1:
        spread = (max(r["train_s"] for r in base) - min(r["train_s"] for r in base)) / base_s * 100
        notes.append(f"baseline spread over rounds: {spread:.1f}% (the noise floor of this machine)")
    return {"meta": meta, "rows": rows, "notes": notes}
