"""Ctrl-C and exits, designed once (issue 34): every native job is cancelled and joined
before anything it reads or writes is freed, and a save in flight at exit is either
finished (said once on stderr) or, at a second Ctrl-C, abandoned cleanly.

Each case runs in a child process: what fails here is a segfault, an abort or a hang,
which must fail the test and not the suite.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite.saving import commit

_STATE = textwrap.dedent("""
    import torch
    def state(mib):  # distinct values in every tensor, cheap to make at GiBs
        n = mib * 2**20 // 4 // 8
        return {f"t{i}": torch.arange(n, dtype=torch.float32).mul_(1e-3).add_(i) for i in range(8)}
""")


def _child(body: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", _STATE + textwrap.dedent(body), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def _saved(tmp_path_factory, mib: int):
    exec(_STATE, ns := {})
    path = tmp_path_factory.mktemp("interrupts") / "ck"
    fw.save(ns["state"](mib), path, stripes=4)
    return path


@pytest.fixture(scope="module")
def ck256(tmp_path_factory):
    return _saved(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def ck1g(tmp_path_factory):
    return _saved(tmp_path_factory, 1024)


def _drop_caches() -> None:
    """Loads from the device, not the page cache, where root may: they last longer, so a
    Ctrl-C finds the job in the middle of its reads and copies."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3")
    except OSError:
        pass


_ONE = """
    import sys, torch, flashwrite as fw
    path, what = sys.argv[1], sys.argv[2]
    dst = state(1024) if what == "into" else None
    print("loading", flush=True)
    if what == "verify":
        fw.verify(path)
    elif what == "into":
        fw.load(path, into=dst)
    else:
        s = fw.load(path)
    print("loaded", flush=True)
"""


# into= also has test_ctrl_c_in_load_into_stops_writing_the_destinations in this suite.
@pytest.mark.parametrize("what", ["load", "verify", pytest.param("into", marks=pytest.mark.slow)])
def test_ctrl_c_in_a_load_or_verify_never_crashes(ck1g, what):
    """The segfault of issue 34: the wait was interrupted, and the interpreter's exit freed
    the destinations while the job's threads still copied into them. Loads run back to
    back, so every Ctrl-C lands in one; the process must die of SIGINT (KeyboardInterrupt
    uncaught), never of SIGSEGV or SIGABRT."""
    for delay in (0.15, 0.45):
        _drop_caches()
        p = _child(_ONE, str(ck1g), what)
        assert p.stdout.readline().strip() == "loading"
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        if "loaded" in out:
            continue  # the load was over before the Ctrl-C (which may then land in the exit)
        assert p.returncode == -signal.SIGINT, (p.returncode, err[-2000:])
        assert "KeyboardInterrupt" in err, err[-2000:]


def test_ctrl_c_in_load_into_stops_writing_the_destinations(ck256):
    """A process that catches KeyboardInterrupt and goes on owns its tensors again: the
    interrupted load(into=) wrote its last byte before the exception left the wait.

    The test hook FLASHWRITE_TEST_LOAD_PLACE_DELAY_MS makes each copy into a destination
    land 150 ms after it was decided, so every Ctrl-C finds copies under way that the
    wait must outwait (issue 44 item 8b: without it, a wait that raised at once was seen
    in 1 of 6 trials; the copies were mostly over before the exception left)."""
    p = _child("""
        import os, signal, sys, threading, time, torch, flashwrite as fw
        os.environ["FLASHWRITE_TEST_LOAD_PLACE_DELAY_MS"] = "150"  # read by each load job
        dst = state(256)
        for t in dst.values():
            t.zero_()
        sent = []
        def fire():
            sent.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        for trial in range(6):
            timer = threading.Timer(0.02 + 0.03 * trial, fire)
            timer.start()
            try:
                while True:
                    fw.load(sys.argv[1], into=dst)
            except KeyboardInterrupt:
                # Inside the except block the interrupted frames are still alive (the
                # traceback holds them): a job still running would write now.
                late = time.monotonic() - sent[-1]
                for t in dst.values():
                    t.zero_()
                time.sleep(0.3)
                dirty = sum(int(t.count_nonzero()) for t in dst.values())
            timer.join()
            print(f"trial {trial} dirty {dirty} late_ms {late * 1000:.0f}", flush=True)
    """, str(ck256))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    lines = out.split("\n")
    assert len([ln for ln in lines if ln.startswith("trial")]) == 6, out
    for ln in lines:
        if ln.startswith("trial"):
            assert " dirty 0 " in ln, out


