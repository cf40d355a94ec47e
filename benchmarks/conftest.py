"""pytest-benchmark suites for flashwrite's save and load paths.

Run from the repository root:

    python -m pytest benchmarks -q --benchmark-only --benchmark-json=bench-results/sweep.json
    python benchmarks/summarize.py bench-results/sweep.json

They are not part of the test run (pyproject's testpaths = ["tests"]).
Environment:
  FLASHWRITE_BENCH_DIR     where checkpoints go (default: bench-results/tmp in the repo; use a real disk,
                           not tmpfs, or the numbers mean nothing)
  FLASHWRITE_BENCH_SIZES   state sizes for the size x backend grid (default 64MiB,256MiB,1GiB)
  FLASHWRITE_SWEEP_SIZE    state size for the stripes / chunk / queue-depth sweeps (default 512MiB)
  FLASHWRITE_BENCH_ROUNDS  measured rounds per case (default 3; the first save of each writer is a warm-up)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid

import pytest

if importlib.util.find_spec("pytest_benchmark") is None:  # pragma: no cover - depends on the environment
    collect_ignore_glob = ["test_bench_*.py"]

from flashwrite.ops.devicelimit import drop_caches  # noqa: E402
from flashwrite.ops.synthetic import make_state  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def bench_dir():
    base = os.environ.get("FLASHWRITE_BENCH_DIR") or os.path.join(ROOT, "bench-results", "tmp")
    d = os.path.join(base, f"run-{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


_states: dict[int, object] = {}


@pytest.fixture(scope="session")
def state_of():
    """state_of(nbytes): the synthetic training state of that size (built once, kept)."""
    def get(n: int):
        if n not in _states:
            _states.clear()  # keep one at a time: 24 GiB hosts run this too
            _states[n] = make_state(n)
        return _states[n]
    return get


class Paths:
    """Fresh checkpoint paths in one directory; the previous one is removed first."""

    def __init__(self, root: str):
        self.root, self.last, self.n = root, None, 0

    def next(self) -> str:
        self.clean()
        self.n += 1
        self.last = os.path.join(self.root, f"ck-{self.n}")
        return self.last

    def clean(self) -> None:
        if self.last:
            shutil.rmtree(self.last, ignore_errors=True)


@pytest.fixture
def paths(bench_dir):
    p = Paths(bench_dir)
    yield p
    p.clean()


@pytest.fixture(scope="session")
def device_limit(bench_dir):
    """device_limit(nbytes): the device's own write and read time for nbytes (fio's clock +
    fsync, else the in-tree probe), measured once per size per session and *not* timed by
    pytest-benchmark: fio's start-up is not the device's time. The save and load rows put
    it in their extra_info (device_write_s / device_read_s), where summarize.py reads it."""
    from flashwrite.ops.devicelimit import device_limit as measure
    cache: dict[int, dict] = {}

    def get(n: int) -> dict:
        if n not in cache:
            cache[n] = measure(bench_dir, n)
        return cache[n]
    return get


@pytest.fixture(scope="session")
def cold():
    """Call before a measured round: write back dirty pages (so nobody's old writes
    land in this round) and drop the page cache where permitted."""
    def f() -> None:
        drop_caches()
    return f
