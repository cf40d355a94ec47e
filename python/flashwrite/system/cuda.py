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

from .. import _core

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


def refuse_capture(what: str, devices: Iterable[int] = ()) -> None:
    """Raise before any GPU work of ``what`` is queued when the current stream of the
    current device, or of any of ``devices`` (those of the tensors), is being captured
    into a CUDA graph (the native engine refuses too, but a gather queued first would
    already be in the user's graph)."""
    current = torch.cuda.current_device()
    for d in sorted(set(devices) | {current}):
        with torch.cuda.device(d):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise RuntimeError(f"{what} was started while the current stream of cuda:{d} is "
                               "being captured into a CUDA graph: flashwrite's copies would become part of the graph. "
                               "Save or load outside torch.cuda.graph() (or the stream capture), e.g. before or after it.")


# (source tensor or destination, nbytes, file, offset, device) of one GPU tensor's
# bytes in a stripe.
Item = tuple[torch.Tensor, int, int, int, int]


def gather_runs(items: list[Item], max_tensor: int, max_run: int) -> list[list[int]]:
    """Indices into ``items`` grouped: small GPU tensors (at most ``max_tensor`` bytes
    each) that lie one after the other in a stripe, on one device, at most ``max_run``
    bytes a group, in file order; every other item is a group of its own. A group of
    several is moved through one device buffer laid out as the stripe is, so the
    engine needs one cudaMemcpyAsync per chunk for it instead of one per tensor."""
    groups: list[list[int]] = []
    run: list[int] = []
    run_bytes = 0
    for i in sorted(range(len(items)), key=lambda i: (items[i][2], items[i][3])):
        _, n, fi, off, dev = items[i]
        if dev < 0 or n > max_tensor:
            if run:
                groups.append(run)
            groups.append([i])
            run, run_bytes = [], 0
            continue
        if run:
            _, pn, pfi, poff, pdev = items[run[-1]]
            if pfi != fi or pdev != dev or poff + pn != off or run_bytes + n > max_run:
                groups.append(run)
                run, run_bytes = [], 0
        run.append(i)
        run_bytes += n
    if run:
        groups.append(run)
    return groups


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def gather(items: list[Item], max_tensor: int, max_run: int) -> tuple[list[int], list[torch.Tensor]]:
    """The address to copy each of ``items`` (contiguous sources) from, in their order:
    small ones copied first into gather buffers (one ``torch.cat`` on the current stream
    per group, so the engine's copies, ordered after that stream, see them); and the
    buffers, which must outlive staging. A group whose buffer the device has no memory
    for goes tensor by tensor."""
    addresses = [0] * len(items)
    buffers: list[torch.Tensor] = []
    for group in gather_runs(items, max_tensor, max_run):
        if len(group) > 1:
            try:
                buf = torch.cat([_as_bytes(items[i][0]) for i in group])
            except torch.OutOfMemoryError:
                buf = None
            if buf is not None:
                buffers.append(buf)
                addr = buf.data_ptr()
                for i in group:
                    addresses[i] = addr
                    addr += items[i][1]
                continue
        for i in group:
            addresses[i] = items[i][0].data_ptr()
    return addresses, buffers


class Scatter:
    """The load side of ``gather``: ``placements`` put each group of small destinations
    into one device buffer; ``finish()`` (once the load's copies landed) copies the
    buffers out into the destinations with one ``torch._foreach_copy_`` on the current
    stream."""

    def __init__(self, items: list[Item], max_tensor: int, max_run: int):
        self.placements: list[tuple[int, int, int, int, int]] = []
        self._dst: list[torch.Tensor] = []
        self._src: list[torch.Tensor] = []
        for group in gather_runs(items, max_tensor, max_run):
            members = [items[i] for i in group]
            if len(members) > 1:
                sizes = [n for _, n, *_ in members]
                ptrs = [t.data_ptr() for t, *_ in members]
                if all(ptrs[k] + sizes[k] == ptrs[k + 1] for k in range(len(members) - 1)):
                    # Laid out in memory as in the stripe (a map_location load's targets,
                    # read.run_targets): placed straight there, no buffer beside them.
                    _, _, fi, off, dev = members[0]
                    self.placements.append((fi, off, sum(sizes), dev, ptrs[0]))
                    continue
                try:
                    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=members[0][0].device)
                except torch.OutOfMemoryError:
                    buf = None
                if buf is not None:
                    _, _, fi, off, dev = members[0]
                    self.placements.append((fi, off, buf.numel(), dev, buf.data_ptr()))
                    self._src.extend(buf.split(sizes))
                    self._dst.extend(_as_bytes(t) for t, *_ in members)
                    continue
            self.placements.extend((fi, off, n, dev, t.data_ptr()) for t, n, fi, off, dev in members)

    def finish(self) -> None:
        if self._dst:
            torch._foreach_copy_(self._dst, self._src)
        self._dst, self._src = [], []
