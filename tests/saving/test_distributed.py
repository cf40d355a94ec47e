"""Multi-rank saves and loads with real processes (gloo on localhost).

Worker-side functions (leading underscore) run on every rank of a spawned
cluster; the tests check what they return and what is on disk, byte-exact.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import time

import pytest
import torch
import torch.distributed as dist

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.saving.distributed import DistributedSaveError
from flashwrite.format import FORMAT_VERSION
from flashwrite.format import decode_manifest_json

from conftest import assert_same
from dist_helpers import Cluster

WORLD_OPTS = dict(stripes=2, chunk_bytes=1 << 20)


def rank_state(rank: int, step: int) -> dict:
    """A training-like state, different per rank and step, rebuilt identically anywhere."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    w = torch.randn(64, 1024 + rank, generator=g)
    sd = {
        "model": {"w": w, "b": torch.randn(33, generator=g).to(torch.bfloat16),
                  "idx": torch.arange(100 * (rank + 1), dtype=torch.int64) * step},
        "optim": {"state": {0: {"exp_avg": torch.randn(4096, generator=g), "step": torch.tensor(float(step))}},
                  "param_groups": [{"lr": 0.1 * (rank + 1), "betas": (0.9, 0.99)}]},
        "step": step,
        "name": f"rank{rank}",
        "empty": torch.empty(0, 3),
        "tied": w,
    }
    if rank % 2:
        sd["extra"] = torch.full((5,), 1 + 2j * rank, dtype=torch.complex64)  # only odd ranks; no safetensors code
    return sd


def temp_entries(root) -> list[str]:
    return sorted(e for e in os.listdir(root) if commit.is_temp_name(e))


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def cluster4():
    with Cluster(4) as c:
        yield c


# ----------------------------------------------------------------- round trips


