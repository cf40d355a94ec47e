"""One launch and one read for every save and load (issue 10's defects, each pinned here).

* ``SaveFuture.cancel()`` is true to its word on one rank and many: a cancel racing
  the commit never returns True for a save that commits.
* A load parses its manifest once (on one rank, on many, and per DCP ``read_data``
  call however many batches it reads), flattens ``into`` once, and a multi-rank load
  hands its tensors bound for CUDA to the native engine as device targets.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.format import validate as fmt  # where read_manifest finds parse_manifest

from conftest import assert_same
from dist_helpers import Cluster

read_module = sys.modules["flashwrite.loading.read"]


def _state(rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(77, generator=g), "step": 3 + rank}


class _HeldCommit:
    """commit.finalize that signals when it starts (and touches ``marker``, for other
    processes) and waits to be let go."""

    def __init__(self, marker: str | None = None):
        self.started = threading.Event()
        self.go = threading.Event()
        self.real = commit.finalize
        self.marker = marker

    def __call__(self, *args, **kwargs):
        if self.marker:
            open(self.marker, "w").close()
        self.started.set()
        assert self.go.wait(60)
        return self.real(*args, **kwargs)


def _outcome(fut) -> str:
    try:
        fut.result(60)
        return "committed"
    except concurrent.futures.CancelledError:
        return "cancelled"


# ----------------------------------------------------------------- one rank


def test_cancel_during_the_commit_returns_false_and_the_save_commits(tmp_path, monkeypatch):
    held = _HeldCommit()
    monkeypatch.setattr(commit, "finalize", held)
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        fut = w.save_async(_state(), tmp_path / "ck")
        assert held.started.wait(60)
        assert not fut.cancel()
        held.go.set()
        assert _outcome(fut) == "committed"
    assert_same(fw.load(tmp_path / "ck"), _state())


def test_a_cancel_racing_the_commit_is_true_only_for_a_save_that_does_not_commit(tmp_path):
    rnd = random.Random(0)
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        for i in range(12):
            path = tmp_path / f"ck{i}"
            fut = w.save_async(_state(), path)
            time.sleep(rnd.uniform(0, 0.01) + i * 0.004)
            cancelled = fut.cancel()
            outcome = _outcome(fut)
            assert outcome == ("cancelled" if cancelled else "committed"), i
            assert path.exists() == (outcome == "committed"), i


# ----------------------------------------------------------------- many ranks


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


def _cancel_while_rank0_commits(root: str) -> dict:
    """Both ranks try to cancel once every stripe is durable and rank 0 is committing."""
    rank = dist.get_rank()
    marker = os.path.join(root, "committing")
    held = _HeldCommit(marker)
    commit.finalize = held
    try:
        fut = fw.save_async(_state(rank), os.path.join(root, "held"), process_group=dist.group.WORLD, timeout=30,
                            stripes=2, chunk_bytes=1 << 20)
        # Rank 0 commits only once every rank has passed its commit gate.
        while not os.path.exists(marker):
            time.sleep(0.005)
        cancelled = fut.cancel()
        held.go.set()
        return {"cancelled": cancelled, "outcome": _outcome_any(fut)}
    finally:
        commit.finalize = held.real


def _outcome_any(fut) -> str:
    exc = fut.exception(60)
    return "committed" if exc is None else type(exc).__name__


def _cancel_at_random(root: str, seed: int) -> dict:
    rank = dist.get_rank()
    rnd = random.Random(seed * 10 + rank)
    fut = fw.save_async(_state(rank), os.path.join(root, f"race{seed}"), process_group=dist.group.WORLD,
                        timeout=30, stripes=2, chunk_bytes=1 << 20, block=False)
    time.sleep(rnd.uniform(0, 0.05))
    cancelled = fut.cancel() if rnd.random() < 0.7 else False
    return {"cancelled": cancelled, "outcome": _outcome_any(fut)}


def test_multi_rank_cancel_during_the_commit_returns_false(cluster2, tmp_path):
    res = cluster2.run(_cancel_while_rank0_commits, str(tmp_path))
    assert res == [{"cancelled": False, "outcome": "committed"}] * 2
    assert_same(fw.load(tmp_path / "held"), {0: _state(0), 1: _state(1)})


def test_multi_rank_cancel_is_true_only_for_a_save_that_does_not_commit(cluster2, tmp_path):
    for seed in range(6):
        res = cluster2.run(_cancel_at_random, str(tmp_path), seed)
        committed = (tmp_path / f"race{seed}").exists()
        if any(r["cancelled"] for r in res):
            assert not committed, res
            assert all(r["outcome"] != "committed" for r in res), res
        else:
            assert committed and all(r["outcome"] == "committed" for r in res), res
    assert not [e for e in os.listdir(tmp_path) if commit.is_temp_name(e)]


# ----------------------------------------------------------------- one manifest read per load


class _CountParses:
    def __init__(self, monkeypatch):
        self.n = 0
        real = fmt.parse_manifest

        def counting(data, **kw):  # sealed=True from read_manifest
            self.n += 1
            return real(data, **kw)

        monkeypatch.setattr(fmt, "parse_manifest", counting)


def test_a_load_parses_its_manifest_once(tmp_path, monkeypatch):
    fw.save(_state(), tmp_path / "ck", stripes=3)
    parses = _CountParses(monkeypatch)
    assert_same(fw.load(tmp_path / "ck"), _state())
    assert parses.n == 1
    into = {"w": torch.zeros(256, 1024), "b": torch.zeros(77), "step": 0}
    fw.load(tmp_path / "ck", into=into)
    assert parses.n == 2
    assert_same(into, _state())


def test_load_into_flattens_into_once(tmp_path, monkeypatch):
    fw.save(_state(), tmp_path / "ck")
    into = {"w": torch.zeros(256, 1024), "b": torch.zeros(77), "step": 0}
    real, calls = read_module.flatten, []

    def spy(obj, **kwargs):
        calls.append(obj is into)
        return real(obj, **kwargs)

    monkeypatch.setattr(read_module, "flatten", spy)
    fw.load(tmp_path / "ck", into=into)
    assert calls.count(True) == 1
    assert_same(into, _state())


def _load_counting_parses(path: str) -> dict:
    rank = dist.get_rank()
    parses = []
    real_parse, real_targets = fmt.parse_manifest, read_module._map_targets
    asked = []

    def counting(data, **kw):  # sealed=True from read_manifest
        parses.append(1)
        return real_parse(data, **kw)

    def targets(entries, map_location):
        asked.append(sorted(e.key for e in entries))
        return real_targets(entries, map_location)

    fmt.parse_manifest, read_module._map_targets = counting, targets
    try:
        state = fw.load(path, process_group=dist.group.WORLD)
    finally:
        fmt.parse_manifest, read_module._map_targets = real_parse, real_targets
    assert_same(state, _state(rank))
    return {"parses": len(parses), "asked": asked}


def test_a_multi_rank_load_parses_once_and_offers_its_tensors_to_the_device_path(cluster2, tmp_path):
    path = str(tmp_path / "ck")
    cluster2.run(_save_world, path)
    res = cluster2.run(_load_counting_parses, path)
    assert [r["parses"] for r in res] == [1, 1]
    # Every rank's own tensors, and only those, are offered as device targets.
    assert res[0]["asked"] == [["0.b", "0.w"]] and res[1]["asked"] == [["1.b", "1.w"]]


def _save_world(path: str) -> None:
    fw.save(_state(dist.get_rank()), path, process_group=dist.group.WORLD, timeout=30, stripes=2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_the_dcp_reader_parses_once_per_read_data_call(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter

    sd = {f"t{i}": torch.randn(64 << 10) for i in range(6)}  # 256 KiB each
    dcp.save(sd, storage_writer=FlashwriteStorageWriter(tmp_path / "ck", stripes=6))
    reader = FlashwriteStorageReader(tmp_path / "ck", max_read_bytes=300 << 10)  # one stripe per batch
    batches = []
    real_read = read_module.CheckpointDir.read

    def read(self, **kwargs):
        batches.append(1)
        return real_read(self, **kwargs)

    monkeypatch.setattr(read_module.CheckpointDir, "read", read)
    parses = _CountParses(monkeypatch)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=reader)
    assert len(batches) >= 3
    assert parses.n == 2  # read_metadata, then one read_data call
    assert_same(back, sd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_multi_rank_gpu_load_fills_device_targets_natively(cluster2, tmp_path):
    path = str(tmp_path / "ck")
    cluster2.run(_save_world, path)
    res = cluster2.run(_load_to_gpu, path)
    assert res == [True, True]


def _load_to_gpu(path: str) -> bool:
    made = {}
    real = read_module._map_targets

    def targets(entries, map_location):
        made.update(real(entries, map_location))
        return made

    read_module._map_targets = targets
    try:
        state = fw.load(path, process_group=dist.group.WORLD, map_location="cuda:0")
    finally:
        read_module._map_targets = real
    # The tensors returned are the targets the native engine filled, not copies made by .to().
    ok = state["w"] is made["%d.w" % dist.get_rank()] and state["w"].is_cuda
    assert_same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, _state(dist.get_rank()))
    return ok
