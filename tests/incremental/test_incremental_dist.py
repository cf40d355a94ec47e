"""Incremental multi-rank saves (process_group=) with real processes (gloo on localhost):
each rank compares its own state with its own part of the previous committed checkpoint
and hard-links its unchanged stripes into the shared temporary directory."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import flashwrite as fw
from flashwrite.incremental import link as incremental
from flashwrite.format import read_manifest
from flashwrite.ops.diff import diff

from dist_helpers import Cluster
from test_incremental import assert_same, stripes_of

CHUNK = 1 << 20


def frozen_of(rank: int, seed: int = 99) -> dict:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return {f"base.{i}": torch.randn((1 << 17) + 512 * rank, generator=g).to(torch.bfloat16) for i in range(4)}


def state_of(rank: int, step: int, seed: int = 99) -> dict:
    """Per rank: a frozen base (the same every step for a given seed) and adapters that change."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"model": {**frozen_of(rank, seed), "lora.a": torch.randn(64, 128 + rank, generator=g)},
            "optim": {"exp_avg": torch.randn(64, 128, generator=g), "step": step}, "rank": rank}


def summary(s: fw.SaveStats) -> dict:
    return {"incremental": s.incremental, "bytes": s.bytes, "written": s.bytes_written, "linked": s.bytes_linked,
            "stripes_linked": s.stripes_linked, "fallbacks": s.link_fallbacks}


def _save_steps(root: str, steps: list[int], seeds: dict[int, int] | None = None) -> list[dict]:
    """Save ``steps`` in turn (rank r's frozen part from seeds.get(r, 99)); each rank then
    loads its own part of every one back."""
    rank = dist.get_rank()
    seed = (seeds or {}).get(rank, 99)
    out = []
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        for step in steps:
            st = w.save(state_of(rank, step, seed), os.path.join(root, f"step-{step}"),
                        process_group=dist.group.WORLD, timeout=60)
            out.append(summary(st))
    for step in steps:
        assert_same(fw.load(os.path.join(root, f"step-{step}"), process_group=dist.group.WORLD),
                    state_of(rank, step, seed))
    return out


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


def frozen_bytes(rank: int) -> int:
    return sum(t.nbytes for t in frozen_of(rank).values())


def test_second_save_links_each_ranks_unchanged_stripes(cluster2, tmp_path):
    root = str(tmp_path)
    res = cluster2.run(_save_steps, root, [1, 2, 3])
    for rank, stats in enumerate(res):
        assert stats[0]["incremental"] == "on: no earlier checkpoint to link from" and stats[0]["linked"] == 0
        # The second save plans the unchanged tensors into stripes of their own; the third links them.
        assert stats[1]["incremental"] == "on"
        s = stats[2]
        assert s["incremental"] == "on" and s["fallbacks"] == 0
        assert s["linked"] >= frozen_bytes(rank) and s["written"] + s["linked"] == s["bytes"]
        assert s["written"] < 0.25 * s["bytes"]
    # The merged manifest: each rank's section, the totals, and every rank's stripes in its span.
    raw = read_manifest(str(tmp_path / "step-3")).raw
    sec = raw["incremental"]
    assert sec["base"] == "step-2" and len(sec["ranks"]) == 2
    assert sec["linked_bytes"] == sum(r[2]["linked"] for r in res)
    assert sec["written_bytes"] == sum(r[2]["written"] for r in res)
    assert incremental.byte_counts(raw) == (sec["written_bytes"], sec["linked_bytes"])  # what ls/inspect show
    for rank, (first, count) in enumerate(raw["ranks"]["files"]):
        names = [f["name"] for f in raw["files"][first:first + count]]
        assert all(n.startswith(f"model-rank{rank:05d}-") for n in names)
        assert any(f.get("linked") for f in raw["files"][first:first + count])
    # Linked stripes are the previous checkpoint's inodes; written ones are new.
    a, b = stripes_of(str(tmp_path / "step-2")), stripes_of(str(tmp_path / "step-3"))
    inodes_a = {f["ino"] for f in a.values()}
    for f in b.values():
        assert (f["ino"] in inodes_a) == bool(f.get("linked"))
    # diff names the tensors that changed, on every rank.
    d = diff(str(tmp_path / "step-2"), str(tmp_path / "step-3"))
    assert d["changed_content"] == sorted(f"{r}.{k}" for r in (0, 1) for k in ("model.lora.a", "optim.exp_avg"))
    # One process reads every rank's state; verify covers the linked stripes.
    whole = fw.load(str(tmp_path / "step-3"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 3))
    fw.verify(str(tmp_path / "step-3"))
    # Deleting the bases leaves the last checkpoint whole.
    shutil.rmtree(tmp_path / "step-1")
    shutil.rmtree(tmp_path / "step-2")
    assert all(f["nlink"] == 1 for f in stripes_of(str(tmp_path / "step-3")).values())
    whole = fw.load(str(tmp_path / "step-3"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 3))
    fw.verify(str(tmp_path / "step-3"))


