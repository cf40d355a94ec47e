"""benchmarks/gpu_check.py, the script for the day a GPU is lent (issue 27, item 6),
starts and ends cleanly without one: it runs its CPU-only checks (fork() beside a
reserved pool), says that the GPU measurements were skipped and exits 0."""

import json
import os
import shutil
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


def test_gpu_check_keeps_its_results_and_exits_when_over_budget(tmp_path):
    # A budget far too short: the watchdog ends the run (exit 3) and the JSON written
    # after each phase is there, saying so, instead of a hang or nothing.
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--no-build", "--skip-tests",
                        "--budget", "0.5", "--dir", str(tmp_path / "ck"), "--json", str(out)], capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 3, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["budget_s"] == 0.5 and "still running after" in res["killed_by_budget"], res


def test_gpu_check_sizes_its_state_from_free_disk_and_memory(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    free_disk = shutil.disk_usage(tmp_path).free
    gib = gpu_check.auto_gib(str(tmp_path), gpu_free=2 << 30)
    assert 0.25 <= gib <= 1.0  # half of the GPU's 2 GiB free, at most
    assert gib * 2**30 <= max(free_disk / 4, 0.25 * 2**30)
