"""The wheel carries what training nodes run (issue 36, item 4): no benchmark harness
or peer contender in the package (they live in a source checkout's benchmarks/), and
the libraries only the ``flashwrite`` command uses are imported only by the command."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile

import flashwrite

PKG_DIR = os.path.dirname(flashwrite.__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/house/ -> the checkout
BUILD_WHEELS = os.path.join(REPO, "tools", "build_wheels.sh")
# What only the command draws with (tables, bars, charts): never loaded by `import flashwrite`.
CLI_ONLY = ("rich", "tqdm", "matplotlib")


def _top_level_imports(path: str) -> set[str]:
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def _package_files() -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(PKG_DIR) for f in fs if f.endswith(".py")]


def test_the_package_holds_no_benchmark_harness():
    assert not os.path.exists(os.path.join(PKG_DIR, "bench")), "the harness lives in benchmarks/harness/"
    offenders = {os.path.relpath(p, PKG_DIR): sorted(_top_level_imports(p) & {"harness", "benchmarks", "peers"})
                 for p in _package_files()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_the_command_imports_the_cli_libraries():
    offenders = {os.path.relpath(p, PKG_DIR): sorted(_top_level_imports(p) & set(CLI_ONLY)) for p in _package_files()
                 if os.path.relpath(p, PKG_DIR).split(os.sep)[0] != "ops"}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_import_flashwrite_loads_no_cli_library():
    """In a fresh interpreter: what ``import flashwrite`` adds to what ``import torch``
    already loaded (torch itself brings tqdm) holds no CLI library and no ops/ module."""
    code = ("import sys, torch\nbefore = set(sys.modules)\nimport flashwrite\n"
            "new = set(sys.modules) - before\n"
            f"print(sorted(m for m in new if m.split('.')[0] in {CLI_ONLY!r} or m.startswith('flashwrite.ops')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def _wheel_check() -> str:
    """The Python check of the wheel's file list, as tools/build_wheels.sh runs it."""
    with open(BUILD_WHEELS) as fh:
        sh = fh.read()
    m = re.search(r'python3 - "\$WHEEL" "\$SDIST" <<\'EOF\'\n(.*?)\nEOF\n', sh, re.S)
    assert m, "tools/build_wheels.sh no longer checks the wheel's file list in a heredoc"
    return m.group(1)


def _fake_wheel(path, names: list[str]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, "")
    return str(path)


def test_the_wheel_check_refuses_a_benchmark_harness(tmp_path):
    check = tmp_path / "check.py"
    check.write_text(_wheel_check())
    base = ["flashwrite/__init__.py", "flashwrite/ops/demo.py", "flashwrite-0.dist-info/METADATA"]

    def run(names):
        wheel = _fake_wheel(tmp_path / f"w{len(names)}.whl", names)
        return subprocess.run([sys.executable, str(check), wheel, "x.tar.gz"], capture_output=True, text=True,
                              timeout=60)

    for extra in ("flashwrite/bench/peers.py", "flashwrite/harness/runner.py"):
        r = run(base + [extra])
        assert r.returncode != 0 and "benchmark harness" in r.stderr and extra in r.stderr, r.stderr
    r = run(base)  # the same wheel without it fails later, for what a fake wheel lacks
    assert r.returncode != 0 and "benchmark harness" not in r.stderr and "lacks" in r.stderr, r.stderr
