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
from fault_util import Zygote, fill, flip_byte, loop_ext4, make_state, need_root, temp_entries, tmpfs

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.format import decode_manifest_json

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
    # Replay a run with FLASHWRITE_TEST_SEED=<seed> (FLASHWRITE_FAULT_SEED, the older name, works too).
    seed = int(os.environ.get("FLASHWRITE_TEST_SEED") or os.environ.get("FLASHWRITE_FAULT_SEED")
               or time.time_ns() % 2**32)
    print(f"kill -9 test seed {seed} (replay: FLASHWRITE_TEST_SEED={seed})", flush=True)
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
            elif tag == "finished":
                out["run_s"] = time.monotonic() - out["t_stage"]
            elif tag == "stage":
                out["started"] = max(out["started"], int(line[1]))
                out.setdefault("t_stage", time.monotonic())
            elif tag == "committed":
                out["committed"].append(int(line[1]))
            if out["killed_at"] is not None:
                continue
            if tag == "stage" and n == 1 and trial["kind"] == "random":  # the first state is built: saving begins
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
        assert first["code"] == 0 and first["last"] == "finished", (first, zygote.log_tail())
        per_save.append(first["run_s"] / 4)
        _check_root(root, [], first["committed"], first["started"])

    results = []
    for trial in _trial_plan(rng):
        trial["window"] = min(per_save) * 6
        before = fw.CheckpointManager(root, cleanup=False).all_steps()
        out = run_victim(trial)
        assert out["code"] in (-signal.SIGKILL, 0), (out, zygote.log_tail())
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


# --------------------------------------------------------------------------- disk full

SMALL_N = 1 << 17   # ~0.7 MB per checkpoint
BIG_N = 1 << 20     # ~5.6 MB per checkpoint


def _assert_enospc(fut, mnt):
    with pytest.raises(OSError) as ei:
        fut.result(timeout=60)
    e = ei.value
    assert e.errno == errno.ENOSPC, e
    assert "No space left" in str(e)
    return e


def _disk_full_scenario(mnt, caplog, leave_bytes):
    root = os.path.join(mnt, "ck")
    w = fw.Writer(stripes=3, chunk_bytes=1 << 20)
    mgr = fw.CheckpointManager(root, every_n_steps=1, keep_last=1, writer=w)
    try:
        mgr.maybe_save(1, make_state(1, SMALL_N))
        mgr.wait()
        ballast = fill(mnt, leave_bytes)
        fut = mgr.maybe_save(2, make_state(2, BIG_N))
        assert fut is not None and fut.staged  # staging worked; the disk filled up while writing
        e = _assert_enospc(fut, mnt)
        assert e.filename and commit.TMP_MARK in e.filename  # names the stripe being written
        with pytest.raises(OSError) as ei:  # wait() reports it too (once)
            mgr.wait()
        assert ei.value is e
        assert mgr.wait() is None
        assert temp_entries(root) == []                       # temp dir removed
        assert mgr.all_steps() == [1]                         # retention did not run
        assert_same(fw.load(mgr.path_for(1)), make_state(1, SMALL_N))
        assert any(r.levelno == logging.ERROR and "step 2 failed" in r.getMessage() for r in caplog.records)
        # Training goes on; the next save fails the same way while the disk is full ...
        x = torch.randn(100)
        x.mul_(2)
        _assert_enospc(mgr.maybe_save(3, make_state(3, BIG_N)), mnt)
        # ... and works once space is freed.
        os.unlink(ballast)
        mgr.maybe_save(4, make_state(4, BIG_N)).result(timeout=60)
        mgr.wait()
        assert mgr.all_steps() == [4] and temp_entries(root) == []
        assert_same(fw.load(mgr.path_for(4)), make_state(4, BIG_N))
        fw.verify(mgr.path_for(4))
    finally:
        try:
            mgr.close()
        except OSError:
            pass
        w.close()


@pytest.mark.root
def test_disk_full_tmpfs(tmp_path, caplog):
    """tmpfs: fallocate of a later stripe fails up front (the first stripe fits)."""
    with tmpfs(str(tmp_path / "mnt"), "16m") as mnt:
        _disk_full_scenario(mnt, caplog, leave_bytes=3 << 20)


