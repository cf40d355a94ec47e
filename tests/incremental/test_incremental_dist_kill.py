"""kill -9 of one rank at a random moment of incremental multi-rank saves (a manager with
process_group=, keep_last=2, so retention deletes the checkpoints later ones link to):
after each trial every committed checkpoint is whole and byte-exact for every rank, and
the next start removes what the killed save left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.format import read_manifest

from test_incremental import assert_same
from test_incremental_dist import state_of

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))

_RANK = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    import flashwrite as fw
    from test_incremental_dist import state_of
    rank, init, root, start = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    mgr = fw.CheckpointManager(root, every_n_steps=1, keep_last=2, process_group=dist.group.WORLD,
                               writer=fw.Writer(stripes=2, chunk_bytes=1 << 20))
    print("ready", flush=True)
    for step in range(start, start + 6):
        mgr.maybe_save(step, state_of(rank, step))
        print("staged", step, flush=True)
    mgr.close()
    # Leave together: a rank that exits while gloo still talks to it can abort its peer.
    dist.barrier()
    dist.destroy_process_group()
    print("finished", flush=True)
""")


def _start(code: str, tmp, root: str, trial: int, start: int) -> list[subprocess.Popen]:
    """Both ranks, once they said they are ready (joined the group, made the manager)."""
    init = str(tmp / f"init-{trial}")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), init, root, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def _reap(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        p.stdout.close()


def kill_a_rank_at_random(code: str, tmp, root: str, rng, trials: int, next_start):
    """Run both ranks of ``code`` once to the end (a base for later runs, and the time one
    run takes), then ``trials`` times more from step ``next_start()``, one rank killed with
    SIGKILL at a random moment within that time (the survivor fails on the lost peer, or
    finishes). Yields after each trial whether a rank was killed mid-run."""
    clean = _start(code, tmp, root, 0, 1)
    t0 = time.monotonic()
    _reap(clean, time.monotonic() + 180)
    assert [p.returncode for p in clean] == [0, 0]
    window = time.monotonic() - t0
    for trial in range(1, trials + 1):
        procs = _start(code, tmp, root, trial, next_start())
        time.sleep(rng.uniform(0.0, window))
        victim = procs[rng.randrange(2)]
        killed = victim.poll() is None
        if killed:
            os.kill(victim.pid, signal.SIGKILL)
        _reap(procs, time.monotonic() + 60)
        yield killed


@pytest.mark.slow
def test_kill9_of_a_rank_during_incremental_multi_rank_saves(tmp_path):
    seed = int(os.environ.get("FLASHWRITE_TEST_SEED") or time.time_ns() % 2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = str(tmp_path / "ck")
    code = _RANK.format(here=HERE)
    killed, linked_seen = 0, False
    for was_killed in kill_a_rank_at_random(code, tmp_path, root, rng, 5,
                                            lambda: (fw.CheckpointManager(root).latest_step() or 0) + 1):
        killed += was_killed
        mgr = fw.CheckpointManager(root)  # cleans what the killed save left
        steps = mgr.all_steps()
        assert steps, f"seed {seed}: no checkpoint left"
        assert [e for e in os.listdir(root) if commit.is_temp_name(e)] == []
        for s in steps:  # every committed checkpoint is whole and byte-exact, for both ranks
            whole = fw.load(mgr.path_for(s))
            for r in (0, 1):
                assert_same(whole[r], state_of(r, s))
            linked_seen |= any(f.get("linked") for f in read_manifest(mgr.path_for(s)).raw["files"])
        mgr.close()
    assert killed >= 3, f"seed {seed}: only {killed} of 5 trials killed a rank mid-run"
    assert linked_seen, "no checkpoint linked a stripe: the saves were not incremental"
