"""One rank of a multi-rank run with local snapshots, for the kill tests.

    python local_dist_child.py RANK WORLD INIT_FILE ROOT SHM_BASE MODE [neighbours]

Each rank's local_dir is SHM_BASE/r<RANK>, as if each rank ran on a node of its
own. With "neighbours", each rank also keeps rank r-1's snapshots.

MODE "one_dies": step 1 is committed; then the last rank dies (kill -9 of itself)
before saving step 2 while the others stage step 2 and print STAGED.
MODE "all_staged": step 1 is committed; every rank stages step 2 (the commit on
rank 0 is held back) and prints STAGED.
MODE "restore": restore(), check the state against what that step saved, wait
for a write-back, check the committed checkpoint, print "RESTORED <step>".
"""

import datetime
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flashwrite  # noqa: E402
from flashwrite.saving import commit  # noqa: E402
from conftest import assert_same  # noqa: E402
from fault_util import make_state  # noqa: E402

N = 1 << 15


def state(step: int, rank: int) -> dict:
    return make_state(step * 10 + rank, N)


def main() -> None:
    rank, world, init, root, shm, mode = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7]
    neighbours = sys.argv[7:8] == ["neighbours"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mgr = flashwrite.CheckpointManager(root, local_snapshots=True, local_dir=os.path.join(shm, f"r{rank}"),
                                       process_group=dist.group.WORLD, neighbour_copies=neighbours)
    if mode == "restore":
        step, got = mgr.restore()
        assert_same(got, state(step, rank))
        mgr.wait()
        assert step in mgr.all_steps()
        assert_same(flashwrite.load(mgr.path_for(step), process_group=dist.group.WORLD), state(step, rank))
        print(f"RESTORED {step}", flush=True)
        mgr.close()
        dist.destroy_process_group()
        return
    mgr.save(1, state(1, rank))
    mgr.wait()
    if mode == "one_dies" and rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    real = commit.finalize

    def slow_finalize(*a, **k):
        time.sleep(5)
        return real(*a, **k)

    commit.finalize = slow_finalize
    mgr.save(2, state(2, rank))
    print("STAGED", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
