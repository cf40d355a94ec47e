"""kill -9 of one rank at a random moment of incremental DCP saves (dcp.save through
FlashwriteStorageWriter with Writer(incremental=True); rank 0 deletes all but the last two
checkpoints, so the bases later ones link to go away): after each trial every committed
checkpoint is whole and byte-exact, and nothing half-written looks committed."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.format import MANIFEST_NAME, read_manifest

from test_incremental import assert_same
from test_incremental_dcp import flat_of
from test_incremental_dist_kill import HERE, kill_a_rank_at_random

_RANK = """
import datetime, os, shutil, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, {here!r})
import flashwrite as fw
from flashwrite.dcp import FlashwriteStorageWriter
from test_incremental_dcp import state_of
rank, init, root, start = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
os.makedirs(root, exist_ok=True)
print("ready", flush=True)
with fw.Writer(stripes=2, chunk_bytes=1 << 20, incremental=True) as w:
    for step in range(start, start + 6):
        dcp.save(state_of(rank, step), storage_writer=FlashwriteStorageWriter(os.path.join(root, f"step-{{step:04d}}"),
                                                                           writer=w))
        dist.barrier()
        if rank == 0:  # retention: the checkpoint the next one links from may be the one deleted next
            done = sorted(e for e in os.listdir(root) if e.startswith("step-"))
            for old in done[:-2]:
                shutil.rmtree(os.path.join(root, old))
        print("saved", step, flush=True)
dist.barrier()
dist.destroy_process_group()
print("finished", flush=True)
"""


def _committed(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if e.startswith("step-") and not commit.is_temp_name(e)
                  and os.path.exists(os.path.join(root, e, MANIFEST_NAME)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_kill9_of_a_rank_during_incremental_dcp_saves(tmp_path):
    seed = int(os.environ.get("FLASHWRITE_TEST_SEED") or time.time_ns() % 2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = str(tmp_path / "ck")
    code = _RANK.format(here=HERE)

    def next_start() -> int:
        done = _committed(root)
        return int(done[-1].split("-")[1]) + 1 if done else 1

    killed, linked_seen = 0, False
    for was_killed in kill_a_rank_at_random(code, tmp_path, root, rng, 5, next_start):
        killed += was_killed
        done = _committed(root)
        assert done, f"seed {seed}: no checkpoint left"
        for name in done:  # every committed checkpoint is whole and byte-exact
            path = os.path.join(root, name)
            flat = fw.load(path)
            assert_same({k: v for k, v in flat.items() if torch.is_tensor(v)}, flat_of(int(name.split("-")[1])))
            fw.verify(path)
            linked_seen |= any(f.get("linked") for f in read_manifest(path).raw["files"])
        for e in os.listdir(root):  # what a killed save left is temporary, never a step
            if e.startswith("step-") and e not in done:
                assert not os.path.exists(os.path.join(root, e, MANIFEST_NAME)), e
    assert killed >= 3, f"seed {seed}: only {killed} of 5 trials killed a rank mid-run"
    assert linked_seen, "no checkpoint linked a stripe: the saves were not incremental"
