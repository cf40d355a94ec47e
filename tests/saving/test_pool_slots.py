"""The staging pool hands each slot to one chunk at a time (issue 44 item 8a).

A slot listed twice in the pool's free list stages two chunks into one slot: one
chunk's bytes are written under the other's name and checksum. Before, only the
strict stand-in CUDA runtime noticed (it refused the pageable copy such a mix-up led
to); a CPU save committed the damage. The pool now keeps a handed-out flag per slot:
a slot released while free, or found in the free list while handed out, fails the
save with no CUDA in the picture, and ``StagingPool::check`` scans the whole free list
once per save. The faults are planted with test hooks of the pool:
FLASHWRITE_TEST_POOL_RELEASE_TWICE=N (the Nth release is made twice, as by a caller
that gives a slot back twice) and FLASHWRITE_TEST_POOL_LIST_TWICE=N (the Nth release
lists its slot twice, a fault of the pool's own bookkeeping).
"""

from __future__ import annotations

import os

import pytest
import torch

import flashwrite as fw

MIB = 1 << 20


def _state() -> dict:
    return {f"t{i}": torch.full((MIB // 4,), float(i)) for i in range(12)}  # 12 chunks of 1 MiB


def _writer() -> fw.Writer:
    # Two slots for twelve chunks: every slot is reused several times within a save.
    return fw.Writer(stripes=2, chunk_bytes=MIB, max_staging_bytes=2 * MIB)


@pytest.mark.parametrize("hook,said", [("FLASHWRITE_TEST_POOL_RELEASE_TWICE", "released while free"),
                                       ("FLASHWRITE_TEST_POOL_LIST_TWICE", "listed twice")])
def test_a_slot_given_to_two_chunks_fails_the_save(tmp_path, monkeypatch, hook, said):
    monkeypatch.setenv(hook, "3")  # read when the pool is made
    with _writer() as w:
        with pytest.raises(RuntimeError, match=f"staging pool: slot 0x[0-9a-f]+ .*{said}") as ei:
            w.save(_state(), tmp_path / "ck")
        assert "two chunks" in str(ei.value)
        assert os.listdir(tmp_path) == []  # nothing committed, no temporary directory left
        # The pool's slots can no longer be trusted: its later saves fail too.
        with pytest.raises(RuntimeError, match="staging pool"):
            w.save(_state(), tmp_path / "ck")
    monkeypatch.delenv(hook)
    with _writer() as w:  # a new Writer, a new pool
        w.save(_state(), tmp_path / "ck")
    fw.verify(tmp_path / "ck")


def test_saves_that_reuse_every_slot_stay_whole(tmp_path):
    """Without a planted fault the checks stay silent: saves on a bounded pool (slots
    reused within a save) and on one that holds every chunk (checksums deferred past the
    writes, a slot freed by the later of the two), back to back on one Writer."""
    for bound in (2 * MIB, 0):
        with fw.Writer(stripes=2, chunk_bytes=MIB, max_staging_bytes=bound) as w:
            for step in range(3):
                st = {k: v + step for k, v in _state().items()}
                w.save(st, tmp_path / f"ck{bound}-{step}")
                back = fw.load(tmp_path / f"ck{bound}-{step}")
                assert all(torch.equal(back[k], st[k]) for k in st)