@pytest.mark.root
def test_disk_full_ext4_mid_write(tmp_path, caplog):
    """ext4 without extents refuses fallocate: the disk fills in the middle of a write."""
    with loop_ext4(str(tmp_path / "mnt"), 24, extents=False) as mnt:
        _disk_full_scenario(mnt, caplog, leave_bytes=3 << 20)


@pytest.mark.root
def test_failed_writes_give_every_slot_back(tmp_path):
    """A save whose writes fail (the disk fills in the middle of a write) still ends with
    every staging slot free: each slot's write failed or never ran, its checksum ran,
    and trim() can release the whole pool. Twice, so a leaked slot would also show as a
    second save that cannot stage."""
    from flashwrite import _core
    src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    with loop_ext4(str(tmp_path / "mnt"), 16, extents=False) as mnt:
        eng = _core.Engine(1 << 20)
        for i in range(2):
            path = os.path.join(mnt, f"s{i}")
            job = eng.start_save([(path, b"", src.nbytes)], [(src.data_ptr(), src.nbytes, 0, 0, -1)], [src],
                                 copy_threads=2)
            assert job.wait_staged(60) and job.wait(60)
            with pytest.raises(OSError) as ei:
                job.rethrow()
            assert ei.value.errno == errno.ENOSPC and ei.value.filename == path
            os.unlink(path)
            assert eng.trim() == 24 << 20, i


