"""Endurance: hundreds of saves through one manager leave memory, file descriptors
and threads where they were, and retention keeps exactly what it promises."""

import os
import time

from conftest import assert_same
from fault_util import make_state, temp_entries

import flashwrite as fw

N = 1 << 15          # ~180 kB per checkpoint: a leak of one state per save would be ~70 MB here
STEPS = 500
KEEP_LAST, KEEP_EVERY = 3, 100


def _rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS"))


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _expected(last: int) -> list[int]:
    steps = range(last + 1)
    return sorted({s for s in steps if s % KEEP_EVERY == 0} | set(steps[-KEEP_LAST:]))


def test_500_saves_flat_and_exact(tmp_path):
    w = fw.Writer(stripes=2, chunk_bytes=1 << 16)
    mgr = fw.CheckpointManager(tmp_path / "ck", every_n_steps=1, keep_last=KEEP_LAST, keep_every_n_steps=KEEP_EVERY,
                               writer=w)
    baseline = None
    t0 = time.perf_counter()
    for step in range(STEPS):
        assert mgr.maybe_save(step, make_state(step, N)) is not None
        if step % 50 == 49:
            mgr.wait()
            assert mgr.all_steps() == _expected(step), step
            if step == 99:  # after warm-up: pools, threads and caches exist
                baseline = (_rss(), _fds(), _threads())
    mgr.wait()
    elapsed = time.perf_counter() - t0
    rss, fds, threads = _rss(), _fds(), _threads()
    assert fds == baseline[1], (baseline[1], fds)
    assert threads == baseline[2], (baseline[2], threads)
    assert rss - baseline[0] < 16 << 20, f"RSS grew by {(rss - baseline[0]) >> 20} MiB over {STEPS - 100} saves"
    assert mgr.all_steps() == [0, 100, 200, 300, 400, 497, 498, 499]
    assert temp_entries(mgr.root) == [] and len(os.listdir(mgr.root)) == 8
    for s in (0, 400, 499):
        assert_same(mgr.restore(s)[1], make_state(s, N))
    mgr.close()
    w.close()
    print(f"{STEPS} saves in {elapsed:.1f} s; RSS {baseline[0] >> 20} -> {rss >> 20} MiB, "
          f"{len(fds)} fds, {threads} threads")
