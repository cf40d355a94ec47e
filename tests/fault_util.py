"""Helpers for the fault tests: deterministic states, real mounts, stale-dir checks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

import pytest
import torch

from flashwrite import commit

_BASES: dict[int, torch.Tensor] = {}


def _base(n: int) -> torch.Tensor:
    if n not in _BASES:
        _BASES[n] = torch.randn(n, generator=torch.Generator().manual_seed(1234))
    return _BASES[n]


def make_state(step: int, n: int = 1 << 18) -> dict:
    """A training-like state that differs in every byte-carrying tensor from step to
    step, rebuilt identically by any process (so a reader can check what a killed
    writer saved)."""
    b = _base(n)
    return {
        "model": {
            "w": b + step,
            "h": (b[: n // 4] * (step + 1)).to(torch.bfloat16),
            "idx": torch.arange(1000, dtype=torch.int64) * step,
        },
        "optim": {"state": {0: {"exp_avg": b[: n // 8] - step}},
                  "param_groups": [{"lr": 1e-3 * (step + 1), "betas": (0.9, 0.999)}]},
        "step": step,
    }


def state_bytes(n: int = 1 << 18) -> int:
    return n * 4 + (n // 4) * 2 + 1000 * 8 + (n // 8) * 4


def temp_entries(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if commit.is_temp_name(e))


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount, loop devices, chattr)")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(mountpoint: str, size: str):
    """A fresh tmpfs of ``size`` (e.g. "8m") mounted at ``mountpoint``."""
    need_root()
    os.makedirs(mountpoint, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", mountpoint)
    if r.returncode:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if _run("umount", mountpoint).returncode:
            _run("umount", "-l", mountpoint)


@contextlib.contextmanager
def loop_ext4(mountpoint: str, size_mb: int, *, extents: bool = True):
    """A loop-mounted ext4 image. Without extents the kernel refuses fallocate, so
    running out of space shows up in the middle of a write instead of up front."""
    need_root()
    image = f"{mountpoint}.img"
    os.makedirs(mountpoint, exist_ok=True)
    with open(image, "wb") as fh:
        fh.truncate(size_mb << 20)
    try:
        opts = [] if extents else ["-O", "^extent,^64bit,^flex_bg"]
        r = _run("mkfs.ext4", "-q", "-F", "-m", "0", *opts, image)
        if r.returncode:
            pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
        r = _run("mount", "-o", "loop", image, mountpoint)
        if r.returncode:
            pytest.skip(f"cannot loop-mount ext4: {r.stderr.strip()}")
        try:
            yield mountpoint
        finally:
            if _run("umount", mountpoint).returncode:
                _run("umount", "-l", mountpoint)
    finally:
        os.unlink(image)


def fill(directory: str, leave_bytes: int) -> str:
    """Create a ballast file leaving about ``leave_bytes`` free; returns its path."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    path = os.path.join(directory, f"ballast-{uuid.uuid4().hex[:8]}")
    want = max(0, free - leave_bytes)
    with open(path, "wb") as fh:
        chunk = b"\xa5" * (1 << 20)
        while want > 0:
            n = min(want, len(chunk))
            fh.write(chunk[:n])
            want -= n
        fh.flush()
        os.fsync(fh.fileno())
    return path


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
