"""The engine's tuned defaults (chosen by the sweeps in benchmarks/README.md).

The numbers live in the native core (csrc/core/defaults.hpp), which uses them as
its own defaults and exports them as ``_core.DEFAULTS``; this module only names
them for Python. Nothing restates them (tests/test_defaults_single_source.py).
The thread counts follow the CPU count by the one rule there (one per CPU this
process may run on, up to a cap), counted when ``_core`` is imported.
"""
from __future__ import annotations

from ._core import DEFAULTS as _NATIVE

STRIPES: int = _NATIVE["stripes"]
CHUNK_BYTES: int = _NATIVE["chunk_bytes"]
WRITE_QUEUE_DEPTH: int = _NATIVE["write_queue_depth"]
READ_QUEUE_DEPTH: int = _NATIVE["read_queue_depth"]
READ_CHUNK_BYTES: int = _NATIVE["read_chunk_bytes"]
DIRECT_TENSOR_BYTES: int = _NATIVE["direct_tensor_bytes"]
COPY_THREADS: int = _NATIVE["copy_threads"]
VERIFY_THREADS: int = _NATIVE["verify_threads"]
GATHER_TENSOR_BYTES: int = _NATIVE["gather_tensor_bytes"]
GATHER_RUN_BYTES: int = _NATIVE["gather_run_bytes"]

__all__ = ["STRIPES", "CHUNK_BYTES", "WRITE_QUEUE_DEPTH", "READ_QUEUE_DEPTH", "READ_CHUNK_BYTES", "DIRECT_TENSOR_BYTES",
           "COPY_THREADS",
           "VERIFY_THREADS", "GATHER_TENSOR_BYTES", "GATHER_RUN_BYTES"]