@pytest.mark.root
@pytest.mark.parametrize("extra_pages", [0, 1], ids=["index", "manifest"])
def test_disk_full_at_commit(tmp_path, extra_pages):
    """Every stripe fits, then the index (or the manifest) does not: the failure comes
    from the commit step in Python, and is handled the same way."""
    w = fw.Writer(stripes=3, chunk_bytes=1 << 20)
    state = make_state(5, SMALL_N)
    fw.save(state, tmp_path / "probe", stripes=3, chunk_bytes=1 << 20)
    stripes = [f for f in os.listdir(tmp_path / "probe") if f.endswith(".safetensors")]
    pages = sum(-(-os.path.getsize(tmp_path / "probe" / f) // 4096) for f in stripes)
    with tmpfs(str(tmp_path / "mnt"), "8m") as mnt:
        fw.save(make_state(1, SMALL_N), os.path.join(mnt, "step-1"), stripes=3, chunk_bytes=1 << 20)
        ballast = fill(mnt, (pages + extra_pages) * 4096)
        fut = w.save_async(state, os.path.join(mnt, "step-5"))
        e = _assert_enospc(fut, mnt)
        assert os.path.basename(e.filename) == (fw.format.INDEX_NAME, fw.format.MANIFEST_NAME)[extra_pages], e
        assert commit.TMP_MARK in e.filename
        assert sorted(os.listdir(mnt)) == sorted(["step-1", os.path.basename(ballast)])
        assert_same(fw.load(os.path.join(mnt, "step-1")), make_state(1, SMALL_N))
        os.unlink(ballast)
        w.save(state, os.path.join(mnt, "step-5"))
        assert_same(fw.load(os.path.join(mnt, "step-5")), state)
    w.close()


# --------------------------------------------------------------------------- permissions

def test_missing_parents_are_created(tmp_path):
    p = tmp_path / "a" / "b" / "c" / "step-1"
    fw.save(make_state(1, SMALL_N), p)
    assert_same(fw.load(p), make_state(1, SMALL_N))
    mgr = fw.CheckpointManager(tmp_path / "x" / "y", every_n_steps=1)
    mgr.maybe_save(0, make_state(0, SMALL_N))
    mgr.close()
    assert mgr.all_steps() == [0]


@pytest.mark.root
def test_permission_denied_immutable_dir(tmp_path):
    need_root()
    root = tmp_path / "ck"
    mgr = fw.CheckpointManager(root, every_n_steps=1)
    mgr.maybe_save(1, make_state(1, SMALL_N))
    mgr.wait()
    r = subprocess.run(["chattr", "+i", str(root)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"chattr +i not possible here: {r.stderr.strip()}")
    try:
        t0 = time.perf_counter()
        with pytest.raises(PermissionError) as ei:
            mgr.maybe_save(2, make_state(2, SMALL_N))
        assert str(root) in str(ei.value)
        with pytest.raises(PermissionError):
            fw.save_async(make_state(2, SMALL_N), root / "sub" / "step-2")  # a parent to create
        assert time.perf_counter() - t0 < 10
        assert mgr.all_steps() == [1] and temp_entries(root) == []
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    mgr.maybe_save(3, make_state(3, SMALL_N)).result()
    mgr.close()
    assert mgr.all_steps() == [1, 3]


@pytest.mark.root
def test_read_only_mount(tmp_path):
    need_root()
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    fw.save(make_state(1, SMALL_N), src / "step-00000001")
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount read-only: {r.stderr.strip()}")
    try:
        if subprocess.run(["touch", str(ro / "probe")], capture_output=True).returncode == 0:
            pytest.skip("the bind mount is not read-only here")
        with pytest.raises(OSError) as ei:
            fw.save_async(make_state(2, SMALL_N), ro / "step-00000002")
        assert ei.value.errno == errno.EROFS
        # A read-only root still serves restores (clean-up failures are only logged).
        mgr = fw.CheckpointManager(ro)
        assert mgr.restore()[0] == 1
        mgr.close()
    finally:
        subprocess.run(["umount", str(ro)], check=True)


_UNPRIVILEGED = textwrap.dedent("""
    import os, sys, time
    import torch
    import flashwrite as fw
    os.setgid(65534)
    os.setuid(65534)
    root = sys.argv[1]
    for target in (os.path.join(root, "step-2"), os.path.join(root, "new", "step-2")):
        try:
            fw.save_async({"w": torch.ones(1000)}, target)
            print("no error")
        except PermissionError as e:
            print("PermissionError", e.errno, e.filename)
    mgr = fw.CheckpointManager(root, every_n_steps=1)
    try:
        mgr.maybe_save(2, {"w": torch.ones(1000)})
        print("no error")
    except PermissionError as e:
        print("PermissionError", e.errno, e.filename)
    print("restored", mgr.restore()[0])
    """)


@pytest.mark.root
def test_permission_denied_unprivileged_process(tmp_path):
    """Root ignores mode bits, so the check runs in a process that dropped to nobody."""
    need_root()
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="fw-perm-")  # pytest's tmp dirs are 0700: nobody could not even look
    try:
        os.chmod(top, 0o755)
        root = os.path.join(top, "ck")
        fw.save(make_state(1, SMALL_N), os.path.join(root, "step-00000001"))
        os.chmod(root, 0o755)
        r = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, root], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == 4 and lines[3] == "restored 1", r.stdout
        for line in lines[:3]:  # raised by the call itself, naming the place it could not create
            assert line.startswith(f"PermissionError {errno.EACCES} {root}/"), r.stdout
        assert sorted(os.listdir(root)) == ["step-00000001"]
    finally:
        shutil.rmtree(top)


# --------------------------------------------------------------------------- corruption on disk

def _corruption_state():
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(300_000, generator=g), "b": torch.randn(70_000, generator=g).double(),
            "c": torch.randint(0, 100, (50_000,), generator=g, dtype=torch.int32),
            "d": torch.randn(120_000, generator=g).half(), "step": 3}


@pytest.fixture
def damaged(tmp_path):
    """A fresh 3-stripe checkpoint and its manifest, to be damaged by the test."""
    path = tmp_path / "ck"
    state = _corruption_state()
    fw.save(state, path, stripes=3, chunk_bytes=1 << 16)
    manifest = decode_manifest_json((path / "flashwrite.json").read_text())
    return path, state, manifest


