"""The README's resume recipe: train, checkpoint, resume in a fresh process -> bit-identical."""

import json
import os
import subprocess
import sys

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


CHILD = os.path.join(os.path.dirname(_TESTS_FILE), "resume_child.py")


def _run(mode, path, n):
    r = subprocess.run([sys.executable, CHILD, mode, str(path), str(n)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    n = 7
    full = _run("full", tmp_path / "ck", n)
    resumed = _run("resume", tmp_path / "ck", n)
    assert len(full["losses"]) == n
    assert resumed["losses"] == full["losses"]  # every loss, to the last bit
    assert resumed["final"] == full["final"]  # every final parameter, to the last bit
    assert resumed["lr"] == full["lr"] and resumed["scale"] == full["scale"]