def test_a_rank_whose_part_changed_or_is_missing_writes_everything(cluster2, tmp_path):
    root = str(tmp_path)
    cluster2.run(_save_steps, root, [1, 2])  # step 2 has the frozen tensors in stripes of their own
    # Rank 1's frozen part changed: it links nothing, rank 0 still links its own.
    res = cluster2.run(_save_steps, root, [3], seeds={1: 7})
    assert res[0][0]["linked"] >= frozen_bytes(0)
    assert res[1][0]["incremental"] == "on" and res[1][0]["linked"] == 0
    assert res[1][0]["written"] == res[1][0]["bytes"]
    whole = fw.load(str(tmp_path / "step-3"))
    assert_same(whole[0], state_of(0, 3))
    assert_same(whole[1], state_of(1, 3, seed=7))
    # Rank 1's stripes of the base are gone: rank 1 writes everything, rank 0 links.
    root = str(tmp_path / "b")
    res = cluster2.run(_save_steps, root, [1, 2, 3])
    assert res[1][2]["stripes_linked"] > 0
    raw = read_manifest(os.path.join(root, "step-3")).raw
    first, count = raw["ranks"]["files"][1]
    for f in raw["files"][first:first + count]:
        os.unlink(os.path.join(root, "step-3", f["name"]))
    res = cluster2.run(_save_steps, root, [4])
    assert res[0][0]["linked"] >= frozen_bytes(0)
    assert res[1][0]["linked"] == 0 and res[1][0]["written"] == res[1][0]["bytes"]
    whole = fw.load(os.path.join(root, "step-4"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 4))
    fw.verify(os.path.join(root, "step-4"))


def test_a_single_process_base_is_not_linked_from(cluster2, tmp_path):
    fw.save(state_of(0, 1), str(tmp_path / "step-1"), stripes=2, chunk_bytes=CHUNK)
    res = cluster2.run(_save_steps, str(tmp_path), [2])
    for stats in res:
        assert stats[0]["incremental"] == ("off: the earlier checkpoint step-1 cannot be linked from: it was saved "
                                           "by one process")
        assert stats[0]["linked"] == 0 and stats[0]["written"] == stats[0]["bytes"]
    # ... and a multi-rank base is not linked from by a single-process save.
    s = fw.save(state_of(0, 3), str(tmp_path / "step-3"), stripes=2, chunk_bytes=CHUNK, incremental=True)
    assert s.incremental.endswith("it is a ranks checkpoint") and s.bytes_linked == 0


def _manager_steps(root: str) -> list[dict]:
    rank = dist.get_rank()
    out = []
    with fw.CheckpointManager(root, every_n_steps=1, keep_last=1, process_group=dist.group.WORLD,
                              writer=fw.Writer(stripes=2, chunk_bytes=CHUNK)) as mgr:
        assert mgr.incremental
        for step in (1, 2, 3):
            out.append(summary(mgr.maybe_save(step, state_of(rank, step)).result(60)))
            mgr.wait()
        assert_same(fw.load(mgr.path_for(3), process_group=dist.group.WORLD), state_of(rank, 3))
    return out


def test_manager_with_process_group_is_incremental_and_retention_keeps_the_last_whole(cluster2, tmp_path):
    root = str(tmp_path / "m")
    res = cluster2.run(_manager_steps, root)
    for rank, stats in enumerate(res):
        assert stats[2]["incremental"] == "on" and stats[2]["linked"] >= frozen_bytes(rank)
    left = sorted(os.listdir(root))
    assert left == ["step-00000003"], left
    whole = fw.load(os.path.join(root, left[0]))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 3))
    fw.verify(os.path.join(root, left[0]))
