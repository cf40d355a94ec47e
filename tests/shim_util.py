"""LD_PRELOAD shims built from tests/*.c at test time, and children that run under them.

A preload is always appended to an existing LD_PRELOAD (CI runs some tests with
libasan preloaded, which must stay first)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def build_shim(name: str, out_dir) -> str:
    """Compile tests/<name>.c into <out_dir>/<name>.so with the system cc (skip without one)."""
    lib = os.path.join(os.fspath(out_dir), f"{name}.so")
    if not os.path.exists(lib):
        try:
            cc = subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", lib, os.path.join(HERE, f"{name}.c"), "-ldl"],
                                capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no C compiler (cc) for the LD_PRELOAD shim")
        if cc.returncode:
            pytest.skip(f"no C compiler for the shim {name}: {cc.stderr[:300]}")
    return lib


def preload_env(*libs: str, **extra: str) -> dict:
    env = dict(os.environ, **extra)
    env["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), *libs]))
    return env


def run_child(code: str, env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r
