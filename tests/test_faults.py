"""Faults with real processes and real file systems: kill -9 at many moments of a
save, disk full, permission denied, corruption on disk, concurrent use.

Mount-based tests need root (tmpfs and loop-mounted ext4) and skip otherwise.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_same
from fault_util import Zygote, fill, loop_ext4, make_state, need_root, temp_entries, tmpfs

import flashwrite as fw
from flashwrite import commit

# --------------------------------------------------------------------------- kill -9

KILL_N = 1 << 20        # ~5.6 MB per checkpoint, 3 stripes
VARIANT = 1_000_000     # an overwritten checkpoint holds make_state(step + VARIANT)

# Which part of a save the victim was in, judged by the last line it printed.
_GROUP = {
    "ready": "start-up", "stage": "staging", "staging": "staging", "staged": "writing+fsync (native)",
    "writing": "commit", "durable": "commit", "write-index": "commit", "write-manifest": "commit",
    "fsync-file": "commit", "fsync-tmpdir": "commit", "rename": "commit", "fsync-parent": "commit",
    "exchange": "commit (overwrite)", "exchanged": "commit (overwrite)",
    "retention-rename": "retention", "retention-unlink-manifest": "retention", "rmtree-unlink": "retention",
    "committed": "between saves", "finished": "finished",
}


def _check_root(root: str, before: list[int], committed: list[int], started: int) -> dict:
    """The invariants after a crash, before and after the next start's clean-up."""
    observer = fw.CheckpointManager(root, cleanup=False)
    steps = observer.all_steps()
    assert steps, "every checkpoint vanished"
    # Nothing durable is lost: the newest committed checkpoint (before or during the
    # trial) is still there; nothing newer than what was started appears.
    assert steps[-1] >= max(before[-1:] + committed), (steps, before, committed)
    assert steps[-1] <= started, (steps, started)
    for s in steps:  # every listed checkpoint is whole: it loads, verified, byte-exact
        got = fw.load(observer.path_for(s))
        assert got["step"] in (s, s + VARIANT), (s, got["step"])
        assert_same(got, make_state(got["step"], KILL_N))
    temps = temp_entries(root)
    mgr = fw.CheckpointManager(root)  # the next start
    after = mgr.all_steps()
    assert temp_entries(root) == []
    assert set(steps) <= set(after)
    for s in set(after) - set(steps):  # a checkpoint moved aside when the victim died, put back
        got = fw.load(mgr.path_for(s))
        assert_same(got, make_state(got["step"], KILL_N))
    assert sorted(os.listdir(root)) == [os.path.basename(mgr.path_for(s)) for s in after]
    return {"temps_left": len(temps), "restored": len(set(after) - set(steps)), "steps": after}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(str(tmp_path_factory.mktemp("zygote") / "zygote.log"))
    yield z
    z.close()


def _trial_plan(rng: random.Random) -> list[dict]:
    plan = [dict(kind="random") for _ in range(12)]
    for phase, top in [("staging", 2), ("write-index", 2), ("write-manifest", 2), ("fsync-file", 4),
                       ("fsync-tmpdir", 2), ("rename", 2), ("fsync-parent", 2), ("retention-rename", 2),
                       ("retention-unlink-manifest", 2), ("rmtree-unlink", 6)]:
        plan.append(dict(kind="pause", pause=[phase, rng.randint(1, top)]))
    for phase, top in [("staged", 3), ("staged", 3), ("staged", 3), ("stage", 3), ("committed", 2)]:
        plan.append(dict(kind="jitter", on=[phase, rng.randint(1, top)]))
    plan.append(dict(kind="pause", pause=["exchange", 1], overwrite=VARIANT))
    plan.append(dict(kind="pause", pause=["exchanged", 1], overwrite=VARIANT))
    rng.shuffle(plan)
    return plan