def _save_load_roundtrip(root: str, step: int) -> dict:
    rank = dist.get_rank()
    sd = rank_state(rank, step)
    path = os.path.join(root, f"step-{step}")
    fut = fw.save_async(sd, path, process_group=dist.group.WORLD, timeout=30, **WORLD_OPTS)
    with torch.no_grad():
        sd["model"]["w"].add_(1)  # after save_async returns the snapshot is taken
        sd["optim"]["state"][0]["exp_avg"].zero_()
    st = fut.result(60)
    assert fut.done() and st.total_s and st.stall_s is not None

    # Two saves in flight at once: their coordination must not interleave.
    f2 = fw.save_async(rank_state(rank, step + 1), path + "-a", process_group=dist.group.WORLD, timeout=30,
                       **WORLD_OPTS)
    f3 = fw.save_async(rank_state(rank, step + 2), path + "-b", process_group=dist.group.WORLD, timeout=30,
                       **WORLD_OPTS)
    f2.result(60), f3.result(60)

    back = fw.load(path, process_group=dist.group.WORLD)
    assert_same(back, rank_state(rank, step))
    assert back["tied"] is back["model"]["w"]
    assert_same(fw.load(path + "-b", process_group=dist.group.WORLD), rank_state(rank, step + 2))
    into = rank_state(rank, 777)
    into["step"] = -1
    assert fw.load(path, process_group=dist.group.WORLD, into=into) is into
    assert_same(into, rank_state(rank, step))
    return {"bytes": st.bytes, "global_bytes": st.extra["global_bytes"], "rank": st.extra["rank"],
            "world_size": st.extra["world_size"], "backend": st.backend}


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_save_and_load_round_trip(n, request, tmp_path):
    cluster = request.getfixturevalue(f"cluster{n}")
    res = cluster.run(_save_load_roundtrip, str(tmp_path), 1)
    assert [r["rank"] for r in res] == list(range(n)) and {r["world_size"] for r in res} == {n}
    assert {r["global_bytes"] for r in res} == {sum(r["bytes"] for r in res)}

    path = tmp_path / "step-1"
    whole = fw.load(path)  # one process reads every rank's state
    assert list(whole) == list(range(n))
    for r in range(n):
        assert_same(whole[r], rank_state(r, 1))
    assert fw.verify(path)["files"] == len(os.listdir(path)) - 2

    manifest = decode_manifest_json((path / "flashwrite.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["ranks"]["world_size"] == n
    for r, (first, count) in enumerate(manifest["ranks"]["files"]):
        names = [f["name"] for f in manifest["files"][first:first + count]]
        assert names and all(x.startswith(f"model-rank{r:05d}-") for x in names)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["1.model.w"].startswith("model-rank00001-")

    # Every stripe is a plain safetensors file, readable without flashwrite.
    st = pytest.importorskip("safetensors.torch")
    seen = {}
    for f in manifest["files"]:
        seen.update(st.load_file(str(path / f["name"])))
    for r in range(n):
        ref = rank_state(r, 1)
        assert torch.equal(seen[f"{r}.model.w"], ref["model"]["w"])
        assert torch.equal(seen[f"{r}.optim.state.0.exp_avg"], ref["optim"]["state"][0]["exp_avg"])
    assert temp_entries(tmp_path) == []


def _load_whole_everywhere(path: str) -> None:
    rank = dist.get_rank()
    assert_same(fw.load(path, process_group=dist.group.WORLD), rank_state(9, 9))
    with pytest.raises(ValueError, match="saved by 2 ranks and this group has 4"):
        fw.load(path + "-2ranks", process_group=dist.group.WORLD)
    return rank


def test_load_checks_world_size_and_single_process_checkpoints_load_whole(cluster2, cluster4, tmp_path):
    fw.save(rank_state(9, 9), tmp_path / "single")
    cluster2.run(_save_load_roundtrip, str(tmp_path), 5)
    os.rename(tmp_path / "step-5", tmp_path / "single-2ranks")
    assert cluster4.run(_load_whole_everywhere, str(tmp_path / "single")) == [0, 1, 2, 3]


def _existing_target(root: str) -> str:
    rank = dist.get_rank()
    path = os.path.join(root, "exists")
    with pytest.raises(fw.CheckpointExistsError):
        fw.save_async(rank_state(rank, 1), path, process_group=dist.group.WORLD, timeout=30)
    fw.save(rank_state(rank, 2), path, process_group=dist.group.WORLD, timeout=30, overwrite=True)
    assert_same(fw.load(path, process_group=dist.group.WORLD), rank_state(rank, 2))
    return "ok"


def test_existing_target_raises_on_every_rank_then_overwrite(cluster2, tmp_path):
    os.mkdir(tmp_path / "exists")
    assert cluster2.run(_existing_target, str(tmp_path)) == ["ok", "ok"]
    assert_same(fw.load(tmp_path / "exists"), {0: rank_state(0, 2), 1: rank_state(1, 2)})
    assert temp_entries(tmp_path) == []


# ----------------------------------------------------------------- failures


def _one_rank_fails_to_write(root: str, bad: int) -> dict:
    """Rank ``bad`` hits a real EFBIG from the kernel (RLIMIT_FSIZE) when its
    stripes are created; the others must fail promptly and commit nothing."""
    rank = dist.get_rank()
    fw.save(rank_state(rank, 1), os.path.join(root, "good"), process_group=dist.group.WORLD, timeout=30)
    path = os.path.join(root, "bad")
    out: dict = {}
    if rank == bad:
        old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, old_limit[1]))
        try:
            fw.save_async(rank_state(rank, 2), path, process_group=dist.group.WORLD, timeout=30)
        except OSError as e:
            out["errno"] = e.errno
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
    else:
        fut = fw.save_async(rank_state(rank, 2), path, process_group=dist.group.WORLD, timeout=30)
        t0 = time.monotonic()
        with pytest.raises(DistributedSaveError) as ei:
            fut.result(60)
        out.update(elapsed=time.monotonic() - t0, message=str(ei.value), failures=ei.value.failures)
    # The group is still healthy: the next save works everywhere.
    fw.save(rank_state(rank, 3), os.path.join(root, "after"), process_group=dist.group.WORLD, timeout=30)
    return out


