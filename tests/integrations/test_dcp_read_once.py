"""DCP loads through FlashwriteStorageReader read each stored stripe once (read_once=True,
the default) when several ranks' plans need it, with 4 real gloo ranks: a DDP-like state
(every rank holds the same tensors) saved through DCP (stored once by DCP's dedup) and
loaded by every rank; bytes read from storage per rank from /proc/self/io."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter, read_once

from dist_helpers import Cluster, replica_boards

N_TENSORS = 16
NUMEL = 256 * 1024  # 1 MiB of float32 each


def replicated_state(fill: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    model = {f"w{i}": torch.randn(NUMEL, generator=g) if fill else torch.zeros(NUMEL) for i in range(N_TENSORS)}
    return {"model": model, "bias": torch.arange(3000, dtype=torch.bfloat16) if fill else torch.zeros(3000,
            dtype=torch.bfloat16), "empty": torch.empty(0, 3), "step": 7 if fill else 0}


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != "flashwrite.json")


@pytest.fixture(scope="module")
def cluster4():
    with Cluster(4) as c:
        yield c


def _save(path: str) -> None:
    dcp.save(replicated_state(True), storage_writer=FlashwriteStorageWriter(path))


def _load(path: str, read_once: bool, shm: bool = True) -> dict:
    os.environ["FLASHWRITE_REPLICA_SHM"] = "1" if shm else "0"  # one host: shared memory, unless told not to
    sd = replicated_state(False)
    before = read_bytes()
    dcp.load(sd, storage_reader=FlashwriteStorageReader(path, read_once=read_once))
    n = read_bytes() - before
    want = replicated_state(True)
    same = (all(torch.equal(sd["model"][k], want["model"][k]) for k in want["model"])
            and torch.equal(sd["bias"], want["bias"]) and sd["step"] == 7 and sd["empty"].shape == (0, 3))
    return {"same": same, "read": n}


@pytest.mark.parametrize("shm", [True, False])
def test_each_stripe_is_read_once_and_sent_to_the_other_ranks(cluster4, tmp_path, shm):
    path = str(tmp_path / "ddp")
    cluster4.run(_save, path)
    total = stored_bytes(path)
    assert total >= N_TENSORS * NUMEL * 4  # stored once (DCP's dedup), not 4 times
    assert total < 1.05 * N_TENSORS * NUMEL * 4 + (1 << 20)
    once = cluster4.run(_load, path, True, shm)
    assert all(o["same"] for o in once), once
    reads = [o["read"] for o in once]
    assert sum(reads) <= 1.05 * total, (reads, total)
    assert max(reads) <= (1 / 4 + 0.05) * total + (256 << 10), (reads, total)  # + one page-rounded edge
    assert not replica_boards()
    # The control: without read_once every rank reads the checkpoint itself.
    each = cluster4.run(_load, path, False)
    assert all(o["same"] for o in each)
    assert sum(o["read"] for o in each) >= 3.5 * total, each


def _load_corrupt(path: str) -> str:
    sd = replicated_state(False)
    try:
        dcp.load(sd, storage_reader=FlashwriteStorageReader(path, timeout=30))
    except BaseException as e:  # noqa: BLE001 - DCP wraps every rank's error in a CheckpointException (a BaseException)
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_corrupt_stripe_fails_every_rank_and_names_it(cluster4, tmp_path):
    path = str(tmp_path / "ddp")
    cluster4.run(_save, path)
    victim = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0]
    with open(os.path.join(path, victim), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, victim)) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    out = cluster4.run(_load_corrupt, path)
    assert all(o != "loaded" for o in out), out
    assert all(victim in o for o in out), out  # every rank names the stripe (its reader's error, gathered by DCP)


def _spoil_in_transit(path: str, shm: bool) -> str:
    """Rank 0 changes one byte of what it read before the exchange (as memory or the
    transport could): the ranks it sends to catch it where it lands, and every rank
    fails instead of waiting for the others in the next round."""
    from flashwrite.integrations.dcp import read_once
    os.environ["FLASHWRITE_REPLICA_SHM"] = "1" if shm else "0"
    real = read_once.exchange

    def spoiling(group, sched, files, m, have, *a, **k):
        if dist.get_rank() == 0 and have:
            key = next(k for k in sorted(have) if m.tensors[k].nbytes >= 4096)
            have[key].reshape(-1).view(torch.uint8)[100] ^= 0x01
        return real(group, sched, files, m, have, *a, **k)

    read_once.exchange = spoiling
    try:
        return _load_corrupt(path)
    finally:
        read_once.exchange = real


@pytest.mark.parametrize("shm", [True, False])
def test_bytes_spoiled_in_transit_fail_every_rank(cluster4, tmp_path, shm):
    path = str(tmp_path / "ddp")
    cluster4.run(_save, path)
    out = cluster4.run(_spoil_in_transit, path, shm)
    assert all(o != "loaded" for o in out), out
    assert any("received from rank 0" in o for o in out), out


def _plans(path: str) -> list:
    """The coordinator's schedule, as every rank receives it."""
    reader = FlashwriteStorageReader(path)
    seen = []
    real = reader.read_data

    def spy(plan, planner):
        seen.append(plan.storage_data)
        return real(plan, planner)

    reader.read_data = spy
    dcp.load(replicated_state(False), storage_reader=reader)
    (data,) = seen
    sched = data[read_once.PLAN_KEY]
    return [sched["me"], sorted(set(sched["reader"].values()))]


def test_every_rank_reads_a_share(cluster4, tmp_path):
    path = str(tmp_path / "ddp")
    cluster4.run(_save, path)
    out = cluster4.run(_plans, path)
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert all(o[1] == [0, 1, 2, 3] for o in out), out  # the stripes went to all four ranks


# ------------------------------------------------------- the writer's replica check (opt-in)


def _save_checked(path: str, flip_rank: int, how: str) -> str:
    sd = replicated_state(True)
    if dist.get_rank() == flip_rank:
        sd["model"]["w5"].view(torch.int32)[1000] ^= 1  # one bit of one element, on one rank
    writer = FlashwriteStorageWriter(path, check_replicas=True)
    try:
        if how == "async":
            dcp.async_save(sd, storage_writer=writer).result()
        else:
            dcp.save(sd, storage_writer=writer)
    except BaseException as e:  # noqa: BLE001 - DivergedReplicasError, or DCP's CheckpointException around it
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.parametrize("how", ["save", "async"])
def test_the_writer_checks_replicas_dcp_writes_once(cluster4, tmp_path, how):
    path = str(tmp_path / "ok")
    assert cluster4.run(_save_checked, path, -1, how) == ["saved"] * 4
    assert all(o["same"] for o in cluster4.run(_load, path, True))
    bad = str(tmp_path / "bad")
    out = cluster4.run(_save_checked, bad, 2, how)
    for o in out:
        assert "DivergedReplicasError" in o and "model.w5 bytes [0, 1048576)" in o and "ranks [2] hold" in o, o
        assert "majority" in o
    assert not os.path.exists(os.path.join(bad, "flashwrite.json"))  # nothing committed
