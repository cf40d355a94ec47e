"""Held files: GPU stripes of an incremental save are staged, then linked when their
checksums match the base stripe's, written otherwise (csrc/write/save_held.cpp, held.py).

The native part runs on tests/fake_cudart.cpp (a strict stand-in CUDA runtime, see
test_cuda.py), in child processes (held_child.py) under a timeout, so a hang fails the test.
The end-to-end part drives the same held path from a Writer with host tensors, through
``held.HOLD_HOST`` (host candidate stripes planned as held files instead of compared)."""

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import flashwrite as fw
from flashwrite.incremental import held

from fault_util import kill_at_random

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))
LINKED, CHANGED, REFUSED, POOL_TOO_SMALL, UNDECIDED = held.LINKED, held.CHANGED, held.REFUSED, \
    held.POOL_TOO_SMALL, held.UNDECIDED


def _run(fake_cudart, scenario, tmp_path, base_dir=None, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full_env.update({"FLASHWRITE_CUDA_RUNTIME": fake_cudart, **{k: str(v) for k, v in env.items()}})
    args = [sys.executable, os.path.join(HERE, "held_child.py"), scenario, str(tmp_path)]
    r = subprocess.run(args + ([base_dir] if base_dir else []), env=full_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"{scenario} failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_matching_held_files_are_hard_linked_not_written(fake_cudart, tmp_path):
    out = _run(fake_cudart, "linked", tmp_path)
    assert out["error"] is None
    assert [r[0] for r in out["results"]] == [LINKED] * 3
    assert out["same_bytes"] and out["same_checksums"]  # the checksums were computed from the staged bytes
    for mine, theirs in zip(out["inodes"], out["base_inodes"]):
        assert mine == theirs and mine[1] == 2  # the base stripe's inode, under a second name
    assert out["stats"]["bytes_written"] == 0 and out["stats"]["device_bytes"] > 0
    assert out["trimmed"] > 0  # every slot came back to the pool


def test_a_changed_held_file_is_written_the_others_linked(fake_cudart, tmp_path):
    out = _run(fake_cudart, "changed", tmp_path)
    assert out["error"] is None
    kinds = [r[0] for r in out["results"]]
    assert sorted(kinds) == [LINKED, LINKED, CHANGED]
    assert out["same_bytes"] and out["same_checksums"]  # byte-exact with a plain save of the changed state
    i = kinds.index(CHANGED)
    assert out["inodes"][i] != out["base_inodes"][i] and out["inodes"][i][1] == 1
    assert out["stats"]["bytes_written"] == out["sizes"][i]
    assert out["trimmed"] > 0


def test_a_removed_base_stripe_is_written_instead(fake_cudart, tmp_path):
    out = _run(fake_cudart, "base_removed", tmp_path)
    assert out["results"][0] == [REFUSED, errno.ENOENT]
    assert [r[0] for r in out["results"][1:]] == [LINKED, LINKED]
    assert out["same_bytes"] and out["inodes"][0][1] == 1


def test_a_base_on_another_file_system_is_written_instead(fake_cudart, tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    other = tempfile.mkdtemp(dir="/dev/shm")
    try:
        if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is on the test directory's file system")
        out = _run(fake_cudart, "linked", tmp_path, base_dir=other)
    finally:
        shutil.rmtree(other)
    assert out["results"] == [[REFUSED, errno.EXDEV]] * 3
    assert out["same_bytes"] and all(i[1] == 1 for i in out["inodes"])
    assert out["stats"]["bytes_written"] == sum(out["sizes"])


def test_a_pool_smaller_than_a_held_file_writes_without_holding(fake_cudart, tmp_path):
    out = _run(fake_cudart, "small_pool", tmp_path)  # under the child's timeout: a hang fails
    assert out["error"] is None
    assert [r[0] for r in out["results"]] == [POOL_TOO_SMALL] * 3
    assert out["same_bytes"] and out["same_checksums"]


def test_a_bounded_pool_that_holds_the_save_links(fake_cudart, tmp_path):
    out = _run(fake_cudart, "bounded_pool_holds", tmp_path)
    assert [r[0] for r in out["results"]] == [LINKED] * 3 and out["same_bytes"]


def test_a_copy_error_releases_every_held_slot(fake_cudart, tmp_path):
    out = _run(fake_cudart, "copy_fails", tmp_path, FAKE_CUDART_FAIL_COPY=3, FAKE_CUDART_COPY_DELAY_US=100,
               FAKE_CUDART_FAIL_CODE=1)  # not sticky, so the engine saves again
    assert out["error"], out  # the failed copy is the save's error
    assert all(r[0] in (UNDECIDED, LINKED) for r in out["results"])
    assert out["trimmed"] > 0  # no slot was left parked
    assert out["again"] == [[LINKED, 0]] * 3 and out["again_same"]  # the engine saves again


# ------------------------------------------------------------- end to end, host tensors held


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"frozen": {f"w{i}": torch.randn(300_000, generator=g) for i in range(4)},
            "emb": torch.randn(70_000, generator=g).to(torch.bfloat16), "hot": torch.randn(1000, generator=g)}


def _manifest(d):
    with open(os.path.join(d, "flashwrite.json")) as f:
        return json.load(f)


def _equal(a, b):
    return all(torch.equal(a["frozen"][k], b["frozen"][k]) for k in a["frozen"]) and torch.equal(
        a["emb"], b["emb"]) and torch.equal(a["hot"], b["hot"])


def test_writer_links_held_stripes_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(held, "HOLD_HOST", True)
    sd = _state()
    frozen_bytes = sum(t.nbytes for t in sd["frozen"].values()) + sd["emb"].nbytes
    w = fw.Writer(stripes=2, incremental=True, chunk_bytes=1 << 20)
    stats = []
    for step in range(5):
        sd["hot"] += 1
        fut = w.save_async(sd, str(tmp_path / f"step-{step}"))
        fut.result()
        stats.append(fut.stats)
        assert _equal(fw.load(str(tmp_path / f"step-{step}")), sd)
        fw.verify(str(tmp_path / f"step-{step}"))
        assert fut.stats.bytes_written + fut.stats.bytes_linked == fut.stats.bytes
        assert fut.stats.incremental.startswith("on") and fut.stats.link_fallbacks == 0
        assert fut.progress() == 1.0  # linked bytes count as done
    # 2nd save: every base stripe held; the one with "hot" is written (marked hot, its
    # changed tensor listed), the others linked.
    m1 = _manifest(tmp_path / "step-1")
    hot = [f for f in m1["files"] if f.get("hot")]
    assert len(hot) == 1 and hot[0]["changed"] == ["hot"] and stats[1].stripes_linked >= 1
    # 3rd save links the held stripes again and plans the unchanged tensors of the hot one
    # into stable stripes; from the 4th on, only the changed tensor is written.
    assert stats[2].stripes_linked >= 1 and stats[2].bytes_linked > 0
    assert stats[3].bytes_linked >= frozen_bytes and stats[3].bytes_written < 64 << 10
    assert stats[4].bytes_linked >= frozen_bytes
    m = _manifest(tmp_path / "step-4")
    linked = [f["name"] for f in m["files"] if f.get("linked")]
    assert linked and m["incremental"]["linked_bytes"] == stats[4].bytes_linked
    for name in linked:
        st = os.stat(tmp_path / "step-4" / name)
        assert st.st_nlink >= 2 and st.st_ino == os.stat(tmp_path / "step-3" / name).st_ino
    for step in range(4):  # each checkpoint stays whole on its own
        shutil.rmtree(tmp_path / f"step-{step}")
    assert _equal(fw.load(str(tmp_path / "step-4")), sd)
    fw.verify(str(tmp_path / "step-4"))


def test_manager_saves_with_metadata_reach_linked_held_stripes(tmp_path, monkeypatch):
    """A manager's stripes carry per-save metadata (not linkable as they are): their
    tensors go to stable stripes, which later saves hold and link."""
    monkeypatch.setattr(held, "HOLD_HOST", True)
    sd = _state()
    frozen_bytes = sum(t.nbytes for t in sd["frozen"].values()) + sd["emb"].nbytes
    with fw.CheckpointManager(str(tmp_path), every_n_steps=1, keep_last=2,
                              writer=fw.Writer(stripes=2, chunk_bytes=1 << 20)) as mgr:
        for step in range(1, 7):
            sd["hot"].fill_(step)
            stats = mgr.maybe_save(step, sd).result()
        assert stats.bytes_linked >= frozen_bytes and stats.link_fallbacks == 0
        assert _equal(fw.load(mgr.path_for(6)), sd)


def test_writer_writes_a_held_stripe_whose_tensor_changed(tmp_path, monkeypatch):
    monkeypatch.setattr(held, "HOLD_HOST", True)
    sd = _state()
    w = fw.Writer(stripes=2, incremental=True, chunk_bytes=1 << 20)
    w.save(sd, str(tmp_path / "a"))
    sd["frozen"]["w1"][5] += 1  # a tensor of a held stripe changes in place
    fut = w.save_async(sd, str(tmp_path / "b"))
    fut.result()
    assert _equal(fw.load(str(tmp_path / "b")), sd)
    fw.verify(str(tmp_path / "b"))
    m = _manifest(tmp_path / "b")
    assert any(f.get("hot") for f in m["files"])  # the changed held stripe: written, marked hot
    assert fut.stats.bytes_written + fut.stats.bytes_linked == fut.stats.bytes


def test_writer_with_a_pool_too_small_to_hold_writes_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(held, "HOLD_HOST", True)
    sd = _state()
    w = fw.Writer(stripes=2, incremental=True, chunk_bytes=1 << 20, max_staging_bytes=2 << 20)
    w.save(sd, str(tmp_path / "a"))
    sd["hot"] += 1
    fut = w.save_async(sd, str(tmp_path / "b"))
    fut.result()
    assert "staging pool cannot hold" in fut.stats.incremental
    assert fut.stats.bytes_linked == 0 and fut.stats.bytes_written == fut.stats.bytes
    assert _equal(fw.load(str(tmp_path / "b")), sd)
    fw.verify(str(tmp_path / "b"))


def test_stable_hints_read_the_changed_lists_as_hostile_input(tmp_path, monkeypatch):
    from flashwrite.format import read_manifest
    monkeypatch.setattr(held, "HOLD_HOST", True)
    sd = _state()
    w = fw.Writer(stripes=2, incremental=True, chunk_bytes=1 << 20)
    w.save(sd, str(tmp_path / "a"))
    sd["hot"] += 1
    w.save(sd, str(tmp_path / "b"))
    m = read_manifest(str(tmp_path / "b"))
    fi = next(i for i, f in enumerate(m.raw["files"]) if f.get("hot"))
    beside = {te.key for te in m.tensors.values() if te.file == fi} - {"hot"}
    assert beside and held.stable_hints(m) == beside
    for bad in ([1, 2], "hot", None, {"hot": 1}):
        m.raw["files"][fi]["changed"] = bad
        assert held.stable_hints(m) == set()
    m.raw["files"] = {"not": "a list"}
    assert held.stable_hints(m) == set()


_VICTIM = r"""
import sys, torch
sys.path.insert(0, {here!r})
import flashwrite as fw
from flashwrite.incremental import held
from test_incremental_gpu_held import _state

held.HOLD_HOST = True
sd = _state()
mgr = fw.CheckpointManager({root!r}, every_n_steps=1, keep_last=2, writer=fw.Writer(stripes=2, chunk_bytes=1 << 20))
start = (mgr.latest_step() or 0) + 1
for step in range(start, start + 6):
    sd["hot"].fill_(step)
    mgr.maybe_save(step, sd)
mgr.close()
"""


@pytest.mark.slow
def test_kill9_during_saves_with_held_files(tmp_path):
    """kill -9 at random moments of incremental saves whose stripes are held files: every
    committed checkpoint stays whole and byte-exact (the links are made before the
    directory fsync that precedes the manifest), and held files were linked."""
    from flashwrite.saving import commit
    from flashwrite.format import read_manifest
    seed = int(os.environ.get("FLASHWRITE_TEST_SEED") or time.time_ns() % 2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = str(tmp_path / "ck")
    code = _VICTIM.format(here=HERE, root=root)
    killed, held_linked = 0, False
    for was_killed in kill_at_random(code, rng, 8):
        killed += was_killed
        mgr = fw.CheckpointManager(root)  # cleans what the victim left
        assert mgr.all_steps() and [e for e in os.listdir(root) if commit.is_temp_name(e)] == []
        for s in mgr.all_steps():
            back = fw.load(mgr.path_for(s))
            assert back["hot"].eq(s).all() and _equal({**back, "hot": back["hot"]}, {**_state(), "hot": back["hot"]})
            fw.verify(mgr.path_for(s))
            held_linked |= any(f.get("linked") and "-held-" in f["name"]
                               for f in read_manifest(mgr.path_for(s)).raw["files"])
        mgr.close()
    assert killed >= 4, f"seed {seed}: only {killed} of 8 victims were killed mid-run"
    assert held_linked, "no held file was linked: the saves did not take the held path"