def _neighbour_copies_with_a_failure(root: str, shm: str, bad: int) -> dict:
    from flashwrite.tier import snapshot as local
    rank, pg = dist.get_rank(), dist.group.WORLD
    mine = os.path.join(shm, f"r{rank}")
    w = fw.Writer(local_snapshots=True, local_dir=mine, neighbour_copies=True, **WORLD_OPTS)
    out: dict = {}
    try:
        w.save(rank_state(rank, 1), os.path.join(root, "one"), process_group=pg, timeout=30)
        t0 = time.monotonic()
        if rank == bad:  # fails before anything is written: it still takes part in the copies' exchange
            with pytest.raises(TypeError):
                w.save({"x": object()}, os.path.join(root, "bad"), process_group=pg, timeout=30)
        else:
            with pytest.raises(DistributedSaveError):
                w.save_async(rank_state(rank, 2), os.path.join(root, "bad"), process_group=pg, timeout=30).result(60)
        out["elapsed"] = time.monotonic() - t0
        w.save(rank_state(rank, 3), os.path.join(root, "after"), process_group=pg, timeout=30)
        copies = [s for s in local.scan(mine) if s.body.get("replica")]
        out["copies"] = sorted((os.path.basename(s.path), s.body["rank"], s.state) for s in copies)
        newest = max(copies, key=lambda s: s.created)
        _, tensors = local.read_snapshot(newest)  # every byte checked against the sender's checksums
        prev = (rank - 1) % dist.get_world_size()
        out["same"] = all(torch.equal(tensors[f"{prev}.model.{k}"], rank_state(prev, 3)["model"][k])
                          for k in ("w", "b", "idx"))
    finally:
        w.close()
    out["left"] = sorted(os.listdir(mine))
    return out


def test_neighbour_copies_pair_up_when_a_rank_fails_before_writing(cluster2, tmp_path):
    shm = f"/dev/shm/fwtest-nbfail-{os.getpid()}"
    try:
        res = cluster2.run(_neighbour_copies_with_a_failure, str(tmp_path), shm, 1)
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
    # A holder keeps one copy, the newest: "bad" (which rank 0 staged and sent, while rank 1
    # had nothing to send) was replaced by "after".
    assert res[0]["copies"] == [("after", 1, "committed")] and res[1]["copies"] == [("after", 0, "committed")]
    for r in (0, 1):
        assert res[r]["elapsed"] < 10, res  # no wait for the timeout: the messages paired up
        assert res[r]["same"] and res[r]["left"] == []  # close() removed the copies too
    assert not (tmp_path / "bad").exists()
    assert_same(fw.load(tmp_path / "after"), {0: rank_state(0, 3), 1: rank_state(1, 3)})


def _one_rank_cancels_while_writing(root: str, bad: int) -> dict:
    rank = dist.get_rank()
    sd = {"big": torch.randn(4 << 20), **rank_state(rank, 4)}
    fut = fw.save_async(sd, os.path.join(root, "cancelled"), process_group=dist.group.WORLD, timeout=30,
                        block=False)
    if rank == bad:
        assert fut.cancel()
    t0 = time.monotonic()
    exc = fut.exception(60)
    return {"elapsed": time.monotonic() - t0, "type": type(exc).__name__, "message": str(exc)}


def _one_rank_votes_fail_when_durable(root: str, bad: int) -> dict:
    """Every rank writes its stripes durably; then rank ``bad`` votes to fail (its fsync
    reports EIO, injected after the real one). The committing rank must honour that vote:
    nothing is committed, every rank raises, promptly (not after the coordination timeout)."""
    from flashwrite.saving import write

    rank = dist.get_rank()
    real = write.StripeWrite.wait_durable

    def failing(self):
        real(self)
        raise OSError(errno.EIO, "injected: fsync of a stripe failed")

    if rank == bad:
        write.StripeWrite.wait_durable = failing
    t0 = time.monotonic()
    try:
        fut = fw.save_async(rank_state(rank, 5), os.path.join(root, "voted"), process_group=dist.group.WORLD,
                            timeout=30, **WORLD_OPTS)
        exc = fut.exception(90)
    finally:
        write.StripeWrite.wait_durable = real
    out = {"elapsed": time.monotonic() - t0, "type": type(exc).__name__, "message": str(exc),
           "committed_seen": os.path.exists(os.path.join(root, "voted"))}
    dist.barrier()
    fw.save(rank_state(rank, 6), os.path.join(root, "after-vote"), process_group=dist.group.WORLD, timeout=30)
    return out


