"""NUMA placement of a staging pool backed by a file (local snapshots in /dev/shm; issue 37,
item 3). tmpfs allocates a file's pages at fallocate by the file's shared policy, which
mbind on a shared mapping sets: the policy must be set before fallocate, or the pages come
from whatever node the allocating thread ran on. Checked by the order of the system calls
(strace), since a one-node machine places every page on node 0 either way."""

import os
import re
import shutil
import subprocess
import sys

import pytest

_SCRIPT = ("import sys; from flashwrite import _core; e = _core.Engine(1 << 20); "
           "e.set_backing_file(sys.argv[1]); e.reserve(8 << 20); assert e.file_backed, e.backing_error")


def test_file_backed_slab_gets_its_numa_policy_before_its_pages(tmp_path):
    strace = shutil.which("strace")
    if not strace:
        pytest.skip("strace is not installed")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    pool = os.path.join(shm, f"fw-numa-test-{os.getpid()}")
    log = str(tmp_path / "trace")
    env = {**os.environ, "FLASHWRITE_STAGING_NUMA_NODE": "0"}
    env.pop("FLASHWRITE_CUDA_RUNTIME", None)
    try:
        r = subprocess.run([strace, "-f", "-e", "trace=mbind,fallocate", "-o", log, sys.executable, "-c", _SCRIPT,
                            pool], env=env, capture_output=True, text=True, timeout=120)
    finally:
        if os.path.exists(pool):
            os.unlink(pool)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    # The pool's 8 MiB slab only (the allocator mbinds arenas of its own, with no node mask).
    pat = re.compile(r"\b(mbind)\(0x[0-9a-f]+, 8388608, MPOL_PREFERRED, \[|\b(fallocate)\(\d+, 0, 0, 8388608\)")
    with open(log) as f:
        calls = [m.group(1) or m.group(2) for line in f if (m := pat.search(line))]
    assert "fallocate" in calls and "mbind" in calls, calls
    assert calls.index("mbind") < calls.index("fallocate"), calls
