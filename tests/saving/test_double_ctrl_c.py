"""Two Ctrl-Cs around a save_async (issue 44 item 1): the first lands while the save
stages (so it is cancelled and its temporary directory handed to a clean-up thread),
the second while the exit joins that thread. Before: the interrupted join let the
interpreter finalise under a running native job (``terminate called without an active
exception``, rc -6), or exited before the removal and left a GiB temporary directory.

Run the way it was found: real child processes, real signals, a range of first and
second SIGINT times; every trial must end without an abort and leave nothing behind.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

_CHILD = textwrap.dedent("""
    import sys, torch, flashwrite as fw
    n = int(sys.argv[2]) * 2**20 // 4 // 8
    st = {f"t{i}": torch.arange(n, dtype=torch.float32).add_(i) for i in range(8)}
    w = fw.Writer(stripes=4)
    ready = w.prepare(st)  # the pool faulted in: the first SIGINT finds the save staging
    if ready is not None:
        ready.result()
    print("staging", flush=True)
    w.save_async(st, sys.argv[1]).result()
    print("saved", flush=True)
""")


def start(path: str, mib: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, path, str(mib)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def trial(parent: str, mib: int, first_s: float, second_s: float) -> dict:
    """One child: SIGINT ``first_s`` after it starts staging, another ``second_s`` later.
    Returns its exit status, whether it aborted, and what it left in ``parent``."""
    os.makedirs(parent, exist_ok=True)
    p = start(os.path.join(parent, "ck"), mib)
    line = p.stdout.readline()
    assert line.strip() == "staging", (line, p.stderr.read()[-2000:])
    time.sleep(first_s)
    p.send_signal(signal.SIGINT)
    time.sleep(second_s)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
        hung = False
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        hung = True
    left = sorted(os.listdir(parent))
    return {"rc": p.returncode, "hung": hung, "aborted": "terminate called" in err or p.returncode == -signal.SIGABRT,
            "left": [n for n in left if n != "ck"], "committed": "ck" in left, "err": err[-1500:]}


def check(t: dict) -> None:
    assert not t["hung"] and not t["aborted"], t
    assert t["rc"] in (0, 130, -signal.SIGINT), t
    assert t["left"] == [], t  # no temporary directory outlives the process


TIMES = [(f, s) for f in (0.0, 0.02, 0.06) for s in (0.0, 0.005, 0.02, 0.1)]


def test_two_ctrl_cs_around_a_staging_save_leave_nothing(tmp_path):
    """A small state, each pair of times once (a few seconds: the trials overlap)."""
    for i, (f, s) in enumerate(TIMES):
        check(trial(str(tmp_path / f"t{i}"), 64, f, s))


@pytest.mark.slow
def test_two_ctrl_cs_around_a_staging_save_leave_nothing_many(tmp_path):
    for rep in range(3):
        for i, (f, s) in enumerate(TIMES):
            parent = tmp_path / f"r{rep}-{i}"
            check(trial(str(parent), 512, f * 4, s))
            shutil.rmtree(parent)  # a trial whose save committed first leaves 512 MiB


def test_a_ctrl_c_during_a_deferred_step_is_raised_after_it():
    """``sigint_deferred`` (around every thread start on a save's path): the step runs to its
    end, the Ctrl-C then comes as it would have, and the handler is the one before."""
    from flashwrite.system.sigint import sigint_deferred

    ran = []

    def step():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler has run by now: a plain one would have raised here
        ran.append(True)
        return 7

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        sigint_deferred(step)
    assert ran == [True] and signal.getsignal(signal.SIGINT) is before
    assert sigint_deferred(lambda: 8) == 8  # no Ctrl-C: the step's value


def test_a_future_waits_holding_no_lock_and_times_out():
    """``CheckpointFuture.wait`` polls (system.sigint.wait_until): a timeout is kept, and the
    future's Condition is free while it waits (a thread completing it is never blocked)."""
    import threading

    from flashwrite.future import CheckpointFuture

    f = CheckpointFuture("x")
    t0 = time.monotonic()
    assert f.wait(0.05) is False and 0.04 < time.monotonic() - t0 < 1.0
    threading.Timer(0.05, lambda: f.set_result(3)).start()
    assert f.result(timeout=5) == 3 and f.wait(0) is True
    g = CheckpointFuture("y")
    with pytest.raises(TimeoutError):
        g.result(timeout=0.01)
    g.cancel()
    assert g.wait(0) is True


def test_a_ctrl_c_right_after_the_temp_dir_is_made_leaves_nothing(tmp_path, monkeypatch):
    """The narrow window the trials found once in 144: a Ctrl-C after the temporary
    directory's mkdir, before ``commit.prepare`` returned its name. The save's clean-up
    must still know the name and remove the directory."""
    import torch

    import flashwrite as fw
    from flashwrite.future import join_cleanups
    from flashwrite.targets.target import LocalTarget

    made = LocalTarget.make_dir

    def make_dir_then_ctrl_c(self, path):
        made(self, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalTarget, "make_dir", make_dir_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        fw.save({"w": torch.ones(4)}, str(tmp_path / "ck"))
    monkeypatch.undo()
    join_cleanups()  # the clean-up thread the Ctrl-C handed the removal to
    assert os.listdir(tmp_path) == []
