"""Incremental saves with the node-local memory tier (local_snapshots=True): the snapshot
in memory needs every byte staged, so the unchanged stripes are staged as held files and
the native job links them on storage instead of writing them (held.py). The memory copy
is a whole snapshot; the storage copy writes only what changed; both restore exactly."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import flashwrite as fw
from flashwrite import CheckpointManager
from flashwrite.format import read_manifest

from test_incremental import assert_same

CHUNK = 1 << 20


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(5)
    frozen = {f"base.{i}": torch.randn(1 << 19, generator=g) for i in range(4)}  # 8 MiB, never changes
    g = torch.Generator().manual_seed(step)
    return {"model": {**frozen, "lora": torch.randn(128, 128, generator=g)},
            "optim": {"exp_avg": torch.randn(128, 128, generator=g), "step": step}}


def frozen_bytes() -> int:
    return sum(v.nbytes for k, v in state_of(0)["model"].items() if k.startswith("base."))


def inodes(path: str) -> dict[str, tuple[int, int]]:
    return {f["name"]: (os.stat(os.path.join(path, f["name"])).st_ino, os.stat(os.path.join(path, f["name"])).st_nlink)
            for f in read_manifest(path).raw["files"]}


def test_writer_with_local_snapshots_links_on_storage_and_keeps_a_whole_snapshot(tmp_path, shmdir):
    root = tmp_path / "ck"
    stats = []
    with fw.Writer(local_snapshots=True, local_dir=shmdir, incremental=True, stripes=2, chunk_bytes=CHUNK) as w:
        for step in range(1, 6):
            stats.append(w.save(state_of(step), str(root / f"step-{step}")))
    assert all(s.incremental.startswith("on") for s in stats), [s.incremental for s in stats]
    # The first has no base. The second stages the first's mixed stripes as held files, finds
    # the adapters changed and writes them, listing which tensors changed; the third plans
    # the unchanged ones into stripes of their own; from the fourth on those are linked.
    for s in stats[3:]:
        assert s.bytes_linked >= frozen_bytes() and s.bytes_written < s.bytes - frozen_bytes()
        assert s.stripes_linked >= 1 and s.link_fallbacks == 0
    # the linked stripes are the base's files (one inode, a link each)
    now, before = inodes(str(root / "step-5")), inodes(str(root / "step-4"))
    linked = [f["name"] for f in read_manifest(str(root / "step-5")).raw["files"] if f.get("linked")]
    assert linked and {now[n][0] for n in linked} <= {ino for ino, _ in before.values()}
    assert_same(fw.load(str(root / "step-5")), state_of(5))
    fw.verify(str(root / "step-5"))
    shutil.rmtree(root / "step-4")  # the base goes: the newer checkpoint stays whole
    assert_same(fw.load(str(root / "step-5")), state_of(5))


def test_manager_restores_a_linked_step_from_memory_and_from_storage(tmp_path, shmdir, caplog):
    root = tmp_path / "ck"
    with CheckpointManager(root, local_snapshots=True, local_dir=shmdir, keep_local=True, keep_last=2,
                           writer=fw.Writer(local_snapshots=True, local_dir=shmdir, stripes=2,
                                            chunk_bytes=CHUNK)) as m:
        assert m.incremental  # on by default, with local snapshots too
        for step in range(1, 6):
            m.save(step, state_of(step)).result()
        assert {1, 2}.isdisjoint(m.all_steps()) and {4, 5} <= set(m.all_steps())  # retention deletes bases
        last = read_manifest(m.path_for(5)).raw
        assert any(f.get("linked") for f in last["files"]) and last["incremental"]["linked_bytes"] >= frozen_bytes()
    m2 = CheckpointManager(root, local_snapshots=True, local_dir=shmdir)
    with caplog.at_level(logging.INFO, logger="flashwrite"):
        step, state = m2.restore()
    assert step == 5 and "from local memory" in caplog.text  # the snapshot holds the linked stripes' bytes too
    assert_same(state, state_of(5))
    m2.close()
    for snap in os.listdir(shmdir):  # memory gone: the storage copy alone
        p = os.path.join(shmdir, snap)
        shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
    m3 = CheckpointManager(root)
    step, state = m3.restore()
    assert step == 5
    assert_same(state, state_of(5))
    m3.close()


@pytest.mark.parametrize("incremental", [False, True])
def test_a_changed_frozen_tensor_reaches_both_copies(tmp_path, shmdir, incremental):
    root = tmp_path / "ck"
    with fw.Writer(local_snapshots=True, local_dir=shmdir, incremental=incremental, stripes=2,
                   chunk_bytes=CHUNK) as w:
        for step in range(1, 5):
            w.save(state_of(step), str(root / f"step-{step}"))
        s5 = state_of(5)
        s5["model"]["base.2"][7] += 1
        st = w.save(s5, str(root / "step-5"))
    assert st.bytes_written >= s5["model"]["base.2"].nbytes
    assert_same(fw.load(str(root / "step-5")), s5)
