"""benchmarks/gpu_check.py, the script for the day a GPU is lent (issue 27, item 6),
starts and ends cleanly without one: it runs its CPU-only checks (fork() beside a
reserved pool), says that the GPU measurements were skipped and exits 0."""

import json
import os
import subprocess
import sys

import pytest
import torch

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(_TESTS_FILE)))


def test_gpu_check_runs_its_cpu_parts_and_skips_cleanly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: gpu_check.py would measure it (minutes)")
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--no-build", "--skip-tests",
                        "--dir", str(tmp_path / "ck"), "--json", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU measurements skipped" in r.stdout and "gpu_check: OK" in r.stdout
    res = json.loads(out.read_text())
    fork = res["cpu_fork"]
    assert fork["child_exit"] == 0 and fork["ok"] is True
    assert fork["dont_fork_bytes"] >= fork["pool_bytes"] >= 256 << 20
    assert not os.path.exists(tmp_path / "ck")  # cleaned up
