"""Cold load benchmarks: page cache dropped before every round (where permitted),
time until every tensor is in memory and verified; several sizes, both I/O
backends, and sweeps of the read queue depth and of the stripes the checkpoint
was written with. The device's own read time of the same bytes (fio's clock) is
measured once per size, untimed, and kept in each row's extra_info as device_read_s.
"""

from __future__ import annotations

import os
import shutil

import pytest
from _params import BACKENDS, ROUNDS, SIZES, SWEEP_SIZE, size_id

import flashwrite as fw
from flashwrite.ops.synthetic import state_bytes

_saved: dict[tuple, str] = {}


@pytest.fixture(scope="module")
def saved(bench_dir, state_of):
    """saved(size, stripes=None): path of a checkpoint of that size (written once per module)."""
    def get(size: int, stripes: int | None = None) -> str:
        key = (size, stripes)
        if key not in _saved:
            path = os.path.join(bench_dir, f"load-{size}-{stripes}")
            fw.save(state_of(size), path, **({"stripes": stripes} if stripes else {}))
            _saved[key] = path
        return _saved[key]
    yield get
    for p in _saved.values():
        shutil.rmtree(p, ignore_errors=True)
    _saved.clear()


def bench_load(benchmark, path, cold, nbytes, device_limit, **options):
    limit = device_limit(nbytes)  # untimed; see conftest.device_limit

    def setup():
        cold()
        return (), {}

    def run():
        fw.load(path, **options)

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(bytes=nbytes, device_read_s=limit["read_s"], device_tool=limit["tool"])


@pytest.mark.benchmark(group="load: size x backend (cold)")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES, ids=size_id)
def test_load(benchmark, state_of, saved, cold, device_limit, size, backend):
    bench_load(benchmark, saved(size), cold, state_bytes(state_of(size)), device_limit, backend=backend)


@pytest.mark.benchmark(group="load sweep: queue_depth (cold)")
@pytest.mark.parametrize("queue_depth", [4, 8, 16, 32, 64])
def test_sweep_load_queue_depth(benchmark, state_of, saved, cold, device_limit, queue_depth):
    bench_load(benchmark, saved(SWEEP_SIZE), cold, state_bytes(state_of(SWEEP_SIZE)), device_limit,
               queue_depth=queue_depth)


@pytest.mark.benchmark(group="load sweep: stripes written (cold)")
@pytest.mark.parametrize("stripes", [1, 2, 4, 8])
def test_sweep_load_stripes(benchmark, state_of, saved, cold, device_limit, stripes):
    bench_load(benchmark, saved(SWEEP_SIZE, stripes), cold, state_bytes(state_of(SWEEP_SIZE)), device_limit)


@pytest.mark.benchmark(group="load sweep: verify (cold)")
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_sweep_load_verify(benchmark, state_of, saved, cold, device_limit, verify):
    bench_load(benchmark, saved(SWEEP_SIZE), cold, state_bytes(state_of(SWEEP_SIZE)), device_limit, verify=verify)
