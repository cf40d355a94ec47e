"""CheckpointManager: schedules, retention, start-up clean-up, restore, logging, SIGTERM."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_same
from fault_util import flip_byte, make_state, temp_entries

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.format import decode_manifest_json
from flashwrite.system.sizes import fmt_bytes

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


N = 1 << 14  # small states: these tests are about policy, not bandwidth


def state(step):
    return make_state(step, N)


@pytest.fixture
def small_writer():
    w = fw.Writer(stripes=2, chunk_bytes=1 << 16)
    yield w
    w.close()


def hold_commits(writer):
    """Occupy the writer's single commit thread until the returned event is set, so a
    save started now stays in flight (staged, written, not committed) until then."""
    gate = threading.Event()
    writer._committer().submit(gate.wait)
    return gate


def test_exported():
    assert "CheckpointManager" in fw.__all__
    assert fw.CheckpointManager is fw.manager.manager.CheckpointManager


def test_every_n_steps_saves_exactly_the_due_steps(tmp_path, small_writer):
    with fw.CheckpointManager(tmp_path / "ck", every_n_steps=5, writer=small_writer) as mgr:
        saved = [s for s in range(23) if mgr.maybe_save(s, state(s)) is not None]
        mgr.wait()
        assert saved == [0, 5, 10, 15, 20]
        assert mgr.all_steps() == saved and mgr.latest_step() == 20
        assert sorted(os.listdir(tmp_path / "ck")) == [f"step-{s:08d}" for s in saved]
        for s in saved:
            got_step, got = mgr.restore(s)
            assert got_step == s
            assert_same(got, state(s))
    assert not small_writer._closed  # a writer passed in stays the caller's


def test_state_callable_is_only_built_when_due(tmp_path, small_writer):
    built = []

    def build(s):
        return lambda: (built.append(s), state(s))[1]

    with fw.CheckpointManager(tmp_path, every_n_steps=3, writer=small_writer) as mgr:
        for s in range(1, 8):
            mgr.maybe_save(s, build(s))
    assert built == [3, 6]
    assert_same(fw.load(tmp_path / "step-00000006"), state(6))


def test_every_n_seconds(tmp_path, small_writer):
    with fw.CheckpointManager(tmp_path, every_n_seconds=0.3, writer=small_writer) as mgr:
        assert mgr.maybe_save(1, state(1)) is None  # the clock starts at creation
        time.sleep(0.35)
        assert mgr.maybe_save(2, state(2)) is not None
        assert mgr.maybe_save(3, state(3)) is None  # ... and restarts at each save
        time.sleep(0.35)
        assert mgr.maybe_save(4, state(4)) is not None
    assert fw.CheckpointManager(tmp_path, cleanup=False).all_steps() == [2, 4]


def test_no_schedule_means_only_explicit_saves(tmp_path, small_writer):
    with fw.CheckpointManager(tmp_path, writer=small_writer) as mgr:
        assert all(mgr.maybe_save(s, state(s)) is None for s in range(5))
        mgr.save(3, state(3)).result()
        assert mgr.all_steps() == [3]


def test_retention_keep_last_and_every_n(tmp_path, small_writer, caplog):
    caplog.set_level(logging.INFO, logger="flashwrite")
    with fw.CheckpointManager(tmp_path, every_n_steps=5, keep_last=2, keep_every_n_steps=20,
                              writer=small_writer) as mgr:
        for s in range(0, 96):
            if mgr.maybe_save(s, state(s)) is not None:
                mgr.wait()
                expect_all = [x for x in range(0, s + 1, 5)]
                expect = sorted({x for x in expect_all if x % 20 == 0} | set(expect_all[-2:]))
                assert mgr.all_steps() == expect, s
    assert mgr.all_steps() == [0, 20, 40, 60, 80, 90, 95]
    assert temp_entries(tmp_path) == []
    # Every deletion is logged after the commit that triggered it.
    msgs = [r.getMessage() for r in caplog.records if r.name == "flashwrite"]
    first_removal = next(i for i, m in enumerate(msgs) if "removed checkpoint step 5 " in m)
    assert "checkpoint step 15 committed" in msgs[first_removal - 1]


def test_retention_never_deletes_newest_or_just_committed(tmp_path, small_writer):
    with fw.CheckpointManager(tmp_path, keep_last=1, writer=small_writer) as mgr:
        mgr.save(10, state(10)).result()
        mgr.wait()
        mgr.save(5, state(5))   # an older step saved after a newer one: both stay for now
        mgr.wait()
        assert mgr.all_steps() == [5, 10]
        mgr.save(11, state(11))
        mgr.wait()
        assert mgr.all_steps() == [11]


def test_retention_ignores_foreign_entries(tmp_path, small_writer):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-00000001").mkdir()          # no manifest: not a checkpoint
    (tmp_path / "step-2").mkdir()                  # not our exact name
    (tmp_path / "best").mkdir()
    with fw.CheckpointManager(tmp_path, every_n_steps=1, keep_last=1, writer=small_writer) as mgr:
        assert mgr.all_steps() == []
        for s in range(3, 7):
            mgr.maybe_save(s, state(s))
    assert sorted(os.listdir(tmp_path)) == ["best", "notes.txt", "step-00000001", "step-00000006", "step-2"]


def test_commit_log_line(tmp_path, small_writer, caplog):
    caplog.set_level(logging.INFO, logger="flashwrite")
    with fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer) as mgr:
        mgr.maybe_save(7, state(7))
        stats = mgr.wait()
    lines = [r for r in caplog.records if r.name == "flashwrite" and "committed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert "step 7 " in msg and "step-00000007" in msg
    # The size is what landed on disk (every stripe), in the unit that keeps 1-3 digits before the point.
    ck = tmp_path / "step-00000007"
    on_disk = sum(os.path.getsize(ck / f["name"]) for f in decode_manifest_json((ck / "flashwrite.json").read_text())["files"])
    assert stats.bytes == on_disk
    unit, scale = next((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
                       if on_disk >= s)
    v = on_disk / scale
    shown = f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    assert fmt_bytes(stats.bytes) == shown and f", {shown}," in msg
    assert f"{stats.gbps:.3g} GB/s" in msg
    for part in ("stall ", "durable after ", "GB/s"):
        assert part in msg


def test_skip_policy_when_busy(tmp_path, small_writer, caplog):
    caplog.set_level(logging.INFO, logger="flashwrite")
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, if_busy="skip", writer=small_writer)
    gate = hold_commits(small_writer)
    f1 = mgr.maybe_save(1, state(1))
    assert f1 is not None and f1.staged and not f1.done()
    assert mgr.maybe_save(2, state(2)) is None   # skipped, not queued
    assert any("skipping the checkpoint at step 2" in r.getMessage() for r in caplog.records)
    assert mgr.all_steps() == []                 # nothing visible before the commit
    gate.set()
    mgr.wait()
    assert mgr.maybe_save(3, state(3)) is not None
    mgr.close()
    assert mgr.all_steps() == [1, 3]


def test_wait_policy_when_busy(tmp_path, small_writer):
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer)
    gate = hold_commits(small_writer)
    mgr.maybe_save(1, state(1))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("f", mgr.maybe_save(2, state(2))))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the second save must wait for the first"
    gate.set()
    t.join(10)
    assert out["f"] is not None
    mgr.close()
    assert mgr.all_steps() == [1, 2]


def test_existing_step(tmp_path, small_writer, caplog):
    with fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer) as mgr:
        mgr.save(4, state(4)).result()
        assert mgr.maybe_save(4, state(99)) is None
        assert any("already exists" in r.getMessage() for r in caplog.records)
        with pytest.raises(fw.CheckpointExistsError):
            mgr.save(4, state(99))
        mgr.save(4, state(5), overwrite=True).result()
        assert_same(mgr.restore(4)[1], state(5))


def test_startup_cleanup_removes_only_stale_temps(tmp_path, small_writer):
    root = tmp_path / "ck"
    fw.CheckpointManager(root, writer=small_writer).save(1, state(1)).result()
    fw.save(state(2), root / "step-00000002", stripes=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()

    def tmpname(step, pid):
        return f".step-{step:08d}{commit.TMP_MARK}{pid}-0123456789ab"

    made = {
        "crashed": root / tmpname(3, dead),                         # its process is gone
        "recycled": root / tmpname(4, os.getpid()),                 # pid alive but younger than the dir
        "live": root / tmpname(5, os.getpid()),                     # ours, fresh: may be in flight
        "old_no_manifest": root / f".step-00000001{commit.OLD_MARK}aaaa",   # original exists
        "old_restorable": root / f".step-00000009{commit.OLD_MARK}bbbb",    # original gone, whole
        "link": root / f".x{commit.TMP_MARK}{dead}-cccc",           # a link: removed, target kept
    }
    for k, p in made.items():
        if k == "link":
            os.symlink(outside, p)
        elif k == "old_restorable":
            fw.save(state(9), root / "tmp9", stripes=2)
            os.rename(root / "tmp9", p)
        else:
            p.mkdir()
            (p / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    old = time.time() - 10 * 365 * 86400
    os.utime(made["recycled"], (old, old))
    foreign = [root / "notes.txt", root / ".hidden", root / "step-00000007", root / ".step-00000008.tmp"]
    foreign[0].write_text("keep")
    foreign[1].write_text("keep")
    foreign[2].mkdir()
    foreign[3].mkdir()

    mgr = fw.CheckpointManager(root, writer=small_writer)
    assert temp_entries(root) == [made["live"].name]
    assert (outside / "precious").read_text() == "x"
    for p in foreign:
        assert p.exists(), p
    assert mgr.all_steps() == [1, 2, 9]
    assert_same(mgr.restore(9)[1], state(9))
    assert fw.CheckpointManager(root, cleanup=False).all_steps() == [1, 2, 9]


def test_restore(tmp_path, small_writer):
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer)
    assert mgr.restore() is None and mgr.latest_step() is None
    for s in (1, 2, 3):
        mgr.maybe_save(s, state(s))
    mgr.wait()
    step, got = mgr.restore()
    assert step == 3
    assert_same(got, state(3))
    assert mgr.restore_latest()[0] == 3
    with pytest.raises(FileNotFoundError):
        mgr.restore(17)
    # into=: filled in place, no new tensors
    dst = state(0)
    ptr = dst["model"]["w"].data_ptr()
    step, out = mgr.restore(2, into=dst)
    assert step == 2 and out is dst and dst["model"]["w"].data_ptr() == ptr
    assert_same(dst, state(2))
    mgr.close()


def test_restore_falls_back_past_a_damaged_newest(tmp_path, small_writer, caplog):
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer)
    for s in (1, 2):
        mgr.maybe_save(s, state(s))
    mgr.close()
    stripe = sorted(p for p in os.listdir(tmp_path / "step-00000002") if p.endswith(".safetensors"))[0]
    flip_byte(tmp_path / "step-00000002" / stripe, 8192, 0x10)
    mgr = fw.CheckpointManager(tmp_path)
    dst = state(0)
    step, out = mgr.restore(into=dst)
    assert step == 1
    assert_same(dst, state(1))
    assert any(r.levelno == logging.ERROR and "step 2" in r.getMessage() for r in caplog.records)
    with pytest.raises(fw.ChecksumMismatchError) as ei:
        mgr.restore(2)
    assert ei.value.file == stripe
    with pytest.raises(fw.ChecksumMismatchError):
        mgr.restore(fallback=False)
    mgr.close()


def test_closed_manager(tmp_path, small_writer):
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer)
    mgr.close()
    mgr.close()
    with pytest.raises(RuntimeError):
        mgr.maybe_save(1, state(1))


def test_owned_writer_is_closed(tmp_path):
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1)
    mgr.maybe_save(0, state(0))
    mgr.close()
    assert mgr._writer._closed and mgr.all_steps() == [0]


@pytest.mark.parametrize("kw", [dict(every_n_steps=0), dict(keep_last=0), dict(every_n_seconds=-1),
                                dict(keep_every_n_steps=1.5), dict(if_busy="queue")])
def test_bad_arguments(tmp_path, kw):
    with pytest.raises(ValueError):
        fw.CheckpointManager(tmp_path, **kw)


def test_bad_step(tmp_path, small_writer):
    with fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer) as mgr:
        for bad in (-1, 1.0, True, "3"):
            with pytest.raises(ValueError):
                mgr.maybe_save(bad, state(0))


_SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import flashwrite as fw
    from fault_util import make_state
    mode, root, marker = sys.argv[1:4]
    if mode == "chained":
        def previous(signum, frame):
            open(marker, "w").write("previous handler ran")
            sys.exit(3)
        signal.signal(signal.SIGTERM, previous)
    else:
        # Whatever the parent left (a wrapper may ignore SIGTERM), this mode tests the default action.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    w = fw.Writer(stripes=2, chunk_bytes=1 << 16)
    step = 0
    mgr = fw.CheckpointManager(root, every_n_steps=10, writer=w, handle_sigterm=True,
                               final_state=lambda: (step, make_state(step, {n})))
    gate = threading.Event()
    w._committer().submit(gate.wait)          # keep step 10 in flight when SIGTERM lands
    threading.Timer(0.5, gate.set).start()
    for step in range(1, 3000):               # bounded: about 60 s, 300 saves of 64 KiB
        mgr.maybe_save(step, lambda: make_state(step, {n}))
        if step == 10:
            print("ready", flush=True)
        time.sleep(0.02)
    """)