@pytest.mark.parametrize("seed", range(6))
def test_flipped_byte_is_named(damaged, seed):
    path, state, m = damaged
    rng = random.Random(seed)
    key = sorted(m["tensors"])[seed % 4]
    t = m["tensors"][key]
    fname = m["files"][t["file"]]["name"]
    pos = rng.randrange(t["nbytes"])
    flip_byte(path / fname, t["offset"] + pos, 1 << rng.randrange(8))
    for check in (lambda: fw.load(path), lambda: fw.verify(path)):
        with pytest.raises(fw.ChecksumMismatchError) as ei:
            check()
        e = ei.value
        assert (e.file, e.tensor) == (fname, key)
        assert fname in str(e) and repr(key) in str(e)
        assert e.offset <= t["offset"] + pos < e.offset + (1 << 16)
        assert e.expected != e.actual
    # verify=False: the user gets the bytes on disk, flipped bit included, and nothing else changed
    got = fw.load(path, verify=False)
    for k in ("a", "b", "c", "d"):
        a = got[k].reshape(-1).view(torch.uint8)
        b = state[k].reshape(-1).view(torch.uint8)
        diff = (a != b).nonzero().flatten().tolist()
        assert diff == ([pos] if k == key else []), (k, diff)


def test_flipped_byte_in_header_is_named(damaged):
    path, _, m = damaged
    fname = m["files"][1]["name"]
    with open(path / fname, "rb") as fh:
        head = fh.read(200)
    pos = head.index(b'"dtype"') + 2
    flip_byte(path / fname, pos, 0x20)
    for verify in (True, False):
        with pytest.raises(fw.CorruptCheckpointError) as ei:
            fw.load(path, verify=verify)
        assert ei.value.file == fname and fname in str(ei.value)


