"""The node-local tier (issue 15): a reserved pool, staged snapshots in shared
memory that outlive the process, restarts from memory, hygiene."""

import fcntl
import gc
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import flashwrite as fw
from flashwrite import CheckpointManager, Writer
from flashwrite.tier import snapshot as local
from conftest import assert_same
from fault_util import flip_byte, make_state, tmpfs
from local_child import staging_state

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


HERE = os.path.dirname(_TESTS_FILE)
CHUNK = 1 << 20


# ------------------------------------------------------------------ reserve


def test_reserve_sizes_the_pool_before_the_first_save(tmp_path):
    state = make_state(1)
    with Writer(chunk_bytes=CHUNK) as w:
        fut = w.reserve(state)
        reserved = fut.result(timeout=60)
        assert reserved == w.pool_bytes > 0
        w.save(state, tmp_path / "a")
        assert w.pool_bytes == reserved  # the first save found every slot it needed
        assert_same(fw.load(tmp_path / "a"), state)


def test_reserve_by_size_blocks_when_asked(tmp_path):
    with Writer(chunk_bytes=CHUNK) as w:
        w.reserve(5 * CHUNK + 1, block=True)
        assert w.pool_bytes == 6 * CHUNK
        with pytest.raises(ValueError):
            w.reserve(-1)


def test_manager_reserves_from_the_state(tmp_path):
    state = make_state(1)
    with CheckpointManager(tmp_path / "ck", reserve=state) as m:
        assert m._writer._reserving.result(timeout=60) > 0
        m.save(1, state)
    assert_same(fw.load(tmp_path / "ck" / "step-00000001"), state)


# -------------------------------------------------------- single process


def _files(d):
    return sorted(n for n in os.listdir(d) if n.startswith(local.PREFIX))


def test_snapshot_header_exists_when_save_returns(tmp_path, shmdir):
    state = make_state(1)
    with Writer(chunk_bytes=CHUNK, local_snapshots=True, local_dir=shmdir) as w:
        fut = w.save_async(state, tmp_path / "a")
        snaps = local.scan(shmdir)
        assert len(snaps) == 1 and snaps[0].path == str(tmp_path / "a")
        assert snaps[0].alive
        fut.result()
        assert local.scan(shmdir)[0].state == "committed"
        m, tensors = local.read_snapshot(local.scan(shmdir)[0])
        assert torch.equal(tensors["model.w"], state["model"]["w"])
        # The next save retires the header of the committed one before reusing its slots.
        w.save(make_state(2), tmp_path / "b")
        assert [s.path for s in local.scan(shmdir)] == [str(tmp_path / "b")]
    assert _files(shmdir) == []  # a clean close removes what it owns


def test_keep_local_keeps_the_newest(tmp_path, shmdir):
    w = Writer(chunk_bytes=CHUNK, local_snapshots=True, local_dir=shmdir)
    w.save(make_state(1), tmp_path / "a")
    w.save(make_state(2), tmp_path / "b")
    w.close(keep_local=True)
    snaps = local.scan(shmdir)
    assert [s.path for s in snaps] == [str(tmp_path / "b")]
    _, tensors = local.read_snapshot(snaps[0])
    assert torch.equal(tensors["model.w"], make_state(2)["model"]["w"])


