"""Replica groups (``replica_group=``) with real gloo processes: each replicated byte
written once and read once per group, replicas checked against each other.

DDP-like: the world is one replica group (R=4). HSDP-like: 2 shards x 2 replicas, the
replica groups {0, 2} and {1, 3}. Worker functions (leading underscore) run on every rank.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import flashwrite as fw
from flashwrite.saving import commit

from dist_helpers import Cluster, WorkerError, replica_boards

OPTS = dict(stripes=2, chunk_bytes=1 << 20, timeout=60)
N_TENSORS = 24


def model_state(shard: int, step: int) -> dict:
    """What every replica of one shard holds alike (many tensors, so stripes balance)."""
    g = torch.Generator().manual_seed(100 * shard + step)
    return {"model": {f"layer{i}.w": torch.randn(64 * 1024, generator=g) for i in range(N_TENSORS)},
            "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
            "tied": None, "step": step, "empty": torch.empty(0, 4)}


def state(rank: int, shard: int, step: int) -> dict:
    sd = model_state(shard, step)
    sd["tied"] = sd["model"]["layer0.w"]
    sd["rng"] = {"cpu": torch.full((16,), rank, dtype=torch.uint8), "seed": 1000 + rank}  # per rank by design
    return sd


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def hsdp_groups() -> tuple:
    """Replica groups {0, 2} and {1, 3} (every rank creates both: new_group is collective)."""
    a, b = dist.new_group([0, 2], backend="gloo"), dist.new_group([1, 3], backend="gloo")
    return a if dist.get_rank() in (0, 2) else b


def layout(kind: str) -> tuple:
    """(replica group, this rank's shard) for 'ddp' or 'hsdp'."""
    if kind == "ddp":
        return dist.group.WORLD, 0
    return hsdp_groups(), dist.get_rank() % 2


@pytest.fixture(scope="module")
def cluster4():
    with Cluster(4) as c:
        yield c


def du(path: str) -> int:
    return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))


def _save(root: str, kind: str, step: int, flip_rank: int = -1, where: int = 0, on_divergence: str = "raise",
          rank_local: tuple = ("rng",)) -> dict:
    rank = dist.get_rank()
    group, shard = layout(kind)
    sd = state(rank, shard, step)
    if rank == flip_rank:
        w = sd["model"]["layer5.w"]
        w.view(torch.int32)[where] ^= 1  # one bit of one element, on one rank
    try:
        fut = fw.save_async(sd, os.path.join(root, f"step-{step}"), replica_group=group, rank_local=rank_local,
                            on_divergence=on_divergence, **OPTS)
    except fw.DivergedReplicasError as e:
        return {"error": str(e), "divergence": e.divergence}
    for t in sd["model"].values():
        t.zero_()  # the snapshot was taken when save_async returned
    try:
        st = fut.result(120)
    except fw.DistributedSaveError as e:  # another group's replicas disagreed
        return {"error": str(e), "peer": True}
    return {"written": st.bytes, "diverged": st.diverged}


def _load(root: str, kind: str, step: int, load_kind: str | None, into: bool = False, shm: bool = True) -> dict:
    rank = dist.get_rank()
    os.environ["FLASHWRITE_REPLICA_SHM"] = "1" if shm else "0"  # one host: shared memory, unless told not to
    _, shard = layout(kind)
    group = layout(load_kind)[0] if load_kind else None
    path = os.path.join(root, f"step-{step}")
    dst = state(rank, 99, 0) if into else None
    before = read_bytes()
    got = fw.load(path, process_group=dist.group.WORLD, replica_group=group, into=dst)
    n = read_bytes() - before
    want = state(rank, shard, step)
    same = (all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
            and torch.equal(got["bf16"], want["bf16"]) and torch.equal(got["rng"]["cpu"], want["rng"]["cpu"])
            and got["rng"]["seed"] == 1000 + rank and got["step"] == step and got["empty"].shape == (0, 4))
    owns = all(t.untyped_storage().nbytes() == t.nbytes for t in got["model"].values())
    tied = got["tied"] is got["model"]["layer0.w"] if not into else True
    return {"same": same, "read": n, "owns": owns, "tied": tied}