@pytest.mark.parametrize("bad", [1, 0], ids=["other-rank-fails", "committing-rank-fails"])
def test_a_failure_vote_commits_nothing(cluster2, tmp_path, bad):
    res = cluster2.run(_one_rank_votes_fail_when_durable, str(tmp_path), bad)
    assert res[bad]["type"] == "OSError" and "injected" in res[bad]["message"], res
    good = 1 - bad
    assert res[good]["type"] == "DistributedSaveError" and f"rank {bad}" in res[good]["message"], res
    assert all(r["elapsed"] < 15 for r in res), res   # honoured at once, not found by the 30 s timeout
    assert not any(r["committed_seen"] for r in res), res
    assert not (tmp_path / "voted").exists()
    assert temp_entries(tmp_path) == []
    assert_same(fw.load(tmp_path / "after-vote"), {0: rank_state(0, 6), 1: rank_state(1, 6)})


def test_one_rank_raises(cluster2, tmp_path):
    res = cluster2.run(_one_rank_fails_to_write, str(tmp_path), 1)
    assert res[1] == {"errno": errno.EFBIG}
    assert res[0]["elapsed"] < 5
    assert "rank 1" in res[0]["message"] and "File too large" in res[0]["message"]
    assert list(res[0]["failures"]) == [1]
    assert not (tmp_path / "bad").exists()
    assert_same(fw.load(tmp_path / "good"), {0: rank_state(0, 1), 1: rank_state(1, 1)})
    assert_same(fw.load(tmp_path / "after"), {0: rank_state(0, 3), 1: rank_state(1, 3)})
    assert temp_entries(tmp_path) == []

    res = cluster2.run(_one_rank_cancels_while_writing, str(tmp_path), 0)
    assert res[0]["type"] != "NoneType" and res[1]["type"] == "DistributedSaveError"
    assert "rank 0" in res[1]["message"] and res[1]["elapsed"] < 5
    assert not (tmp_path / "cancelled").exists()
    assert temp_entries(tmp_path) == []


def _die_mid_save(root: str, victim: int, how: str, timeout: float) -> dict:
    rank = dist.get_rank()
    fw.save(rank_state(rank, 1), os.path.join(root, "step-1"), process_group=dist.group.WORLD, timeout=timeout)
    # The victim's 128 MiB take tens of ms to write: it stops while writing, long before any commit.
    sd = {"big": torch.randn((32 if rank == victim else 4) << 20), **rank_state(rank, 2)}
    fut = fw.save_async(sd, os.path.join(root, "step-2"), process_group=dist.group.WORLD, timeout=timeout)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    exc = fut.exception(timeout * 4)
    out = {"elapsed": time.monotonic() - t0, "type": type(exc).__name__, "message": str(exc)}
    t0 = time.monotonic()
    with pytest.raises(DistributedSaveError, match="unusable"):
        fw.save_async(rank_state(rank, 3), os.path.join(root, "step-3"), process_group=dist.group.WORLD,
                      timeout=timeout)
    out["next_save_s"] = time.monotonic() - t0
    return out


# The 4-rank kill (6 s on CI) in the slow job; the 2-rank stop in the README suite.
@pytest.mark.parametrize("n, how, timeout", [pytest.param(4, "kill", 5.0, marks=pytest.mark.slow), (2, "stop", 3.0)])
def test_rank_killed_or_hung_mid_save(n, how, timeout, tmp_path):
    """A SIGKILLed rank, or one that stops answering (SIGSTOP): the survivors'
    futures fail within the coordination timeout, nothing is committed, and the
    previous checkpoint is still the latest complete one."""
    victim = n - 1
    with Cluster(n) as cluster:
        res = cluster.run_raw(_die_mid_save, str(tmp_path), victim, how, timeout, timeout=60,
                              silent=(victim,) if how == "stop" else ())
        if how == "kill":
            assert res[victim] == ("dead", -signal.SIGKILL)
        else:
            assert res[victim][0] == "timeout"
        for r in range(n):
            if r == victim:
                continue
            tag, out = res[r]
            assert tag == "ok", out
            assert out["type"] == "DistributedSaveError", out
            assert "lost contact" in out["message"]
            assert out["elapsed"] < timeout + 2, out
            if how == "stop":
                assert out["elapsed"] > timeout - 1, out  # a silent peer is waited for, up to the timeout
            assert out["next_save_s"] < 1
        cluster.kill()
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # no step-2, no temp directory left behind
    assert_same(fw.load(tmp_path / "step-1"), {r: rank_state(r, 1) for r in range(n)})