def test_restore_prefers_memory_and_skips_a_flipped_byte(tmp_path, shmdir, caplog):
    root = tmp_path / "ck"
    with CheckpointManager(root, local_snapshots=True, local_dir=shmdir, keep_local=True) as m:
        m.save(1, make_state(1))
        m.save(2, make_state(2))
    m2 = CheckpointManager(root, local_snapshots=True, local_dir=shmdir)
    with caplog.at_level(logging.INFO, logger="flashwrite"):
        step, state = m2.restore()
    assert step == 2 and "from local memory" in caplog.text
    assert_same(state, make_state(2))
    m2.close()
    # Damage one byte of the snapshot's data in shared memory.
    snap = local.scan(shmdir)[0]
    w_key = snap.body["manifest"]["tensors"]["model.w"]
    chunk = next(c for c in snap.body["chunks"] if c[0] == w_key["file"] and c[1] <= w_key["offset"] < c[1] + c[2])
    at = chunk[3] + w_key["offset"] - chunk[1] + 100
    flip_byte(snap.pool, at, 0x40)
    caplog.clear()
    m3 = CheckpointManager(root, local_snapshots=True, local_dir=shmdir)
    with caplog.at_level(logging.INFO, logger="flashwrite"):
        step, state = m3.restore()
    assert step == 2 and "cannot be restored" in caplog.text and "model.w" in caplog.text
    assert_same(state, make_state(2))  # from storage
    m3.close()


def test_restart_removes_dead_owners_older_snapshots(tmp_path, shmdir):
    root = tmp_path / "ck"
    # A dead process's snapshots of steps 1 and 3, step 2 committed: step 1 goes, step 3 stays.
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import flashwrite, fault_util as u; "
            f"w = flashwrite.Writer(chunk_bytes={CHUNK}, local_snapshots=True, local_dir={shmdir!r}); "
            f"w2 = flashwrite.Writer(chunk_bytes={CHUNK}, local_snapshots=True, local_dir={shmdir!r}); "
            f"w.save(u.make_state(1), {str(root / 'step-00000001')!r}); "
            f"w2.save(u.make_state(3), {str(root / 'step-00000003')!r}); "
            f"import os; os._exit(0)")
    child = subprocess.Popen([sys.executable, "-c", code])
    assert child.wait() == 0
    half = os.path.join(shmdir, f"{local.PREFIX}{child.pid}-0-000009{local.HEADER_SUFFIX}.tmp-0000")
    open(half, "wb").close()  # a header it was writing when it died
    fw.save(make_state(2), root / "step-00000002")
    import shutil
    shutil.rmtree(root / "step-00000003")  # step 3 never reached storage
    m = CheckpointManager(root, local_snapshots=True, local_dir=shmdir)
    steps = sorted(m.find_local_snapshots())
    assert steps == [3] and not os.path.exists(half)
    step, state = m.restore()
    assert step == 3
    assert_same(state, make_state(3))
    m.wait()  # the write-back of step 3
    assert m.all_steps()[-1] == 3
    assert_same(fw.load(root / "step-00000003"), make_state(3))
    m.close()
    # The dead owner's snapshot of step 3 went once step 3 was committed; ours went at close.
    assert _files(shmdir) == []


@pytest.mark.root
def test_small_shared_memory_falls_back_to_private(tmp_path, caplog):
    with tmpfs(str(tmp_path / "small"), "2m") as small:
        with caplog.at_level(logging.WARNING, logger="flashwrite"):
            with CheckpointManager(tmp_path / "ck", local_snapshots=True, local_dir=small) as m:
                for step in (1, 2):
                    m.save(step, make_state(step))
                    m.wait()
        assert caplog.text.count("too small for the staging pool") == 1
        assert "no room" in caplog.text or "No space" in caplog.text
        assert_same(fw.load(tmp_path / "ck" / "step-00000002"), make_state(2))
        assert local.scan(small) == []


# ------------------------------------------------------------ kill -9


def _spawn(root, local_dir, mode, n):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "local_child.py"), str(root), str(local_dir), mode,
                             str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_line(p, word, timeout=120):
    """Read the child's lines until ``word``. readline() blocks, so a timer kills a
    child that hangs: the test then fails with its stderr instead of stalling the suite."""
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        while True:
            line = p.stdout.readline()
            if not line:
                hung = " (killed: no line for %d s)" % timeout if not timer.is_alive() else ""
                raise AssertionError(f"child ended before {word}{hung}: {p.stderr.read()}")
            if line.strip() == word:
                return
    finally:
        timer.cancel()


TRIALS = int(os.environ.get("FW_KILL_TRIALS", "20"))


