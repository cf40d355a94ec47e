"""Compressed saves (issue 38): ``Writer(compress=None | "zstd" | "auto")``.

``"zstd"``: every stripe's chunks are framed by the native codec (byte planes + zstd,
``csrc/core/codec.hpp``) on the copy threads, after staging (the stall does not
grow); the manifest records each chunk's frame (``format/codec.py``) and the
checksums stay over the uncompressed bytes. ``"auto"``: on only where the target's
measured rate is below half of what the cores compress (``AUTO_MARGIN``): the rate of
the last save this process made to the same place (bytes sent / seconds to durable),
or a saved tuning's ``write_gbps``; with neither, off (a first save measures). The
cores' rate is a one-time probe of the codec on weight-like bytes, replaced by what
compressed saves measure. Off by default."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from .. import _core

MODES = (None, "zstd", "auto")
_lock = threading.Lock()
_target_gbps: dict[str, float] = {}  # place -> bytes sent per second, last save there
_core_gbps: list[float] = []  # per copy thread, compressing
# "auto" turns on only where the cores compress this many times faster than the target
# takes bytes: the same threads also stage and send, and a frame must be made well ahead
# of the link for its saving to count. At 1x, a shaped 4 Gbit/s link (target 0.46 GB/s,
# cores 0.39-0.96) flipped between on and off, and its compressed saves took 1.01-1.08 s
# against 0.92 s plain; at 2 Gbit/s (0.23 against 0.61) they took 1.55 s against 1.79
# (benchmarks/compress.py, 2026-12-03, docs/nfs.md section 12).
AUTO_MARGIN = 2.0


def check_mode(mode: Any) -> str | None:
    if mode not in MODES:
        raise ValueError(f"compress must be None, 'zstd' or 'auto', not {mode!r}")
    if mode == "zstd" and not _core.zstd_support()["usable"]:
        raise RuntimeError(f"compress='zstd': {_core.zstd_support()['error']}")
    return mode


def place_of(directory: str) -> str:
    """Where a save goes, for the rate table: the directory a checkpoint (or its
    temporary sibling, which is what the writer sees) lies in."""
    d = directory.rstrip("/")
    return os.path.dirname(d if "://" in d else os.path.abspath(d))


def core_gbps() -> float:
    """GB/s one copy thread compresses (probe once, then what saves measured)."""
    with _lock:
        if _core_gbps:
            return _core_gbps[0]
    sample = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    data = sample.view(torch.uint8).numpy()
    _, secs, _ = _core.codec_rate(data, 2, 1, 2)
    rate = data.nbytes / secs / 1e9
    with _lock:
        if not _core_gbps:
            _core_gbps.append(rate)
        return _core_gbps[0]


def decide(mode: str | None, directory: str, copy_threads: int, tuned_gbps: float | None = None) -> tuple[bool, str]:
    """(compress this save?, why), for SaveStats.compress."""
    if mode is None:
        return False, "off"
    if mode == "zstd":
        return True, "on"
    if not _core.zstd_support()["usable"]:
        return False, f"auto: off ({_core.zstd_support()['error']})"
    with _lock:
        link = _target_gbps.get(place_of(directory))
    src = "last save"
    if link is None and tuned_gbps:
        link, src = tuned_gbps, "saved tuning"
    if link is None:
        return False, "auto: off (target not measured yet)"
    cores = core_gbps() * max(1, copy_threads)
    on = link * AUTO_MARGIN < cores
    return on, (f"auto: {'on' if on else 'off'} (target {link:.2f} GB/s by {src}, cores compress {cores:.2f} GB/s"
                f"{'' if on else f', needs {AUTO_MARGIN:g}x the target'})")


def observe(directory: str, bytes_sent: int, durable_s: float, compressed: bool, raw_bytes: int,
            compress_s: float, copy_threads: int) -> None:
    """A save to directory is durable: remember the rate its target took bytes at."""
    if durable_s <= 0 or bytes_sent <= 0:
        return
    with _lock:
        if not compressed:  # a compressed save's seconds include compressing: not the link's
            _target_gbps[place_of(directory)] = bytes_sent / durable_s / 1e9
        elif compress_s > 0:
            _core_gbps[:] = [raw_bytes / compress_s / 1e9]  # compress_s: thread-seconds


def plane_runs(files: list[Any]) -> list[list[tuple[int, int]]]:
    """Per file, (offset, element width) runs of its tensors, for the native codec."""
    out = []
    for f in files:
        runs: list[tuple[int, int]] = []
        c = f.columns
        for j, off in sorted(zip(f.members, f.offsets), key=lambda t: t[1]):
            if not c.nbytes[j]:
                continue
            w = min(8, max(1, c.dtypes[j].itemsize))
            w = w if w in (1, 2, 4, 8) else 1
            if not runs or runs[-1][1] != w:
                runs.append((off, w))
        out.append(runs)
    return out


def refusal(incremental: bool, hf_model: bool, distributed: bool) -> str | None:
    """Why a save cannot be compressed, or None."""
    if incremental:
        return ("incremental saves with compression are not supported yet (links would mix plain and compressed "
                "stripes): pass incremental=False or compress=None")
    if hf_model:
        return "hf_model= writes plain safetensors for Hugging Face: it cannot be compressed (compress=None)"
    if distributed:
        return "multi-rank saves (process_group=) cannot be compressed yet (compress=None)"
    return None


def check_save(mode: str | None, incremental: bool, hf_model: bool, distributed: bool) -> None:
    """compress="zstd" on a save that cannot be compressed: a clear error ("auto" turns off)."""
    refused = refusal(incremental, hf_model, distributed) if mode == "zstd" else None
    if refused:
        raise ValueError(refused)
