"""nfs:// against a real NFS server (nfs-ganesha on 127.0.0.1, tests/nfs_server.py).

One on-disk format: a checkpoint saved through nfs:// loads byte-exact from the
export's local path and the other way round. Faults are real: the server is killed
(SIGKILL) mid-save, restarted between WRITE and COMMIT, exported read-only or from a
full file system, or looked for at the wrong host, port or export.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

import flashwrite as fw
from conftest import assert_same
from fault_util import fill, flip_byte, loop_ext4, make_state, temp_entries
from flashwrite import _core
from flashwrite.targets import nfs
from nfs_fixtures import serving
from nfs_server import Export

pytestmark = [pytest.mark.nfs, pytest.mark.usefixtures("nfs_staging")]
PAUSE_ENV = "FLASHWRITE_NFS_TEST_PAUSE_BEFORE_COMMIT_MS"




def _big_state(mib: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4
    return {"a": torch.randn(n // 2, generator=g), "b": torch.randint(0, 1 << 30, (n // 2,), generator=g)}


def test_round_trip_both_ways(nfs_server):
    state = make_state(3)
    url = nfs_server.url("run/ck") + "?connections=3&depth=8"
    st = fw.save(state, url, stripes=3)
    assert st.path.startswith("nfs://127.0.0.1") and st.path.endswith("/run/ck"), st.path
    local = os.path.join(nfs_server.export, "run", "ck")
    assert_same(fw.load(local), state)  # written through NFS, read from the export's disk
    fw.verify(local)
    assert temp_entries(os.path.dirname(local)) == []

    other = make_state(4)
    fw.save(other, os.path.join(nfs_server.export, "disk"), stripes=2)  # written to disk, read through NFS
    assert_same(fw.load(nfs_server.url("disk")), other)
    assert fw.verify(nfs_server.url("disk"))["tensors"] == fw.verify(os.path.join(nfs_server.export, "disk"))["tensors"]
    assert_same(fw.load_async(url).result(), state)

    with pytest.raises(fw.CheckpointExistsError, match="nfs://"):
        fw.save(other, url)
    fw.save(other, url, overwrite=True)
    assert_same(fw.load(local), other)
    assert sorted(os.listdir(os.path.dirname(local))) == ["ck"]


def test_damaged_stripe_is_caught_through_nfs(nfs_server):
    fw.save(make_state(1), nfs_server.url("ck"), stripes=2)
    stripe = sorted(f for f in os.listdir(os.path.join(nfs_server.export, "ck")) if f.endswith(".safetensors"))[0]
    path = os.path.join(nfs_server.export, "ck", stripe)
    flip_byte(path, os.path.getsize(path) - 100, 0xFF)
    with pytest.raises(fw.CorruptCheckpointError):
        fw.verify(nfs_server.url("ck"))


@pytest.mark.parametrize("inner_first", [False, True], ids=["outer-listed-first", "inner-listed-first"])
def test_export_is_the_longest_listed_prefix(tmp_path, inner_first):
    """Both orders the server may list them in (ganesha lists its exports in the
    reverse of its config, checked here): the inner export is found either way."""
    outer = tmp_path / "outer"
    inner = outer / "inner"
    inner.mkdir(parents=True)
    exports = [Export(str(outer)), Export(str(inner))]
    with serving(str(tmp_path / "nfs"), exports if inner_first else exports[::-1]) as server:
        listed = [os.path.normpath(e) for e in _core.nfs_exports("127.0.0.1", 5000)]
        listed = [e for e in listed if e in (str(outer), str(inner))]
        assert listed == ([str(inner), str(outer)] if inner_first else [str(outer), str(inner)])
        t, rel = nfs.target_for(server.url("a/ck", export=str(inner)), "save")
        assert (t.export, rel) == (str(inner), "/a/ck")
        t, rel = nfs.target_for(server.url("x/ck", export=str(outer)), "save")
        assert (t.export, rel) == (str(outer), "/x/ck")
        with pytest.raises(FileNotFoundError, match="no export"):
            nfs.target_for(f"nfs://127.0.0.1{tmp_path}/elsewhere/ck", "save")


def test_url_parameters_are_checked():
    for bad in ["nfs://h/e/ck?conections=4", "nfs://h/e/ck?connections=0", "nfs://h/e/ck?timeout=x", "nfs:///e/ck",
                "nfs://h/"]:
        with pytest.raises(fw.UnsupportedTargetError):
            nfs.parse_url(bad)
    u = nfs.parse_url("nfs://h:2049/e/ck?connections=8&depth=4&timeout=2.5&mountport=635")
    assert (u.server, u.path, u.nfs_port, u.mount_port, u.connections, u.depth, u.timeout_s) == \
        ("h", "/e/ck", 2049, 635, 8, 4, 2.5)


def test_wrong_host_port_or_export_fail_fast_and_clearly(nfs_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = make_state(1)
    cases = [
        (f"nfs://127.0.0.2{nfs_server.export}/ck?timeout=3", "127.0.0.2"),  # nothing listens there
        (nfs_server.url("ck") + f"?nfsport=9&mountport={nfs_server.mount_port}&timeout=3", "127.0.0.1"),
        (f"nfs://127.0.0.1{nfs_server.export}-missing/ck?timeout=3", "no export"),
    ]
    for url, named in cases:
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            fw.save(state, url)
        assert time.monotonic() - t0 < 10, f"{url}: took {time.monotonic() - t0:.1f} s"
        assert named in str(ei.value), str(ei.value)
    assert os.listdir(nfs_server.export) == []


def test_read_only_export_fails_at_call_time(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    with serving(str(tmp_path / "nfs"), [Export(str(ro), read_only=True)]) as server:
        fut = None
        with pytest.raises(OSError) as ei:
            fut = fw.save_async(make_state(1), server.url("ck", export=str(ro)))
        assert fut is None
        assert ei.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM), ei.value
        assert "nfs://127.0.0.1" in str(ei.value)
        assert os.listdir(ro) == []


def test_server_killed_mid_save_fails_in_bounded_time_then_recovers(nfs_server):
    state = _big_state(160)
    url = nfs_server.url("ck") + "?timeout=2"
    export = nfs_server.export

    def kill_once_stripes_arrive():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for e in os.listdir(export):
                d = os.path.join(export, e)
                if ".flashwrite-tmp-" in e and any(os.path.getsize(os.path.join(d, f)) > (8 << 20)
                                                    for f in os.listdir(d)):
                    nfs_server.kill()
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_stripes_arrive)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(OSError) as ei:
        fw.save(state, url, stripes=2)
    took = time.monotonic() - t0
    killer.join()
    assert nfs_server.pid is None, "the save ended before the server was killed"
    msg = str(ei.value)
    assert "127.0.0.1" in msg and "NFS" in msg, msg
    assert took < 2 * 2 + 10, f"took {took:.1f} s"
    assert not os.path.exists(os.path.join(export, "ck"))

    nfs_server.restart()
    # The next save commits (a 2 s bound is tight for 64 MiB in flight on 2 shared cores).
    fw.save(state, nfs_server.url("ck") + "?timeout=20", stripes=2)
    assert_same(fw.load(os.path.join(export, "ck")), state)


def test_restart_between_write_and_commit_rewrites(nfs_server, monkeypatch):
    """Ten trials at the client: the server restarts while every WRITE is done and the
    COMMIT not yet sent. The bytes on disk are always right; the verifier check had to
    rewrite in at least one trial (ganesha's verifier changes with each start)."""
    client = _core.NfsClient("127.0.0.1", nfs_server.export, connections=2, timeout_ms=5000)
    monkeypatch.setenv(PAUSE_ENV, "500")
    rewrites = 0
    for i in range(10):
        data = os.urandom(4 << 20)
        restart = threading.Timer(0.15, nfs_server.restart)
        restart.start()
        r = client.write_file(f"/f{i}", data, True)
        restart.join()
        rewrites += r["rewrites"]
        with open(os.path.join(nfs_server.export, f"f{i}"), "rb") as fh:
            assert fh.read() == data, f"trial {i}: wrong bytes committed ({r})"
    assert rewrites > 0, "no trial saw the verifier change"


def test_restart_between_write_and_commit_never_commits_wrong_bytes(nfs_server, monkeypatch):
    monkeypatch.setenv(PAUSE_ENV, "400")
    for i in range(2):
        state = make_state(10 + i)
        restart = threading.Timer(0.2, nfs_server.restart)
        restart.start()
        try:
            fw.save(state, nfs_server.url(f"ck{i}") + "?timeout=5", stripes=1)
        except OSError as e:  # allowed: a named failure, nothing committed
            assert "NFS" in str(e)
            assert not os.path.exists(os.path.join(nfs_server.export, f"ck{i}"))
            continue
        finally:
            restart.join()
        local = os.path.join(nfs_server.export, f"ck{i}")
        fw.verify(local)
        assert_same(fw.load(local), state)


def test_save_sends_its_writes_from_the_slots_and_through_libnfs_alike(nfs_server, monkeypatch):
    """A save's WRITEs go out on flashwrite's own connections straight from the staging
    slots (csrc/io/nfs_wire.cpp): every payload byte is counted as sent uncopied.
    FLASHWRITE_NFS_WIRE=0 sends them through libnfs (which copies them; none counted);
    both commit the same, verified bytes. A pool smaller than the save recycles slots."""
    state = _big_state(24, seed=5)
    opts = dict(stripes=2, chunk_bytes=4 << 20, max_staging_bytes=8 << 20)
    stats = fw.save(state, nfs_server.url("wire") + "?connections=3&depth=4", **opts)
    assert stats.extra["nfs_bytes_sent_uncopied"] >= sum(t.nbytes for t in state.values()), stats.extra
    monkeypatch.setenv("FLASHWRITE_NFS_WIRE", "0")
    stats = fw.save(state, nfs_server.url("libnfs") + "?connections=3&depth=4", **opts)
    assert stats.extra["nfs_bytes_sent_uncopied"] == 0, stats.extra
    for name in ("wire", "libnfs"):
        local = os.path.join(nfs_server.export, name)
        fw.verify(local)
        assert_same(fw.load(local), state)


def _read(url: str, zero_copy: bool = True):
    """The load's read of every tensor of the checkpoint at url (its LoadResult)."""
    from flashwrite.loading.read import CheckpointDir
    from flashwrite.targets.locate import locate
    with CheckpointDir(locate(url, "load")) as ck:
        return ck.read(zero_copy=zero_copy)


def test_load_receives_its_reads_into_the_tensors_and_through_libnfs_alike(nfs_server, monkeypatch):
    """A load's READ replies come in on flashwrite's own connections straight into the
    slots and tensors (csrc/io/nfs_wire.cpp): every payload byte is counted as received
    uncopied. FLASHWRITE_NFS_WIRE=0 reads through libnfs (which copies; none counted).
    Both return the same, verified bytes; a flipped byte is named either way."""
    state = _big_state(24, seed=6)
    state["small"] = torch.arange(1000, dtype=torch.int16)  # shares a bounce slot with a stripe's header
    fw.save(state, nfs_server.url("ck"), stripes=2, chunk_bytes=4 << 20)
    url = nfs_server.url("ck") + "?connections=3&depth=4"
    total = sum(t.nbytes for t in state.values())
    for zero_copy in (False, True):
        res = _read(url, zero_copy=zero_copy)
        assert res.received_uncopied >= total, (zero_copy, res.received_uncopied, total)
        assert_same(fw.load(url), state)
    monkeypatch.setenv("FLASHWRITE_NFS_WIRE", "0")
    res = _read(url)
    assert res.received_uncopied == 0
    assert_same(fw.load(url), state)
    monkeypatch.delenv("FLASHWRITE_NFS_WIRE")
    local = os.path.join(nfs_server.export, "ck")
    stripe = sorted(n for n in os.listdir(local) if n.endswith(".safetensors"))[1]
    flip_byte(os.path.join(local, stripe), os.path.getsize(os.path.join(local, stripe)) - 5)
    with pytest.raises(fw.ChecksumMismatchError, match=stripe):
        fw.load(url)


def test_load_takes_replies_in_fragments_pieces_and_twice(nfs_server):
    """Through a proxy that cuts each reply to the wire connections into record fragments
    (a boundary inside the READ header and inside the payload), sends the first ones a
    few bytes at a time, and sends every reply twice (tests/rpc_refragment.py): the load
    returns the same bytes, all received straight into their destinations, and a save
    through it commits the same."""
    from rpc_refragment import Refragmenter
    state = _big_state(12, seed=7)
    fw.save(state, nfs_server.url("ck"), stripes=2, chunk_bytes=2 << 20)
    export = nfs_server.exports[0].path
    with Refragmenter("127.0.0.1", nfs_server.nfs_port) as proxy:
        url = f"nfs://127.0.0.1:{proxy.port}{export}/ck?mountport={nfs_server.mount_port}&connections=2&depth=3"
        res = _read(url, zero_copy=False)
        assert res.received_uncopied >= sum(t.nbytes for t in state.values())
        assert_same(fw.load(url), state)
        saved = url.replace("/ck?", "/again?")
        fw.save(state, saved, stripes=2, chunk_bytes=2 << 20)
        assert_same(fw.load(saved), state)
        assert proxy.wire_conns >= 2 and proxy.replies > 12, (proxy.wire_conns, proxy.replies)


SPOIL_ENV = "FLASHWRITE_NFS_TEST_SPOIL_COMMIT_VERIFIER"


def test_save_rewrites_the_chunks_a_changed_verifier_covers(nfs_server, monkeypatch):
    """The save job's path. A restart cannot show whether the verifier is compared: ganesha
    keeps unstable bytes in the page cache across it, so the bytes are right either way.
    The test hook makes the first two COMMIT replies come back under another verifier
    (as after a restart); the chunks they cover must be written again, and the save's
    stats count them. A staging pool of 4 slots for 8 chunks recycles its slots: a chunk
    reported before its rewrite would be rewritten from a reused slot (wrong bytes)."""
    state = _big_state(8, seed=3)
    opts = dict(stripes=1, chunk_bytes=1 << 20, max_staging_bytes=4 << 20)
    stats = fw.save(state, nfs_server.url("plain"), **opts)
    assert stats.extra["nfs_rewrites"] == 0
    monkeypatch.setenv(SPOIL_ENV, "2")
    stats = fw.save(state, nfs_server.url("ck"), **opts)
    assert stats.extra["nfs_rewrites"] >= 2, stats.extra
    local = os.path.join(nfs_server.export, "ck")
    fw.verify(local)
    assert_same(fw.load(local), state)


def test_save_rewrites_a_chunk_written_under_mixed_verifiers(nfs_server, monkeypatch):
    """A chunk whose WRITEs came back under different verifiers (a restart between two of
    them) is written again even though its last WRITE's verifier matches the COMMIT's.
    One RPC in flight, so the spoiled first piece of a 4-piece chunk replies before the
    rest (test hook: FLASHWRITE_NFS_TEST_SPOIL_WRITE_VERIFIER)."""
    monkeypatch.setenv("FLASHWRITE_NFS_TEST_SPOIL_WRITE_VERIFIER", "1")
    state = _big_state(8, seed=4)
    stats = fw.save(state, nfs_server.url("ck") + "?connections=1&depth=1", stripes=1, chunk_bytes=4 << 20)
    assert stats.extra["nfs_rewrites"] == 1, stats.extra
    assert_same(fw.load(os.path.join(nfs_server.export, "ck")), state)


def test_save_fails_when_the_verifier_never_settles(nfs_server, monkeypatch):
    """Every COMMIT under another verifier than its WRITEs: the save gives up after its
    rounds of rewrites with a named error, and commits nothing."""
    monkeypatch.setenv(SPOIL_ENV, "1000000")
    with pytest.raises(OSError, match="verifier kept changing") as ei:
        fw.save(make_state(4), nfs_server.url("ck") + "?timeout=20", stripes=1)
    assert ei.value.errno == errno.EIO and "127.0.0.1" in str(ei.value)
    assert not os.path.exists(os.path.join(nfs_server.export, "ck"))
    assert temp_entries(nfs_server.export) == []


def test_load_while_the_server_restarts(nfs_server):
    state = _big_state(64, seed=2)
    fw.save(state, os.path.join(nfs_server.export, "ck"), stripes=2)
    restart = threading.Timer(0.05, nfs_server.restart)
    restart.start()
    try:
        out = fw.load(nfs_server.url("ck") + "?timeout=5")
    except OSError as e:
        assert "127.0.0.1" in str(e) and "NFS" in str(e)
    else:
        assert_same(out, state)
    finally:
        restart.join()


@pytest.mark.root
def test_full_export_names_enospc_and_leaves_nothing(tmp_path):
    with loop_ext4(str(tmp_path / "small"), 64) as mnt:
        fill(mnt, 12 << 20)
        exported = os.path.join(mnt, "export")
        os.mkdir(exported)
        with serving(str(tmp_path / "nfs"), [Export(exported)]) as server:
            with pytest.raises(OSError) as ei:
                fw.save(_big_state(32), server.url("ck") + "?timeout=5", stripes=2)
            assert ei.value.errno == errno.ENOSPC, ei.value
            assert "nfs://127.0.0.1" in str(ei.value)
            assert os.listdir(exported) == []


def test_without_libnfs_nfs_urls_say_what_to_install(tmp_path):
    """libnfs is loaded at run time: where it is missing, nfs:// raises saying what to
    install, and local saves work as before (a child process, as dlopen happens once)."""
    import subprocess
    import sys
    code = f"""
import torch, flashwrite as fw
try:
    fw.save({{"w": torch.ones(3)}}, "nfs://127.0.0.1/export/ck")
except fw.UnsupportedTargetError as e:
    print("REFUSED", e)
fw.save({{"w": torch.ones(3)}}, {str(tmp_path / "ck")!r})
print("LOCAL", fw.load({str(tmp_path / "ck")!r})["w"].tolist())
"""
    env = dict(os.environ, FLASHWRITE_LIBNFS=str(tmp_path / "libnfs-missing.so"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "apt-get install libnfs13" in r.stdout, r.stdout
    assert "LOCAL [1.0, 1.0, 1.0]" in r.stdout


# ----------------------------------------------------------------- multi-rank


def _rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"model": {"w": torch.randn(256, 1024 + rank, generator=g), "b": torch.randn(7, generator=g)},
            "step": step, "rank": rank}


def _ranks_save(url: str, steps: int, keep: int, staging: str) -> list:
    """Every rank: ``steps`` saves through the manager-free multi-rank protocol to
    url/step-N, keeping the newest ``keep`` (rank 0 removes the older ones)."""
    import torch.distributed as dist
    # The workers fork from a forkserver started by an earlier test, with its environment.
    os.environ["FLASHWRITE_NFS_STAGING"] = staging
    rank = dist.get_rank()
    for step in range(1, steps + 1):
        fw.save(_rank_state(rank, step), f"{url.split('?')[0]}/step-{step}?{url.split('?')[1]}",
                process_group=dist.group.WORLD, timeout=60, stripes=2)
    back = fw.load(f"{url.split('?')[0]}/step-{steps}?{url.split('?')[1]}", process_group=dist.group.WORLD)
    assert_same(back, _rank_state(rank, steps))
    return [rank]


def _one_rank_fails(url: str, bad: int) -> str:
    import torch.distributed as dist
    rank = dist.get_rank()
    state = _rank_state(rank, 9)
    if rank == bad:
        state["bad"] = object()  # not a tensor and allow_pickle=False: this rank fails at staging
    try:
        fw.save(state, url, process_group=dist.group.WORLD, timeout=60)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "committed"


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_save_to_one_nfs_root(nfs_server, world, nfs_staging):
    from dist_helpers import Cluster
    url = nfs_server.url("run") + "?connections=2&timeout=30"
    with Cluster(world) as cluster:
        assert cluster.run(_ranks_save, url, 2, 2, str(nfs_staging)) == [[r] for r in range(world)]
        whole = fw.load(os.path.join(nfs_server.export, "run", "step-2"))
        assert list(whole) == list(range(world))
        for r in range(world):
            assert_same(whole[r], _rank_state(r, 2))
        if world == 2:
            bad_url = nfs_server.url("run/bad") + "?timeout=30"
            out = cluster.run(_one_rank_fails, bad_url, 1)
            assert "committed" not in out, out
            assert not os.path.exists(os.path.join(nfs_server.export, "run", "bad"))
    assert temp_entries(os.path.join(nfs_server.export, "run")) == []


def test_manager_keeps_the_newest_checkpoints_on_an_nfs_root(nfs_server):
    url = nfs_server.url("run") + "?connections=2"
    run = os.path.join(nfs_server.export, "run")
    mgr = fw.CheckpointManager(url, every_n_steps=1, keep_last=2, writer=fw.Writer(stripes=2))
    try:
        assert mgr.path_for(3) == nfs_server.url("run/step-00000003") + "?connections=2"
        for step in range(1, 5):
            mgr.maybe_save(step, make_state(step)).result()
        assert mgr.maybe_save(4, make_state(4)) is None  # that step exists already
        mgr.wait()
        assert mgr.all_steps() == [3, 4]
        assert sorted(os.listdir(run)) == ["step-00000003", "step-00000004"]
        assert_same(fw.load(os.path.join(run, "step-00000004")), make_state(4))
    finally:
        mgr.close()
    again = fw.CheckpointManager(url, keep_last=2)
    try:
        assert again.latest_step() == 4
        step, state = again.restore()
        assert step == 4
        assert_same(state, make_state(4))
    finally:
        again.close()