@pytest.mark.parametrize("cut", ["one-byte", "half", "header-only", "empty"])
def test_truncated_stripe_is_named(damaged, cut):
    path, _, m = damaged
    f = m["files"][2]
    size = {"one-byte": f["size"] - 1, "half": f["size"] // 2, "header-only": f["header_bytes"], "empty": 0}[cut]
    os.truncate(path / f["name"], size)
    for verify in (True, False):
        with pytest.raises(fw.CorruptCheckpointError) as ei:
            fw.load(path, verify=verify)
        assert ei.value.file == f["name"] and "truncated" in str(ei.value)


def test_grown_stripe_is_named(damaged):
    path, _, m = damaged
    with open(path / m["files"][0]["name"], "ab") as fh:
        fh.write(b"x")
    with pytest.raises(fw.CorruptCheckpointError) as ei:
        fw.load(path)
    assert ei.value.file == m["files"][0]["name"]


def test_missing_stripe_is_named(damaged):
    path, _, m = damaged
    os.unlink(path / m["files"][1]["name"])
    for verify in (True, False):
        with pytest.raises(fw.CorruptCheckpointError) as ei:
            fw.load(path, verify=verify)
        assert ei.value.file == m["files"][1]["name"] and "missing" in str(ei.value)


def test_missing_manifest(damaged, tmp_path):
    path, _, m = damaged
    os.unlink(path / "flashwrite.json")
    with pytest.raises(fw.CorruptCheckpointError) as ei:
        fw.load(path, verify=False)
    assert ei.value.file == "flashwrite.json" and "missing" in str(ei.value)
    os.rename(path, tmp_path / "step-00000003")
    assert fw.CheckpointManager(tmp_path, cleanup=False).all_steps() == []  # never listed as a checkpoint


def _alter(m, what):
    key = "a"
    t = m["tensors"][key]
    if what == "checksum":
        t["checksums"][1] = f"{int(t['checksums'][1], 16) ^ 1:016x}"
    elif what == "dtype":
        t["dtype"] = "int32"                   # same item size: only the header can tell
    elif what == "shape":
        t["shape"] = [t["shape"][0] // 2, 2]   # same byte length
    elif what == "offset":
        t["offset"] += 4
        t["nbytes"] -= 4
        t["shape"] = [t["nbytes"] // 4]
    elif what == "file-size":
        m["files"][t["file"]]["size"] += 4096
    elif what == "file-name":
        m["files"][t["file"]]["name"] = "model-00009-of-00009.safetensors"
    elif what == "dropped-tensor":
        del m["tensors"][key]
    return key


@pytest.mark.parametrize("what", ["checksum", "dtype", "shape", "offset", "file-size", "file-name",
                                  "dropped-tensor", "truncated-json", "not-json"])
def test_altered_manifest_is_detected(damaged, what):
    path, state, m = damaged
    key = _alter(m, what)
    data = fw.format.encode_manifest(m)  # sealed: the targeted check must catch it, not the manifest checksum
    if what == "truncated-json":
        data = data[: len(data) // 2]
    elif what == "not-json":
        data = b"\x00\xff" * 100
    (path / "flashwrite.json").write_bytes(data)
    with pytest.raises(fw.CorruptCheckpointError) as ei:
        fw.load(path)
    e = ei.value
    assert e.file is not None and (e.file in str(e) or e.file == "flashwrite.json"), e
    if what in ("checksum", "dtype", "shape"):
        assert e.tensor == key, e
    if what == "checksum":
        assert isinstance(e, fw.ChecksumMismatchError)
        assert_same(fw.load(path, verify=False), state)  # the bytes are fine: verify=False loads them


# --------------------------------------------------------------------------- concurrency

def test_saves_from_two_threads(tmp_path):
    """Two training threads, each with its own manager, plus two threads sharing the
    default writer through fw.save_async, all at once."""
    errors = []

    def with_manager(name):
        try:
            mgr = fw.CheckpointManager(tmp_path / name, every_n_steps=1, keep_last=3,
                                       writer=fw.Writer(stripes=2, chunk_bytes=1 << 16))
            for s in range(12):
                mgr.maybe_save(s, make_state(s + (100 if name == "m2" else 0), SMALL_N))
            mgr.close()
            mgr._writer.close()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def shared_writer(name):
        try:
            futs = [fw.save_async(make_state(s + 1000, SMALL_N), tmp_path / name / f"s{s}") for s in range(8)]
            for f in futs:
                f.result(60)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=with_manager, args=(n,)) for n in ("m1", "m2")]
    threads += [threading.Thread(target=shared_writer, args=(n,)) for n in ("d1", "d2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for name, off in (("m1", 0), ("m2", 100)):
        mgr = fw.CheckpointManager(tmp_path / name)
        assert mgr.all_steps() == [9, 10, 11]
        for s in mgr.all_steps():
            assert_same(fw.load(mgr.path_for(s)), make_state(s + off, SMALL_N))
    for name in ("d1", "d2"):
        for s in range(8):
            assert_same(fw.load(tmp_path / name / f"s{s}"), make_state(s + 1000, SMALL_N))


def test_load_while_a_save_is_in_flight(tmp_path):
    w = fw.Writer(stripes=3, chunk_bytes=1 << 20)
    mgr = fw.CheckpointManager(tmp_path, every_n_steps=1, writer=w)
    mgr.maybe_save(1, make_state(1, BIG_N))
    mgr.wait()
    gate = threading.Event()
    w._committer().submit(gate.wait)  # hold step 2 between "written" and "committed"
    try:
        fut = mgr.maybe_save(2, make_state(2, BIG_N))
        assert not fut.done()
        assert_same(fw.load(mgr.path_for(1)), make_state(1, BIG_N))
        assert_same(fw.load_async(mgr.path_for(1)).result(60), make_state(1, BIG_N))
        assert mgr.restore()[0] == 1 and mgr.all_steps() == [1]
        with pytest.raises(FileNotFoundError):
            fw.load(mgr.path_for(2))  # invisible until committed
    finally:
        gate.set()
    fut.result(60)
    assert mgr.restore()[0] == 2
    # And with real overlap: loads racing saves, no gate.
    futs = []
    for s in range(3, 9):
        futs.append(mgr.maybe_save(s, make_state(s, BIG_N)))
        assert_same(fw.load(mgr.path_for(s - 2)), make_state(s - 2, BIG_N))
    mgr.close()
    w.close()
    for s in range(1, 9):
        assert_same(fw.load(mgr.path_for(s)), make_state(s, BIG_N))