def manifest(path) -> dict:
    with open(os.path.join(path, "flashwrite.json")) as f:
        return json.load(f)


def checkpoint_bytes(path: str) -> int:
    m = manifest(path)
    return sum(f["size"] for f in m["files"])


@pytest.mark.parametrize("kind,shm", [("ddp", True), ("hsdp", True), ("ddp", False), ("hsdp", False)])
def test_replicated_bytes_are_written_once_and_read_once(cluster4, tmp_path, kind, shm):
    out = cluster4.run(_save, str(tmp_path), kind, 1)
    path = str(tmp_path / "step-1")
    shards = 1 if kind == "ddp" else 2
    unique = shards * model_state(0, 1)["model"]["layer0.w"].nbytes * N_TENSORS
    on_disk = checkpoint_bytes(path)
    assert on_disk <= 1.02 * unique + 4 * (64 << 10), (on_disk, unique)  # + rank-local leaves and headers
    assert du(path) <= 1.02 * unique + 4 * (64 << 10) + (256 << 10)
    written = [o["written"] for o in out]
    assert sum(written) == on_disk
    # Each rank of a group writes about 1/R of its group's state.
    per_rank = unique / 4
    assert all(w <= 1.3 * per_rank + (64 << 10) for w in written), written
    m = manifest(path)
    groups = [g["ranks"] for g in m["replicas"]["groups"]]
    assert groups == ([[0, 1, 2, 3]] if kind == "ddp" else [[0, 2], [1, 3]])
    # A plain safetensors reader opens every stripe.
    from safetensors.torch import load_file
    for f in m["files"]:
        load_file(os.path.join(path, f["name"]))
    res = cluster4.run(_load, str(tmp_path), kind, 1, kind, shm=shm)
    assert all(r["same"] and r["owns"] and r["tied"] for r in res), res
    assert not replica_boards()
    reads = [r["read"] for r in res]
    assert sum(reads) <= 1.05 * on_disk + 4 * (64 << 10), (reads, on_disk)
    r = 4 // shards
    assert max(reads) <= (1 / r + 0.05) * on_disk / shards + (128 << 10), (reads, on_disk)


def test_a_load_by_another_layout_and_into(cluster4, tmp_path):
    cluster4.run(_save, str(tmp_path), "ddp", 2)
    for load_kind in (None, "hsdp"):  # every rank reads its own / pairs exchange
        res = cluster4.run(_load, str(tmp_path), "ddp", 2, load_kind)
        assert all(r["same"] for r in res), (load_kind, res)
    res = cluster4.run(_load, str(tmp_path), "ddp", 2, "ddp", into=True)
    assert all(r["same"] for r in res), res
    # One process: {rank: state}, every rank's whole state.
    whole = fw.load(str(tmp_path / "step-2"))
    assert sorted(whole) == [0, 1, 2, 3]
    assert all(torch.equal(whole[r]["model"]["layer3.w"], model_state(0, 2)["model"]["layer3.w"]) for r in whole)
    assert [int(whole[r]["rng"]["cpu"][0]) for r in whole] == [0, 1, 2, 3]


def _plain_save(root: str) -> None:
    rank = dist.get_rank()
    fw.save(state(rank, rank, 3), os.path.join(root, "step-3"), process_group=dist.group.WORLD, **OPTS)


def test_a_checkpoint_without_replicas_loads_with_replica_group(cluster4, tmp_path):
    cluster4.run(_plain_save, str(tmp_path))
    res = cluster4.run(_load_own, str(tmp_path))
    assert all(res), res


def big_state(shard: int) -> dict:
    """Tensors the load reads straight into their memory (1 MiB and more), one at an odd
    offset in its stripe (after a 6-byte tensor), and small ones between them."""
    g = torch.Generator().manual_seed(500 + shard)
    sd = {f"big{i}": torch.randn((1 << 18) + 1000 * i, generator=g) for i in range(6)}
    sd["a_tiny"] = torch.arange(3, dtype=torch.int16)
    sd["small"] = torch.randn(5000, generator=g)
    return sd


