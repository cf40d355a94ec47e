"""The GPU side of the data path, seen from Python.

The native engine copies device memory itself (D2H on save, H2D on load) on its
own CUDA streams, through the CUDA runtime it dlopens at run time
(``backend_info()["cuda"]`` says which one, or why none). Python only hands it
device pointers and the caller's current stream of every device involved, so
the copies are ordered after the work already queued there.

Where the native runtime is unavailable but PyTorch still has tensors on a GPU
(for instance ``FLASHWRITE_CUDA_RUNTIME`` points at a wrong file), flashwrite
falls back to PyTorch's own synchronous copies: slower, same results.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch

from . import _core

log = logging.getLogger("flashwrite")


@functools.lru_cache(maxsize=None)
def native_info() -> dict:
    """``_core.cuda_info()``, once per process (the runtime is loaded once)."""
    return _core.cuda_info()


def native_available() -> bool:
    """Whether the native copy engine can reach GPUs in this process."""
    return bool(native_info()["available"])


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
    log.warning("flashwrite: CUDA tensors are copied by PyTorch, synchronously, because the native CUDA "
                "copy engine is unavailable: %s", reason)


def uses_native(where: torch.Tensor | torch.device) -> bool:
    """True for a CUDA tensor (or device) the native engine can copy to or from; logs
    once when it cannot. Never initialises CUDA for anything else."""
    dev = where.device if isinstance(where, torch.Tensor) else where
    if dev.type != "cuda":
        return False
    if native_available():
        return True
    _warn_fallback(str(native_info()["reason"]))
    return False


def current_streams(devices: Iterable[int]) -> list[tuple[int, int]]:
    """[(device, cudaStream_t)] of PyTorch's current stream on each device: the native
    copies wait for the work queued on it so far (and only for that)."""
    return [(d, torch.cuda.current_stream(d).cuda_stream) for d in sorted(set(devices))]


def mark_written(t: torch.Tensor) -> None:
    """Tell autograd that ``t`` changed in place (the native engine wrote its bytes)."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(t)
