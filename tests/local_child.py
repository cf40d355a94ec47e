"""A training process for the local-snapshot tests, to be killed with -9.

    python local_child.py ROOT LOCAL_DIR MODE N

MODE "staged": commits step 1, then saves step 2 and prints "STAGED" once
save() returned; the commit of step 2 is slowed down (1 s) so that a kill at a
random moment lands after staging and before the commit.
MODE "committed": commits steps 1 and 2, then prints "COMMITTED" (a crash
later in training: the newest snapshot is of a step storage holds too).
MODE "staging": commits step 1, prints "STAGING" and saves step 2 (many small
tensors, so a kill can land while step 2 is being staged), then prints "STAGED".
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import flashwrite  # noqa: E402
from flashwrite.saving import commit  # noqa: E402
from fault_util import make_state  # noqa: E402


def staging_state(step: int, n: int) -> dict:
    """Many small tensors: staging takes a while, and a kill lands inside it."""
    w = make_state(step, n)["model"]["w"][: n // 64]
    return {f"t{i}": w + i for i in range(400)}


def main() -> None:
    root, local_dir, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    mgr = flashwrite.CheckpointManager(root, local_snapshots=True, local_dir=local_dir)
    mgr.save(1, make_state(1, n))
    mgr.wait()
    if mode == "staged":
        real = commit.finalize

        def slow_finalize(*a, **k):
            time.sleep(1.0)
            return real(*a, **k)

        commit.finalize = slow_finalize
        state = make_state(2, n)
        mgr.save(2, state)
        print("STAGED", flush=True)
    elif mode == "committed":
        mgr.save(2, make_state(2, n))
        mgr.wait()
        print("COMMITTED", flush=True)
    elif mode == "staging":
        state = staging_state(2, n)
        print("STAGING", flush=True)
        mgr.save(2, state)
        print("STAGED", flush=True)
    time.sleep(30)


if __name__ == "__main__":
    main()
