"""The suite's disk guard (tests/disk_guard.py): one runaway test fails alone, and the
suite goes on. Run in an inner pytest session with a small limit."""
import os
import textwrap
from xml.etree import ElementTree

import pytest

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


RUNAWAY = textwrap.dedent('''
    import multiprocessing, os, subprocess, sys, warnings

    def _forked():
        # multiprocessing's fork server and resource tracker: started once, shared by later tests
        p = multiprocessing.get_context("forkserver").Process(target=os.getpid)
        p.start()
        p.join(60)
        return p.exitcode

    def test_runaway_in_process(tmp_path):
        assert _forked() == 0
        buf = os.urandom(1 << 20)
        with open(tmp_path / "f", "wb") as f:
            for _ in range(20_000):          # 20 GB if nothing stopped it
                f.write(buf)
                f.flush()

    def test_runaway_child(tmp_path):
        code = ("import os, sys\\nb = os.urandom(1 << 20)\\nf = open(sys.argv[1], 'wb')\\n"
                "for _ in range(20_000):\\n    f.write(b); f.flush()\\nprint('child wrote it all')")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "g")], capture_output=True, text=True,
                             timeout=120)
        assert "child wrote it all" not in out.stdout

    def test_small_one_after(tmp_path):
        (tmp_path / "small").write_bytes(b"x" * 4096)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "resource_tracker: process died unexpectedly" fails it
            assert _forked() == 0
''')


def test_guard_fails_only_the_runaway_tests(pytester):
    pytester.makepyfile(test_runaway=RUNAWAY)
    base = pytester.path / "base"
    junit = pytester.path / "inner.xml"
    res = pytester.runpytest_subprocess("-p", "disk_guard", f"--basetemp={base}", "-v", "-p", "no:cacheprovider",
                                        "-o", "timeout=120", f"--junitxml={junit}")
    out = res.stdout.str()
    res.assert_outcomes(failed=2, passed=1)
    # Each test's own report, not a count over the whole output (pytest 9.2 repeats a
    # failure's first line in the short summary, earlier versions do not).
    failures = {case.get("name"): "".join(f.get("message", "") + (f.text or "") for f in case.iter("failure"))
                for case in ElementTree.parse(junit).getroot().iter("testcase")}
    assert set(failures) == {"test_runaway_in_process", "test_runaway_child", "test_small_one_after"}, failures
    for name in ("test_runaway_in_process", "test_runaway_child"):
        assert "past the limit of 0.06 GiB" in failures[name], (name, out)
        assert "DiskGuardExceeded" in failures[name], (name, out)
    assert failures["test_small_one_after"] == "", out
    assert "test_small_one_after PASSED" in out, out
    assert list(base.iterdir()) == [], f"the guard leaves no test directory behind: {list(base.iterdir())}"
    assert "disk guard: peak use" in out


@pytest.fixture(autouse=True)
def _small_limit(monkeypatch, pytester):
    monkeypatch.setenv("FLASHWRITE_TEST_DISK_LIMIT", "64M")
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(_TESTS_FILE))   # where disk_guard.py lives