def _big_round_trip(root: str, kind: str) -> dict:
    from flashwrite.loading import shm_exchange
    os.environ["FLASHWRITE_REPLICA_SHM"] = "1"
    group, shard = layout(kind)
    path = os.path.join(root, kind)
    fw.save(big_state(shard), path, replica_group=group, **OPTS)
    made = []
    real = shm_exchange.Board.tensor

    def counting(self, *a, **k):
        t = real(self, *a, **k)
        made.append(t is not None)
        return t

    shm_exchange.Board.tensor = counting
    try:
        got = fw.load(path, process_group=dist.group.WORLD, replica_group=group)
    finally:
        shm_exchange.Board.tensor = real
    want = big_state(shard)
    return {"same": all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys(),
            "owns": all(t.untyped_storage().nbytes() == t.nbytes for t in got.values()), "made": made}


@pytest.mark.parametrize("kind", ["ddp", "hsdp"])
def test_large_tensors_are_read_into_shared_memory_and_handed_over(cluster4, tmp_path, kind):
    """On one host each rank reads its share's large tensors straight into its /dev/shm
    file (the tensors it returns), its peers copy them out of it, and nothing is left."""
    out = cluster4.run(_big_round_trip, str(tmp_path), kind)
    assert all(o["same"] and o["owns"] for o in out), out
    assert sum(len(o["made"]) for o in out) >= 6 and all(all(o["made"]) for o in out), out
    assert not replica_boards()


def _spoil_in_transit(root: str, shm: bool) -> str:
    """Rank 0 changes one byte of a tensor it read after reading it (as memory or the
    transport could): the ranks that receive it must catch it where it lands, and every
    rank fails (none waits for the others past the exchange)."""
    from flashwrite.loading import replicas
    os.environ["FLASHWRITE_REPLICA_SHM"] = "1" if shm else "0"
    real = replicas._exchange

    def spoiling(layout, m, shared, owner, have, *a, **k):
        if dist.get_rank() == 0:
            key = next(k for k in sorted(have) if k in shared and m.tensors[k].nbytes >= 4096)
            have[key].view(-1).view(torch.uint8)[4095] ^= 0x10
        return real(layout, m, shared, owner, have, *a, **k)

    replicas._exchange = spoiling
    try:
        fw.load(os.path.join(root, "step-1"), process_group=dist.group.WORLD, replica_group=dist.group.WORLD)
    except (fw.ChecksumMismatchError, fw.DistributedLoadError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        replicas._exchange = real
    return "loaded"


@pytest.mark.parametrize("shm", [True, False])
def test_bytes_spoiled_in_transit_are_caught_where_they_land(cluster4, tmp_path, shm):
    cluster4.run(_save, str(tmp_path), "ddp", 1)
    out = cluster4.run(_spoil_in_transit, str(tmp_path), shm)
    assert out[0].startswith("DistributedLoadError") and "rank(s) [1, 2, 3]" in out[0], out
    for text in out[1:]:
        assert text.startswith("ChecksumMismatchError") and "received from rank 0" in text, out


def _load_own(root: str) -> bool:
    rank = dist.get_rank()
    got = fw.load(os.path.join(root, "step-3"), replica_group=dist.group.WORLD)
    want = state(rank, rank, 3)
    return all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])


@pytest.mark.parametrize("flip_rank,where", [(0, 0), (2, 4096), (3, 65535)])
def test_a_flipped_bit_on_one_replica_fails_every_rank_and_commits_nothing(cluster4, tmp_path, flip_rank, where):
    cluster4.run(_save, str(tmp_path), "ddp", 1)
    out = cluster4.run(_save, str(tmp_path), "ddp", 2, flip_rank, where)
    for o in out:
        assert "error" in o, o
        (d,) = o["divergence"]
        assert d["tensor"] == "model.layer5.w"
        start, end = d["piece"]
        assert start <= where * 4 < end
        assert [flip_rank] in d["digests"].values()
        assert sorted(r for rs in d["digests"].values() for r in rs) == [0, 1, 2, 3]
        assert d["majority"] is not None and d["digests"][d["majority"]] == [r for r in range(4) if r != flip_rank]
        assert "model.layer5.w" in o["error"] and f"ranks [{flip_rank}]" in o["error"]
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # nothing committed, no temporary directory left
    assert not [e for e in os.listdir(tmp_path) if commit.is_temp_name(e)]


