"""Sizes and rounds of the benchmark suites (see conftest.py for the environment variables)."""

from __future__ import annotations

import os

from flashwrite.system.sizes import parse_size

SIZES = [parse_size(s) for s in os.environ.get("FLASHWRITE_BENCH_SIZES", "64MiB,256MiB,1GiB").split(",") if s]
SWEEP_SIZE = parse_size(os.environ.get("FLASHWRITE_SWEEP_SIZE", "512MiB"))
ROUNDS = int(os.environ.get("FLASHWRITE_BENCH_ROUNDS", "3"))
BACKENDS = ["io_uring", "threads"]


def size_id(n: int) -> str:
    return f"{n >> 30}GiB" if n % (1 << 30) == 0 else f"{n >> 20}MiB"