def test_kill9_at_random_moments(tmp_path, zygote):
    seed = int(os.environ.get("FLASHWRITE_FAULT_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    root = str(tmp_path / "ck")

    def run_victim(trial: dict) -> dict:
        saves = 6 if trial["kind"] == "random" else 4
        pid = zygote.start(root=root, n=KILL_N, saves=saves, pause=trial.get("pause"),
                           overwrite=trial.get("overwrite", 0))
        out = {"last": None, "committed": [], "started": 0, "code": None, "killed_at": None}
        deadline = None
        seen: dict[str, int] = {}

        def kill(where):
            if out["killed_at"] is None:
                out["killed_at"] = where
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it had just finished
                    pass

        while True:
            if deadline is not None and out["killed_at"] is None:
                line = zygote.next(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:
                    kill(out["last"])
                    continue
            else:
                line = zygote.next(timeout=30)
                if line is None:
                    raise AssertionError(f"victim silent for 30 s (seed {seed}, {trial})")
            tag = line[0]
            if tag == "exit":
                out["code"] = int(line[2])
                return out
            if tag == "phase":
                name, n = line[1], int(line[2])
            else:
                name = tag
                n = seen[tag] = seen.get(tag, 0) + 1
            if tag != "paused" and out["killed_at"] is None:
                out["last"] = name
            if tag == "ready":
                out["started"] = int(line[1]) - 1
                out["t_ready"] = time.monotonic()
            elif tag == "finished":
                out["run_s"] = time.monotonic() - out["t_ready"]
            elif tag == "stage":
                out["started"] = max(out["started"], int(line[1]))
            elif tag == "committed":
                out["committed"].append(int(line[1]))
            if out["killed_at"] is not None:
                continue
            if tag == "ready" and trial["kind"] == "random":
                deadline = time.monotonic() + rng.uniform(0, trial["window"])
            elif tag == "paused":
                kill(line[1])
            elif trial["kind"] == "jitter" and [name, n] == trial["on"]:
                time.sleep(rng.uniform(0, 0.003))
                kill(out["last"])

    # Clean runs first: they give retention something to delete and time a save.
    per_save = []
    for _ in range(2):
        first = run_victim(dict(kind="pause", pause=None))
        assert first["code"] == 0 and first["last"] == "finished", (first, open(zygote.log_path).read()[-3000:])
        per_save.append(first["run_s"] / 4)
        _check_root(root, [], first["committed"], first["started"])

    results = []
    for trial in _trial_plan(rng):
        trial["window"] = min(per_save) * 6
        before = fw.CheckpointManager(root, cleanup=False).all_steps()
        out = run_victim(trial)
        assert out["code"] in (-signal.SIGKILL, 0), (out, open(zygote.log_path).read()[-3000:])
        if trial["kind"] == "pause":
            assert out["code"] == -signal.SIGKILL and out["killed_at"] == trial["pause"][0], (trial, out)
        try:
            checked = _check_root(root, before, out["committed"], out["started"])
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, trial {trial}, victim {out}: {e}") from e
        if "run_s" in out and trial["kind"] == "random":
            per_save.append(out["run_s"] / 6)
        results.append({"trial": trial, "killed": out["code"] == -signal.SIGKILL,
                        "where": _GROUP.get(out["killed_at"] or "finished", out["killed_at"]),
                        "phase": out["killed_at"], **checked})

    killed = [r for r in results if r["killed"]]
    groups = {r["where"] for r in killed}
    summary = {g: sum(r["where"] == g for r in killed) for g in sorted(groups)}
    report = {"seed": seed, "trials": len(results), "killed": len(killed), "by_phase_group": summary,
              "by_phase": {p: sum(r["phase"] == p for r in killed) for p in sorted({r["phase"] for r in killed})},
              "temp_dirs_cleaned": sum(r["temps_left"] for r in results),
              "checkpoints_put_back": sum(r["restored"] for r in results)}
    print("kill -9 report:", json.dumps(report, indent=1))
    if os.environ.get("FLASHWRITE_FAULT_REPORT"):
        with open(os.environ["FLASHWRITE_FAULT_REPORT"], "a") as fh:
            fh.write(json.dumps(report) + "\n")
    assert len(killed) >= 20, (report, [(r["trial"], r["where"]) for r in results if not r["killed"]])
    for g in ("staging", "writing+fsync (native)", "commit", "retention", "commit (overwrite)"):
        assert g in groups, report
