"""Helpers for the fault tests: deterministic states, real mounts, stale-dir checks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

import pytest
import torch

from flashwrite.saving import commit

_BASES: dict[int, torch.Tensor] = {}


def flip_byte(path, offset: int, mask: int = 0x01) -> None:
    """Damage one byte of a file in place: XOR the byte at ``offset`` with ``mask``."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ mask]))


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
def mounted(mountpoint: str, *mount_args: str, what: str):
    """``mount *mount_args mountpoint`` for the duration (root; skips the test if the
    mount is refused), unmounted afterwards."""
    need_root()
    os.makedirs(mountpoint, exist_ok=True)
    r = _run("mount", *mount_args, mountpoint)
    if r.returncode:
        pytest.skip(f"cannot mount {what}: {r.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if _run("umount", mountpoint).returncode:
            _run("umount", "-l", mountpoint)


@contextlib.contextmanager
def tmpfs(mountpoint: str, size: str):
    """A fresh tmpfs of ``size`` (e.g. "8m") mounted at ``mountpoint``."""
    with mounted(mountpoint, "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", what="tmpfs") as m:
        yield m


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
        with mounted(mountpoint, "-o", "loop", image, what="a loop ext4") as m:
            yield m
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


class Zygote:
    """Client of ``fault_child.py zygote``: forks victims, reads their phase lines."""

    def __init__(self, log_path: str):
        import queue
        import sys
        import threading

        here = os.path.dirname(os.path.abspath(__file__))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, os.path.join(here, "fault_child.py"), "zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, bufsize=0)
        self.lines: queue.Queue = queue.Queue()
        self.log_path = log_path
        self.victim: int | None = None
        self._early: list = []

        def pump():
            for raw in self.proc.stdout:
                self.lines.put(raw.decode().split())
            self.lines.put(None)

        self._reader = threading.Thread(target=pump, daemon=True)
        self._reader.start()

    def start(self, **req) -> int:
        import json

        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        early = []  # the victim may print before the zygote reports the fork
        while True:
            line = self.next(timeout=60)
            assert line is not None, "the zygote did not fork"
            if line[0] == "forked":
                self.victim = int(line[1])
                self._early.extend(early)
                return self.victim
            early.append(line)

    def next(self, timeout: float | None = None) -> list[str] | None:
        """The next line (split), or None on timeout. Raises if the zygote died."""
        import queue

        if self._early:
            return self._early.pop(0)
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            raise RuntimeError(f"the zygote exited; see {self.log_path}: {self.log_tail()}")
        if line[0] == "exit":
            self.victim = None
        return line

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-n:]

    def close(self) -> None:
        import signal

        if self.victim is not None:  # a test failed with a victim still paused
            try:
                os.kill(self.victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            self._reader.join(5)
            self._log.close()


def kill_at_random(code: str, rng, trials: int):
    """Run ``python -c code`` once to the end (a base for later runs, and the time one run
    takes), then ``trials`` times more, each killed with SIGKILL at a random moment within
    that time. Yields after each trial whether it was killed mid-run; the caller then
    checks what the victim left."""
    import signal
    import sys
    import time
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    window = time.monotonic() - t0
    for _ in range(trials):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, max(0.4, window)))
        killed = p.poll() is None
        if killed:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        yield killed