def test_ctrl_c_in_a_first_save_lands_while_the_pool_faults_in(tmp_path):
    """A first save (no prepare) faults in its slab of the pool in save_async itself, for
    a second or more at GiBs: Ctrl-C stops that, and nothing is left behind. (Before: the
    interrupt waited for the whole fault-in, 0.8-4.9 s.)"""
    p = _child("""
        import signal, sys, threading, time, torch, flashwrite as fw
        st = state(2048)
        sent = []
        def fire():
            sent.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        threading.Timer(0.25, fire).start()
        t0 = time.monotonic()
        try:
            fw.save_async(st, sys.argv[1]).result()
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print(f"late_ms {(time.monotonic() - sent[0]) * 1000:.0f}", flush=True)
        # The pool keeps what it faulted in: a save after the interrupt works and is whole.
        fw.save_async(st, sys.argv[1]).result()
        print("saved", flush=True)
    """, str(tmp_path / "ck"))
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-2000:]
    assert "saved" in out, out
    if "not interrupted" in out:
        pytest.skip("the first save was done before the interrupt (a fast machine): nothing to measure")
    late = int(out.split("late_ms ")[1].split()[0])
    # Within the wait slice (50 ms) + one fault-in step + removing the temp dir's
    # preallocated files; bounded loosely for a loaded CI machine.
    assert late < 1000, out
    assert os.listdir(tmp_path) == ["ck"], os.listdir(tmp_path)
    exec(_STATE, ns := {})
    assert_same(fw.load(tmp_path / "ck"), ns["state"](2048))


_IN_FLIGHT = """
    import sys, threading, torch, flashwrite as fw
    w = fw.Writer(stripes=2, chunk_bytes=1 << 20)
    gate = threading.Event()
    w._committer().submit(gate.wait)          # the commit thread is busy: the save stays in flight
    threading.Timer(float(sys.argv[2]), gate.set).start()
    fut = w.save_async(state(16), sys.argv[1])
    assert not fut.done()
    print("exiting", flush=True)
"""


def test_exit_says_once_what_it_waits_for(tmp_path):
    p = _child(_IN_FLIGHT, str(tmp_path / "ck"), "0.5")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert err.count("flashwrite: exit waits for a checkpoint save in flight") == 1, err
    assert str(tmp_path / "ck") in err and "(Ctrl-C abandons it)" in err, err
    assert "again" not in err, err  # issue 44 item 5: no Ctrl-C came before this one
    exec(_STATE, ns := {})
    assert_same(fw.load(tmp_path / "ck"), ns["state"](16))
    assert os.listdir(tmp_path) == ["ck"]


def test_a_second_ctrl_c_at_exit_abandons_the_save_cleanly(tmp_path):
    """Before: the interrupted join aborted the process (``terminate called without an
    active exception``, SIGABRT) and left the temporary directory. Now: exit status 130,
    nothing committed, nothing left."""
    p = _child(_IN_FLIGHT, str(tmp_path / "ck"), "1.5")
    line = p.stderr.readline()
    assert "exit waits for a checkpoint save in flight" in line, line
    time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    assert "terminate called" not in err and "Traceback" not in err, err
    assert "abandoned 1 save(s) in flight: nothing of them was committed" in err, err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_a_dropped_future_keeps_its_save(tmp_path):
    """The future is collected and the sources are freed at once (block=False): the job
    holds the sources until staged, and the save still commits whole."""
    p = _child("""
        import gc, sys, torch, flashwrite as fw
        st = state(64)
        fut = fw.save_async(st, sys.argv[1], block=False)
        del fut, st
        gc.collect()
        junk = [torch.full((1 << 22,), 7.0) for _ in range(16)]  # reuse the freed memory
    """, str(tmp_path / "ck"))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    exec(_STATE, ns := {})
    fw.verify(tmp_path / "ck")
    assert_same(fw.load(tmp_path / "ck"), ns["state"](64))


