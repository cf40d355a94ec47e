"""The shared-memory boards of read-once loads (loading/shm_exchange.py) do not outlive
their process: a rank killed holding its board (kill -9, the OOM killer) leaves a file
in /dev/shm, which is memory, and the next board made on the host removes it; a live
rank's board is never taken, however old."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from flashwrite.loading import shm_exchange

MAKE = """
import os, sys
from flashwrite.loading import shm_exchange as s
b = s.Board(0, [[("a", 3 << 20, 0), ("b", 5, 7)]])
assert b.ok
print(b.path, flush=True)
sys.stdin.readline()
"""


def _holder() -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", MAKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    path = p.stdout.readline().strip()
    assert path.startswith(os.path.join(shm_exchange.SHM_DIR, shm_exchange.PREFIX)), path
    return p, path


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)  # reaped, its pipes closed


@pytest.mark.skipif(not os.path.isdir(shm_exchange.SHM_DIR), reason="no /dev/shm on this host")
def test_a_board_left_by_a_killed_rank_is_removed_and_a_live_ones_kept(monkeypatch, caplog):
    live, live_path = _holder()
    dead, dead_path = _holder()
    try:
        _kill(dead)
        assert os.path.exists(dead_path)  # what kill -9 leaves
        assert os.path.getsize(dead_path) >= (3 << 20)
        # Young files are their maker's to lock: left alone.
        assert shm_exchange.sweep() == 0 and os.path.exists(dead_path)
        monkeypatch.setattr(shm_exchange, "STALE_AFTER_S", 0.0)
        with caplog.at_level("WARNING", logger="flashwrite"):
            freed = shm_exchange.sweep()
        assert not os.path.exists(dead_path)
        assert freed >= (3 << 20)
        assert dead_path in caplog.text and "died" in caplog.text
        assert os.path.exists(live_path)  # its process holds the lock
        # A new board sweeps first.
        dead2, dead2_path = _holder()
        _kill(dead2)
        mine = shm_exchange.Board(0, [[("x", 4096, 0)]])
        try:
            assert mine.ok and os.path.exists(mine.path)
            assert not os.path.exists(dead2_path) and os.path.exists(live_path)
            assert shm_exchange.sweep() == 0 and os.path.exists(mine.path)  # this process holds it
        finally:
            mine.remove()
            mine.remove()  # idempotent
        assert not os.path.exists(mine.path)
    finally:
        live.communicate("\n", timeout=30)
    assert live.returncode == 0
    assert os.path.exists(live_path)  # a clean exit without remove() leaves it too ...
    shm_exchange.sweep()
    assert not os.path.exists(live_path)  # ... and the next sweep takes it