def _owner_of_layer5(root: str, shard_rank: int = 0) -> int:
    """The rank that wrote layer5 of the replicas led by ``shard_rank`` in step-1."""
    from flashwrite.format import parse_manifest
    with open(os.path.join(root, "step-1", "flashwrite.json"), "rb") as f:
        m = parse_manifest(f.read())
    fi = m.tensors[f"{shard_rank}.model.layer5.w"].file
    return next(r for r, (first, n) in enumerate(m.raw["ranks"]["files"]) if first <= fi < first + n)


@pytest.mark.parametrize("kind", ["ddp", "hsdp"])
def test_a_flip_is_caught_where_the_staging_takes_the_digest_and_where_it_is_hashed(cluster4, tmp_path, kind):
    # In raise mode the rank that stages a stripe takes its digests as it copies; the
    # others hash it in place. A flip on either kind of rank fails the save.
    cluster4.run(_save, str(tmp_path), kind, 1)
    writer = _owner_of_layer5(str(tmp_path), shard_rank=0)
    group = [0, 1, 2, 3] if kind == "ddp" else [0, 2]
    other = next(r for r in group if r != writer)
    for step, flip in ((2, writer), (3, other)):
        out = cluster4.run(_save, str(tmp_path), kind, step, flip, 100)
        for r, o in enumerate(out):
            if r in group:
                (d,) = o["divergence"]
                assert d["tensor"] == "model.layer5.w" and [flip] in d["digests"].values(), (flip, o)
            else:  # the other shard's group agreed; the save fails on it all the same, saying why
                assert o.get("peer") and "DivergedReplicasError" in o["error"] and "model.layer5.w" in o["error"], o
        assert sorted(os.listdir(tmp_path)) == ["step-1"], (flip, os.listdir(tmp_path))


def test_warn_commits_the_majority_even_when_the_odd_rank_would_write(cluster4, tmp_path, capsys):
    cluster4.run(_save, str(tmp_path), "ddp", 1)
    writer = _owner_of_layer5(str(tmp_path))  # the rank that writes layer5 when replicas agree
    out = cluster4.run(_save, str(tmp_path), "ddp", 2, writer, 7, "warn")
    assert all(len(o["diverged"]) == 1 for o in out), out
    m = manifest(tmp_path / "step-2")
    (d,) = m["replicas"]["groups"][0]["diverged"]
    assert d["tensor"] == "model.layer5.w" and [writer] in d["digests"].values()
    got = fw.load(str(tmp_path / "step-2"))
    assert all(torch.equal(got[r]["model"]["layer5.w"], model_state(0, 2)["model"]["layer5.w"]) for r in range(4))
    fw.verify(str(tmp_path / "step-2"))
    # The operator's tools say so.
    from flashwrite.ops.main import main
    from flashwrite.ops.ls import describe
    e = describe(str(tmp_path / "step-2"))
    assert e.diverged == 1 and "disagreed on 1 piece" in e.problem
    assert describe(str(tmp_path / "step-1")).diverged == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "step-2")]) == 0
    text = capsys.readouterr().out
    assert "replica group of ranks [0, 1, 2, 3]" in text and "DIVERGED model.layer5.w" in text


def _not_replicas(root: str) -> dict:
    rank = dist.get_rank()
    sd = state(rank, 0, 4)
    if rank == 1:
        sd["model"]["extra"] = torch.ones(3)
    try:
        fw.save(sd, os.path.join(root, "step-4"), replica_group=dist.group.WORLD, rank_local=("rng",), **OPTS)
    except fw.DivergedReplicasError as e:
        return {"error": str(e)}
    return {}


def test_states_that_differ_in_structure_are_refused(cluster4, tmp_path):
    out = cluster4.run(_not_replicas, str(tmp_path))
    assert all("rank(s) [1]" in o.get("error", "") for o in out), out
    assert os.listdir(tmp_path) == []


def test_rank_local_leaves_are_not_compared(cluster4, tmp_path):
    # Without rank_local the per-rank RNG state is taken for a replica that disagrees.
    out = cluster4.run(_save, str(tmp_path), "ddp", 5, rank_local=())
    assert all("rng.cpu" in o.get("error", "") for o in out), out


