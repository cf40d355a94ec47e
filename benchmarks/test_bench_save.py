"""Save benchmarks: time until a checkpoint is durable and committed (the stall is
kept in extra_info), for several sizes and both I/O backends, and sweeps of one
Writer setting at a time around the defaults in flashwrite/save.py.

Every Writer does one warm-up save first (its staging pool is allocated then);
the measured rounds are the steady state of a training run. Every timed row is a
flashwrite save; the device limit for the same bytes (fio's own clock + fsync) is
measured once per size, untimed, and kept in each row's extra_info as device_write_s.
"""

from __future__ import annotations

import statistics

import pytest
from _params import BACKENDS, ROUNDS, SIZES, SWEEP_SIZE, size_id

import flashwrite as fw
from flashwrite.defaults import CHUNK_BYTES, STRIPES
from flashwrite.ops.synthetic import state_bytes

MiB = 1 << 20


def bench_save(benchmark, state, paths, cold, device_limit, **writer_options):
    limit = device_limit(state_bytes(state))  # before, untimed, so fio's I/O does not overlap a round
    w = fw.Writer(**writer_options)
    stalls, backends = [], set()

    def setup():
        cold()
        return (paths.next(),), {}

    def run(path):
        f = w.save_async(state, path)
        st = f.result()
        stalls.append(st.stall_s)
        backends.add(f"{st.backend}{'' if st.direct else ' (buffered)'}")

    try:
        benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    finally:
        w.close()
    benchmark.extra_info.update(bytes=state_bytes(state), stall_median_s=statistics.median(stalls[1:]),
                                first_stall_s=stalls[0], backend=", ".join(sorted(backends)),
                                writer=repr(w), device_write_s=limit["write_s"], device_tool=limit["tool"])


@pytest.mark.benchmark(group="save: size x backend")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES, ids=size_id)
def test_save(benchmark, state_of, paths, cold, device_limit, size, backend):
    bench_save(benchmark, state_of(size), paths, cold, device_limit, backend=backend)


@pytest.mark.benchmark(group="save sweep: stripes")
@pytest.mark.parametrize("stripes", [1, 2, 4, 8, 16])
def test_sweep_stripes(benchmark, state_of, paths, cold, device_limit, stripes):
    bench_save(benchmark, state_of(SWEEP_SIZE), paths, cold, device_limit, stripes=stripes)


@pytest.mark.benchmark(group="save sweep: chunk_bytes")
@pytest.mark.parametrize("chunk_mib", [1, 2, 4, 8, 16, 32])
def test_sweep_chunk_bytes(benchmark, state_of, paths, cold, device_limit, chunk_mib):
    bench_save(benchmark, state_of(SWEEP_SIZE), paths, cold, device_limit, chunk_bytes=chunk_mib * MiB)


@pytest.mark.benchmark(group="save sweep: queue_depth")
@pytest.mark.parametrize("queue_depth", [2, 4, 8, 16, 32, 64])
def test_sweep_queue_depth(benchmark, state_of, paths, cold, device_limit, queue_depth):
    bench_save(benchmark, state_of(SWEEP_SIZE), paths, cold, device_limit, queue_depth=queue_depth)


@pytest.mark.benchmark(group="save sweep: queue_depth, threads backend")
@pytest.mark.parametrize("queue_depth", [4, 8, 16, 32])
def test_sweep_queue_depth_threads(benchmark, state_of, paths, cold, device_limit, queue_depth):
    bench_save(benchmark, state_of(SWEEP_SIZE), paths, cold, device_limit, queue_depth=queue_depth,
               backend="threads")


@pytest.mark.benchmark(group="save sweep: copy_threads")
@pytest.mark.parametrize("copy_threads", [1, 2, 4, 8])
def test_sweep_copy_threads(benchmark, state_of, paths, cold, device_limit, copy_threads):
    bench_save(benchmark, state_of(SWEEP_SIZE), paths, cold, device_limit, copy_threads=copy_threads)


def test_defaults_are_what_the_sweeps_vary_around():
    # The sweeps hold every other setting at the defaults; say which ones ran.
    assert CHUNK_BYTES % 4096 == 0 and STRIPES >= 1
