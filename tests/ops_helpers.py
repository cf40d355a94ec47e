"""Shared by tests/test_ops_*.py: a small training state, checkpoints of it, and
running the ``flashwrite`` command in-process with its exit code and output."""

from __future__ import annotations

import torch

import flashwrite as fw
from flashwrite.ops.main import main


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w, "b": torch.zeros(32, dtype=torch.bfloat16), "c": torch.randn(3, generator=g).to(torch.complex64),
                  "i": torch.arange(10, dtype=torch.int64), "empty": torch.empty(0, 4)},
        "tied": w,
        "optim": {"step": 7, "lr": 0.1, "betas": (0.9, 0.99), "name": "adam", "none": None},
    }


def save(path: str, sd: dict | None = None, **kw) -> str:
    fw.save(sd if sd is not None else state(), path, **kw)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout, stderr of ``flashwrite argv``; usage errors exit via SystemExit(2)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return rc, out, err