@pytest.mark.parametrize("mode", ["chained", "default"])
def test_sigterm_completes_in_flight_and_saves_final(tmp_path, mode):
    root = tmp_path / "ck"
    marker = tmp_path / "marker"
    code = _SIGTERM_CHILD.format(tests=os.path.dirname(_TESTS_FILE), n=N)
    with subprocess.Popen([sys.executable, "-c", code, mode, str(root), str(marker)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            assert fw.CheckpointManager(root, cleanup=False).all_steps() == []  # step 10 still in flight
            time.sleep(0.05)  # a few training steps later
            p.send_signal(signal.SIGTERM)
            rc = p.wait(30)
        finally:
            p.kill()
            err = p.communicate()[1]
    if mode == "chained":
        assert rc == 3, err
        assert marker.read_text() == "previous handler ran"
    else:
        assert rc == -signal.SIGTERM, err
        assert not marker.exists()
    mgr = fw.CheckpointManager(root)
    steps = mgr.all_steps()
    assert steps[0] == 10 and len(steps) == 2 and steps[1] > 10, (steps, err)
    for s in steps:
        assert_same(fw.load(mgr.path_for(s)), make_state(s, N))
    assert temp_entries(root) == []


def test_sigterm_handler_restored_on_close(tmp_path, small_writer):
    before = signal.getsignal(signal.SIGTERM)
    mgr = fw.CheckpointManager(tmp_path, writer=small_writer, handle_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) == mgr._on_sigterm
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_threads_and_tensors_released(tmp_path, small_writer):
    # The manager keeps no reference to the saved state once it is committed.
    import weakref
    t = torch.randn(N)
    ref = weakref.ref(t)
    with fw.CheckpointManager(tmp_path, every_n_steps=1, writer=small_writer) as mgr:
        mgr.maybe_save(1, {"t": t})
        mgr.wait()
        del t
        assert ref() is None