def test_the_next_save_removes_a_killed_saves_temporary_directory(tmp_path):
    """kill -9 in a plain save_async (no manager) left a hidden temporary directory that
    nothing removed. The next save into the same directory removes it; the temporary
    directories of live processes, other hosts and older versions' names stay."""
    root = tmp_path / "root"
    p = _child("""
        import sys, threading, torch, flashwrite as fw
        w = fw.Writer(stripes=2, chunk_bytes=1 << 20)
        w._committer().submit(threading.Event().wait)  # never commits
        fut = w.save_async(state(16), sys.argv[1])
        print("staged", flush=True)
        threading.Event().wait()
    """, str(root / "a"))
    assert p.stdout.readline().strip() == "staged"
    dead = [n for n in os.listdir(root) if commit.TMP_MARK in n]
    assert len(dead) == 1, os.listdir(root)
    live = os.path.basename(commit.temp_dir_for(str(root / "b")))  # this process's: alive
    other_host = f".c{commit.TMP_MARK}{p.pid}-0123456789ab-h{'0' * 8 if commit.HOST_TAG != '0' * 8 else '1' * 8}"
    old_name = f".d{commit.TMP_MARK}{p.pid}-0123456789ab"
    p.kill()
    p.communicate()
    for n in (live, other_host, old_name):
        os.mkdir(root / n)
    fw.save({"x": torch.arange(10)}, root / "e")
    assert sorted(os.listdir(root)) == sorted(["e", live, other_host, old_name]), os.listdir(root)
    assert commit.parse_temp_name(dead[0]).host == commit.HOST_TAG


def test_ctrl_c_in_a_snapshot_restore_stops_the_copy(tmp_path):
    """Restoring a node-local snapshot was one synchronous native call (copy_verify):
    Ctrl-C landed only once every byte was copied. Now the copy threads stop between
    pieces and are joined before KeyboardInterrupt leaves: the destinations are left
    part-written (the interrupt came mid-copy) and never written after the except."""
    shm = tmp_path / "shm"
    shm.mkdir()
    p = _child("""
        import signal, sys, threading, time, torch, flashwrite as fw
        from flashwrite.tier import snapshot as local
        st = state(256)
        w = fw.Writer(local_snapshots=True, local_dir=sys.argv[2])
        w.save(st, sys.argv[1])
        w.close(keep_local=True)
        snap = local.scan(sys.argv[2])[0]
        dst = state(256)
        sent = []
        def fire():
            sent.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        for trial, delay in enumerate((0.002, 0.01, 0.03, 0.06)):
            for t in dst.values():
                t.zero_()
            timer = threading.Timer(delay, fire)
            timer.start()
            try:
                local.read_snapshot(snap, targets=dst, threads=2)
                timer.join()
                time.sleep(0.05)  # a late signal lands here, not in the next trial
                print(f"trial {trial} done first", flush=True)
                continue
            except KeyboardInterrupt:
                late = time.monotonic() - sent[-1]
                written = sum(int(t.count_nonzero()) for t in dst.values())
                time.sleep(0.2)
                after = sum(int(t.count_nonzero()) for t in dst.values())
            timer.join()
            total = sum(t.numel() for t in dst.values())
            print(f"trial {trial} partial {int(written < total - 8)} moved {after - written} "
                  f"late_ms {late * 1000:.0f}", flush=True)
    """, str(tmp_path / "ck"), str(shm))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    trials = [ln.split() for ln in out.split("\n") if ln.startswith("trial") and "partial" in ln]
    assert trials, out
    assert all(t[t.index("moved") + 1] == "0" for t in trials), out   # nothing written after the except
    assert any(t[t.index("partial") + 1] == "1" for t in trials), out  # stopped mid-copy at least once
    assert all(int(t[t.index("late_ms") + 1]) < 1000 for t in trials), out


def test_a_dropped_load_future_keeps_its_destinations(ck256):
    """A load_async(into=) whose future and destinations are dropped (del + gc) while it
    runs: the job keeps the destinations alive until it is joined, and the exit waits
    for it (under ASan: no write into freed memory)."""
    p = _child("""
        import gc, sys, torch, flashwrite as fw
        for _ in range(3):
            dst = state(256)
            fut = fw.load_async(sys.argv[1], into=dst)
            del fut, dst
            gc.collect()
            junk = [torch.full((1 << 22,), 7.0) for _ in range(16)]  # reuse the freed memory
        fut = fw.load_async(sys.argv[1])
        del fut
        gc.collect()
        print("exiting", flush=True)
    """, str(ck256))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert "exiting" in out, out
