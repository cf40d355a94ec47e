"""The engine's tuned defaults, in one place (chosen by the sweeps in benchmarks/README.md).

Every module takes its defaults from here; nothing else restates these numbers.
"""
from __future__ import annotations

STRIPES = 4
CHUNK_BYTES = 16 << 20  # 16 MiB beat 1-8 and 32 MiB in both sweeps (to durable and stall)
WRITE_QUEUE_DEPTH = 32  # 32-64 beat 2-16; 32 keeps in-flight memory at half of 64's
READ_QUEUE_DEPTH = 32  # matched or beat 16 in both load sweeps
READ_CHUNK_BYTES = 8 << 20

__all__ = ["STRIPES", "CHUNK_BYTES", "WRITE_QUEUE_DEPTH", "READ_QUEUE_DEPTH", "READ_CHUNK_BYTES"]