@pytest.mark.slow
def test_kill_after_staged_restores_that_step(tmp_path):
    rng = random.Random(15)
    before_commit = 0
    for trial in range(TRIALS):
        root, shm = tmp_path / f"ck{trial}", f"/dev/shm/fwtest-kill-{os.getpid()}-{trial}"
        try:
            p = _spawn(root, shm, "staged", 1 << 16)
            _wait_line(p, "STAGED")
            time.sleep(rng.uniform(0, 0.9))  # the commit is held back 1 s
            p.send_signal(signal.SIGKILL)
            p.communicate()
            committed = os.path.isdir(root / "step-00000002")
            before_commit += not committed
            m = CheckpointManager(root, local_snapshots=True, local_dir=shm)
            step, state = m.restore()
            assert step == 2, f"trial {trial}"
            assert_same(state, make_state(2, 1 << 16))
            m.wait()
            assert_same(fw.load(root / "step-00000002"), make_state(2, 1 << 16))
            m.close()
        finally:
            import shutil
            shutil.rmtree(shm, ignore_errors=True)
    assert before_commit >= 20 or before_commit == TRIALS
    print(f"kill after staged: {TRIALS} trials, {before_commit} before the commit")


@pytest.mark.slow
def test_kill_while_staging_never_returns_the_half_staged_step(tmp_path):
    rng = random.Random(16)
    killed_staging = 0
    for trial in range(max(5, TRIALS // 2)):
        root, shm = tmp_path / f"ck{trial}", f"/dev/shm/fwtest-stg-{os.getpid()}-{trial}"
        try:
            p = _spawn(root, shm, "staging", 1 << 22)
            _wait_line(p, "STAGING")
            time.sleep(rng.uniform(0, 0.08))  # staging step 2 takes 0.13-0.29 s here
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate()
            staged = "STAGED" in out
            m = CheckpointManager(root, local_snapshots=True, local_dir=shm)
            step, state = m.restore()
            if step == 2:
                # Sealed before the kill: the kill can land after save() returned and before
                # the child printed so. Then it must be the whole of step 2, byte for byte.
                assert_same(state, staging_state(2, 1 << 22))
            else:
                assert staged is False and step == 1, f"trial {trial}: staged step 2 was not returned"
                assert_same(state, make_state(1, 1 << 22))
                killed_staging += 1
            m.wait()
            m.close()
        finally:
            import shutil
            shutil.rmtree(shm, ignore_errors=True)
    assert killed_staging >= 1
    print(f"kill while staging: {killed_staging} kills before staged")


# ------------------------------------------------------------- many ranks


def _ranks(world, tmp, root, shm, mode, *extra):
    init = tmp / f"init-{mode}-{time.monotonic_ns()}"
    return [subprocess.Popen([sys.executable, os.path.join(HERE, "local_dist_child.py"), str(r), str(world), str(init),
                              str(root), shm, mode, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode,agreed", [("one_dies", 1), ("all_staged", 2)])
def test_ranks_agree_on_one_step_after_kill(tmp_path, mode, agreed, world):
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-ranks-{os.getpid()}-{mode}"
    try:
        procs = _ranks(world, tmp_path, root, shm, mode)
        live = procs[:-1] if mode == "one_dies" else procs
        for p in live:
            _wait_line(p, "STAGED")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
        assert not os.path.isdir(root / "step-00000002")
        procs = _ranks(world, tmp_path, root, shm, "restore")
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            assert f"RESTORED {agreed}" in out
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)


def _stage_with_copies_then_kill(world, tmp_path, root, shm, step2) -> dict:
    """Every rank stages step 2 with neighbour copies (its commit held back); once each
    holder has its copy (or after 60 s), all ranks are killed. Returns {holder: [ranks
    whose copy of step 2 it holds]}."""
    procs = _ranks(world, tmp_path, root, shm, "all_staged", "neighbours")
    for p in procs:
        _wait_line(p, "STAGED")
    deadline = time.monotonic() + 60
    while True:  # the copies go out while the stripes are written (the commit is held back)
        held = {r: [s.body["rank"] for s in local.scan(f"{shm}/r{r}") if s.body.get("replica") and s.path == step2]
                for r in range(world)}
        if all(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    return held


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_lost_nodes_rank_restores_from_its_neighbours_memory(tmp_path, world):
    # Every rank stages step 2 (never committed), then all die and rank 1's node is lost
    # with its memory: step 2 survives only in the copy rank 2 (mod world) keeps of it.
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-nb-{os.getpid()}-{world}"
    step2 = str(root / "step-00000002")
    try:
        held = _stage_with_copies_then_kill(world, tmp_path, root, shm, step2)
        assert held == {r: [(r - 1) % world] for r in range(world)}
        for r in range(world):  # one copy per holder, refilled in place: step 1's became step 2's
            assert len([f for f in os.listdir(f"{shm}/r{r}") if "-replica" in f]) == 2  # its pool and header
        assert not os.path.isdir(step2)
        shutil.rmtree(f"{shm}/r1")  # the lost node
        procs = _ranks(world, tmp_path, root, shm, "restore", "neighbours")
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            assert "RESTORED 2" in out  # checked against what each rank saved, then committed and reloaded
        # Nothing is left: the dead processes' snapshots and copies went once step 2 was
        # committed, the fetched copy once the write-back had a snapshot of its own, and the
        # restarted ranks' own files at close().
        assert {r: os.listdir(f"{shm}/r{r}") for r in range(world)} == {r: [] for r in range(world)}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_neighbours_copy_that_fails_its_checksums_is_refused(tmp_path):
    """As above, but a byte of the copy rank 0 keeps of rank 1's step 2 flips after the
    node is lost. Rank 1 must refuse that copy (naming the tensor), and as step 2 is in no
    other tier, every rank falls back to step 1 from storage: never wrong bytes."""
    world = 2
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-nbflip-{os.getpid()}"
    step2 = str(root / "step-00000002")
    try:
        _stage_with_copies_then_kill(world, tmp_path, root, shm, step2)
        copies = [s for s in local.scan(f"{shm}/r0") if s.body.get("replica") and s.path == step2]
        assert len(copies) == 1 and copies[0].body["rank"] == 1
        shutil.rmtree(f"{shm}/r1")  # the lost node
        for _f, _off, n, at in copies[0].body["chunks"]:  # tensor bytes, not only a stripe's header
            flip_byte(copies[0].pool, at + n // 2)
        procs = _ranks(world, tmp_path, root, shm, "restore", "neighbours")
        outs = [p.communicate(timeout=240) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            assert "RESTORED 1" in out, out + err[-3000:]
        err1 = outs[1][1]
        assert "step 2" in err1 and "cannot be restored" in err1 and "checksum" in err1, err1[-3000:]
        assert not os.path.isdir(step2)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_restore_into_fills_existing_tensors_from_memory(tmp_path, shmdir):
    root = tmp_path / "ck"
    with CheckpointManager(root, local_snapshots=True, local_dir=shmdir, keep_local=True) as m:
        m.save(3, make_state(3))
    dest = make_state(0)
    w = dest["model"]["w"]
    m2 = CheckpointManager(root, local_snapshots=True, local_dir=shmdir)
    step, got = m2.restore(into=dest)
    assert step == 3 and got is dest and dest["model"]["w"] is w
    assert_same(dest, make_state(3))
    m2.close()


# ------------------------------------------------- restored tensors, zero copy


def _owns_its_bytes(t):
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _mapping_of(t):
    """(permissions, file) of the mapping under t's data, per /proc/self/maps, or None."""
    a = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= a < hi:
                parts = line.split(maxsplit=5)
                return parts[1], parts[5].strip() if len(parts) > 5 else None
    return None


def _mapped_from(t):
    """The file the page under t's data is mapped from, or None."""
    return (_mapping_of(t) or (None, None))[1]


def test_restored_tensors_own_memory_and_survive_later_saves(tmp_path, shmdir):
    # Restored from this process's own pool, which the next saves overwrite.
    root = tmp_path / "ck"
    with CheckpointManager(root, local_snapshots=True, local_dir=shmdir) as m:
        m.save(3, make_state(3, 1 << 19))
        step, got = m.restore()
        assert step == 3
        _, adopted = m.restore(zero_copy=True)  # a live writer's pool: copied, not adopted
        for k, t in {"w": got["model"]["w"], "h": got["model"]["h"], "zw": adopted["model"]["w"]}.items():
            assert _owns_its_bytes(t), k
            assert ".pool" not in (_mapped_from(t) or ""), k
        for s in (4, 5):
            m.save(s, make_state(s, 1 << 19)).result()
        assert_same(got, make_state(3, 1 << 19))
        assert_same(adopted, make_state(3, 1 << 19))


def test_zero_copy_restore_adopts_a_dead_writers_pool_copy_on_write(tmp_path):
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-adopt-{os.getpid()}"
    n = 1 << 19  # "w" is 2 MiB: adopted; the smaller tensors are copied
    try:
        p = _spawn(root, shm, "staged", n)
        _wait_line(p, "STAGED")
        p.send_signal(signal.SIGKILL)
        p.communicate()
        m = CheckpointManager(root, local_snapshots=True, local_dir=shm)
        snap = m.find_local_snapshots()[2][0]
        keep = os.open(snap.pool, os.O_RDONLY)  # the write-back may remove the file at any moment
        step, state = m.restore(zero_copy=True)
        assert step == 2
        assert_same(state, make_state(2, n))
        w = state["model"]["w"]
        assert _owns_its_bytes(w) and _owns_its_bytes(state["model"]["h"])
        assert snap.pool in (_mapped_from(w) or "")  # the snapshot's own pages
        assert snap.pool not in (_mapped_from(state["model"]["h"]) or "")
        w.add_(1)  # copy-on-write: the snapshot keeps its bytes
        import dataclasses
        local.read_snapshot(dataclasses.replace(snap, pool=f"/proc/self/fd/{keep}"))
        os.close(keep)
        m.wait()  # written back from memory; then the snapshot is removed, its pages stay with w
        assert not os.path.exists(snap.header)
        assert_same(fw.load(root / "step-00000002"), make_state(2, n))
        m.save(3, make_state(3, n)).result()
        assert torch.equal(w, make_state(2, n)["model"]["w"] + 1)
        m.close()
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)



def _copied(t):
    """Whether t's bytes lie in memory of this process's own (anonymous or heap), not a pool file."""
    return ".pool" not in (_mapping_of(t)[1] or "")


def _crashed_after_commit(root, shm, n):
    """A training process that committed steps 1 and 2 with local snapshots, then was killed."""
    p = _spawn(root, shm, "committed", n)
    _wait_line(p, "COMMITTED")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    snaps = local.scan(shm)
    assert [(s.path, s.state) for s in snaps] == [(str(root / "step-00000002"), "committed")]
    return snaps[0]


def _locked(fd, how):
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def test_restart_takes_a_committed_snapshot_copying_nothing(tmp_path):
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-take-{os.getpid()}"
    n = 1 << 19  # "w" is 2 MiB: taken; the smaller tensors are copied
    try:
        snap = _crashed_after_commit(root, shm, n)
        keep = os.open(snap.pool, os.O_RDONLY)  # to look at the file once it is unlinked
        pool_bytes = os.fstat(keep).st_blocks * 512
        m = CheckpointManager(root, local_snapshots=True, local_dir=shm)
        step, copied = m.restore(zero_copy=False)  # fresh memory; the snapshot stays
        assert step == 2 and _copied(copied["model"]["w"]) and os.path.exists(snap.header)
        step, state = m.restore()
        assert step == 2
        assert_same(state, make_state(2, n))
        w = state["model"]["w"]
        assert _owns_its_bytes(w) and _owns_its_bytes(state["model"]["h"])
        # w is the snapshot's own pages, shared (no copy-on-write later); h was copied.
        perms, mapped = _mapping_of(w)
        assert mapped == f"{snap.pool} (deleted)" and perms.startswith("rw") and perms.endswith("s")
        assert _copied(state["model"]["h"])
        # Taken: gone from the local tier; only w's pages stay allocated.
        assert not os.path.exists(snap.header) and not os.path.exists(snap.pool) and m.find_local_snapshots() == {}
        held = os.fstat(keep).st_blocks * 512
        assert w.nbytes <= held <= w.nbytes + 2 * local.PAGE < pool_bytes, (held, pool_bytes)
        # The pool is this process's while w lives: nobody adopts or takes it.
        assert _locked(keep, fcntl.LOCK_SH)
        w.add_(1)
        assert torch.equal(w, make_state(2, n)["model"]["w"] + 1)
        step, again = m.restore()  # nothing local is left: from storage, which w's writes never touch
        assert step == 2
        assert_same(again, make_state(2, n))
        del state, w
        gc.collect()
        assert not _locked(keep, fcntl.LOCK_EX)  # the lock went with the tensors
        os.close(keep)
        m.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_snapshot_in_use_is_never_taken(tmp_path):
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-inuse-{os.getpid()}"
    n = 1 << 19
    want = make_state(2, n)["model"]["w"]
    try:
        snap = _crashed_after_commit(root, shm, n)
        # Another header pointing into the same pool: taking it would take that snapshot too.
        twin = snap.header.replace("-000002", "-000099")
        shutil.copyfile(snap.header, twin)
        _, t = local.read_snapshot(snap, take=True)
        assert os.path.exists(snap.pool) and _copied(t["model.w"])
        os.unlink(twin)
        # An adopter (copy-on-write) holds the pool: the take copies instead.
        _, adopted = local.read_snapshot(snap, adopt=True)
        assert _mapping_of(adopted["model.w"]) == ("rw-p", snap.pool)
        _, t = local.read_snapshot(snap, take=True)
        assert os.path.exists(snap.pool) and _copied(t["model.w"])
        t["model.w"].add_(1)
        assert torch.equal(adopted["model.w"], want)
        del adopted
        gc.collect()
        _, t = local.read_snapshot(snap, take=True)  # free now
        assert _mapping_of(t["model.w"]) == ("rw-s", f"{snap.pool} (deleted)")
        # The adopter that comes too late finds nothing; one that opened the file before
        # the take cannot lock it, so it copies what it reads and checks it.
        assert not os.path.exists(snap.pool) and local.scan(shm) == []
        assert torch.equal(t["model.w"], want)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_damaged_snapshot_is_not_taken_and_goes(tmp_path, caplog):
    root, shm = tmp_path / "ck", f"/dev/shm/fwtest-dmg-{os.getpid()}"
    n = 1 << 19
    try:
        snap = _crashed_after_commit(root, shm, n)
        e = snap.body["manifest"]["tensors"]["model.w"]
        chunk = next(c for c in snap.body["chunks"] if c[0] == e["file"] and c[1] <= e["offset"] < c[1] + c[2])
        flip_byte(snap.pool, chunk[3] + e["offset"] - chunk[1] + (1 << 20), 0x40)
        m = CheckpointManager(root, local_snapshots=True, local_dir=shm)
        with caplog.at_level(logging.INFO, logger="flashwrite"):
            step, state = m.restore()
        assert step == 2 and "cannot be restored" in caplog.text and "'model.w'" in caplog.text
        assert_same(state, make_state(2, n))  # from storage
        assert _copied(state["model"]["w"])
        assert not os.path.exists(snap.header) and not os.path.exists(snap.pool)
        m.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