def _die_mid_exchange(root: str, victim: int) -> str:
    from flashwrite.loading import replicas
    real = replicas._exchange

    def dying(*a, **k):
        if dist.get_rank() == victim:
            os._exit(3)
        return real(*a, **k)

    replicas._exchange = dying
    try:
        fw.load(os.path.join(root, "step-1"), replica_group=dist.group.WORLD, timeout=20)
    except fw.DistributedLoadError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        replicas._exchange = real
    return "loaded"


@pytest.mark.slow
def test_a_rank_killed_mid_exchange_fails_every_load(tmp_path, monkeypatch):
    from flashwrite.loading import shm_exchange
    with Cluster(4) as c:
        c.run(_save, str(tmp_path), "ddp", 1)
        res = c.run_raw(_die_mid_exchange, str(tmp_path), 2, timeout=90)
    assert res[2][0] == "dead"
    for r in (0, 1, 3):
        tag, text = res[r]
        assert tag == "ok" and "DistributedLoadError" in text and "lost a peer" in text, res
    # The killed rank could not remove its board from /dev/shm; the next board made removes it.
    left = replica_boards()
    assert [n.rsplit("-", 1)[1] for n in left] == ["2"], left
    monkeypatch.setattr(shm_exchange, "STALE_AFTER_S", 0.0)
    board = shm_exchange.Board(0, [[("a", 1, 0)]])
    board.remove()
    assert not replica_boards()


def test_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="apply to saves with replica_group"):
        fw.save({"a": torch.ones(2)}, str(tmp_path / "x"), rank_local=("rng",))


def _manager(root: str) -> list:
    rank = dist.get_rank()
    mgr = fw.CheckpointManager(root, every_n_steps=1, keep_last=2, replica_group=dist.group.WORLD,
                               rank_local=("rng",), writer=fw.Writer(stripes=2, chunk_bytes=1 << 20))
    for step in (1, 2):
        mgr.maybe_save(step, state(rank, 0, step))
    mgr.wait()
    got = mgr.restore_latest()
    mgr.close()
    want = state(rank, 0, 2)
    return [got[0], all(torch.equal(got[1]["model"][k], want["model"][k]) for k in want["model"]),
            int(got[1]["rng"]["cpu"][0])]


def test_checkpoint_manager_with_replica_group(cluster4, tmp_path):
    res = cluster4.run(_manager, str(tmp_path))
    assert res == [[2, True, r] for r in range(4)], res
    step = fw.load(str(tmp_path / sorted(os.listdir(tmp_path))[-1]))
    assert sorted(step) == [0, 1, 2, 3]


def _manager_diverged(root: str, mode: str) -> dict:
    """Step 1 agrees; at step 2 rank 1's replica has one bit flipped."""
    rank = dist.get_rank()
    mgr = fw.CheckpointManager(root, every_n_steps=1, replica_group=dist.group.WORLD, rank_local=("rng",),
                               on_divergence=mode, writer=fw.Writer(stripes=2, chunk_bytes=1 << 20))
    mgr.maybe_save(1, state(rank, 0, 1))
    mgr.wait()
    sd = state(rank, 0, 2)
    if rank == 1:
        sd["model"]["layer3.w"].view(torch.int32)[11] ^= 1
    out: dict = {}
    try:
        fut = mgr.maybe_save(2, sd)
        out["diverged"] = [d["tensor"] for d in fut.result().diverged]
    except fw.DivergedReplicasError as e:
        out["error"] = str(e)
    mgr.wait()
    out["latest"] = mgr.latest_step()
    mgr.close()
    return out


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_checkpoint_manager_passes_on_divergence(cluster4, tmp_path, mode):
    res = cluster4.run(_manager_diverged, str(tmp_path), mode)
    if mode == "raise":  # every rank fails the save; step 1 stays the newest
        assert all("model.layer3.w" in o.get("error", "") and o["latest"] == 1 for o in res), res
    else:  # the majority's bytes committed, the disagreement recorded
        assert all(o.get("diverged") == ["model.layer3.w"] and o["latest"] == 2 for o in res), res
