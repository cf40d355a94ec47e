"""benchmarks/compare.py (once `flashwrite bench`) runs peer adapters only from the
benchmarks/peers.py beside it or a file named with --peers: never a peers.py (or any
other module) found in the caller's current directory or in the benchmark's --dir
(issue 24, item 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness_paths import COMPARE


def _trap(folder, name: str, marker) -> None:
    """A module that, if anything imports or runs it, leaves ``marker`` behind."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text({name!r})\n")


def _bench(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "FLASHWRITE_PEERS_FILE"}
    return subprocess.run([sys.executable, COMPARE, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


MY_PEERS = '''
from harness.peers import TorchSave


class Mine(TorchSave):
    key = "mine"
    name = "mine (from --peers)"


def contenders(dcp_threads):
    return [Mine()]
'''


@pytest.fixture
def trapped(tmp_path):
    """A working directory and a bench --dir, each holding modules that must never run."""
    marker = tmp_path / "ran"
    cwd, bench_dir = tmp_path / "cwd", tmp_path / "benchdir"
    for name in ("peers.py", "benchmarks/peers.py"):
        _trap(cwd, name, marker)
    # Modules the workers import after start-up (they would be found first were a worker's
    # cwd this directory; it runs in a fresh folder inside it). Not in cwd: `python -m`
    # puts cwd on this test's own command's path.
    for name in ("peers.py", "benchmarks/peers.py", "json.py", "platform.py"):
        _trap(bench_dir, name, marker)
    return cwd, bench_dir, marker


def test_bench_lists_only_the_peers_file_it_is_given(tmp_path, trapped):
    cwd, bench_dir, marker = trapped
    mine = tmp_path / "my_peers.py"
    mine.write_text(MY_PEERS)
    p = _bench("--contenders", "nope", "--peers", str(mine), "--dir", str(bench_dir), cwd=cwd)
    assert p.returncode == 2, p.stderr
    assert "unknown contender(s) nope" in p.stderr and "mine" in p.stderr.split("choose from")[1]
    assert not marker.exists(), marker.read_text()


def test_bench_refuses_a_peers_file_that_is_not_there(tmp_path, trapped):
    cwd, bench_dir, marker = trapped
    p = _bench("--contenders", "flashwrite", "--peers", str(tmp_path / "absent.py"), "--dir", str(bench_dir),
               cwd=cwd)
    assert p.returncode != 0 and "absent.py: not a file" in p.stderr
    assert not marker.exists(), marker.read_text()


@pytest.mark.slow  # README suite budget (issue 36): the slow job in CI runs it
def test_bench_workers_run_the_named_peers_and_nothing_from_cwd_or_dir(tmp_path, trapped):
    """The subprocess workers (one per contender and round) take the adapters from
    --peers too, and import nothing from the benchmark directory they write into."""
    cwd, bench_dir, marker = trapped
    mine = tmp_path / "my_peers.py"
    mine.write_text(MY_PEERS)
    out = tmp_path / "res.json"
    p = _bench("--size", "1MiB", "--contenders", "mine", "--peers", str(mine), "--dir", str(bench_dir),
               "--no-load", "--device-tool", "probe", "--no-drop-caches", "--json", str(out), "--plain", "-q",
               cwd=cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not marker.exists(), marker.read_text()
    rows = {r["key"]: r for r in json.loads(out.read_text())["comparison"]["rows"]}
    assert rows["mine"]["status"] == "ok", rows["mine"]
    assert rows["mine"]["name"] == "mine (from --peers)"
    assert rows["mine"]["durable_s"] > 0
