"""A save still in flight when the interpreter exits is completed, not dropped: the commit
thread is joined at shutdown, so the checkpoint is committed whole (or, failing, the
Trainer integration reports it at exit)."""

import os
import subprocess
import sys
import textwrap

import torch
from conftest import assert_same

import flashwrite as fw

_CHILD = textwrap.dedent("""
    import sys, threading, time, torch, flashwrite as fw
    w = fw.Writer(stripes=2, chunk_bytes=1 << 20)
    gate = threading.Event()
    w._committer().submit(gate.wait)          # the commit thread is busy: this save stays in flight
    threading.Timer(1.0, gate.set).start()
    g = torch.Generator().manual_seed(0)
    fut = w.save_async({"w": torch.randn(1 << 20, generator=g), "step": 7}, sys.argv[1])
    assert not fut.done()
    print("exiting with the save in flight", flush=True)
""")


def test_a_save_in_flight_at_exit_is_committed(tmp_path):
    ck = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-c", _CHILD, str(ck)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "in flight" in p.stdout
    fw.verify(ck)
    g = torch.Generator().manual_seed(0)
    assert_same(fw.load(ck), {"w": torch.randn(1 << 20, generator=g), "step": 7})
    assert os.listdir(tmp_path) == ["ck"]  # no temporary directory left
