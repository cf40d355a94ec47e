"""The package reads top-down: no module imports, directly or through others, a module
that imports it back. Every import counts, including those inside functions (a loop
hidden in a function is still a loop, only a later-failing one); nothing under
python/flashwrite imports the peers that the benchmarks compare against."""

from __future__ import annotations

import ast
import os

import flashwrite

PKG_DIR = os.path.dirname(flashwrite.__file__)
PEERS = ("deepspeed", "torch_checkpointing")


def _modules(pkg_dir: str = PKG_DIR) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(pkg_dir):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(pkg_dir))[:-3]
                parts = rel.split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, known: set[str]) -> tuple[set[str], set[str]]:
    """(package modules that ``name`` imports, top-level names of everything it imports)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    deps, tops = set(), set()
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from . import x` names module x
        for t in targets:
            tops.add(t.split(".")[0])
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a submodule needs its package: not a loop
                deps.add(t)
    return deps, tops


def import_graph(pkg_dir: str = PKG_DIR) -> dict[str, set[str]]:
    mods = _modules(pkg_dir)
    return {n: _imports(n, p, set(mods))[0] for n, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_loop():
    graph = import_graph()
    assert "flashwrite.save" in graph and "flashwrite.distributed" in graph["flashwrite.save"]
    assert _cycles(graph) == []


def test_the_walker_sees_a_loop_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\n\ndef f():\n    return b.g()\n")
    (pkg / "b.py").write_text("def g():\n    from .sub.c import h\n    return h()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def h():\n    from ..a import f\n    return f\n")
    graph = import_graph(str(pkg))
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_the_library_imports_no_peer():
    mods = _modules()
    offenders = {n: sorted(set(PEERS) & _imports(n, p, set(mods))[1]) for n, p in mods.items()}
    assert {n: v for n, v in offenders.items() if v} == {}


def test_bench_from_a_checkout_finds_the_peer_adapters():
    from flashwrite.bench import peers

    checkout = os.path.join(os.path.dirname(os.path.dirname(PKG_DIR)), "benchmarks", "peers.py")
    if not os.path.isfile(checkout):
        import pytest
        pytest.skip("not a source checkout")
    found = peers.contenders()
    assert {"dcp_async_staged", "torch_checkpointing", "deepspeed"} <= set(found)
    assert list(found)[-1] == "flashwrite" and peers.default_contenders() == list(found)


def test_bench_never_runs_a_peers_file_from_the_current_directory(tmp_path, monkeypatch):
    """A peers.py in the caller's working directory is not the package's to run."""
    from flashwrite.bench import peers

    (tmp_path / "benchmarks").mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "benchmarks" / "peers.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLASHWRITE_PEERS_FILE", raising=False)
    installed = tmp_path / "venv" / "lib" / "site-packages" / "flashwrite" / "bench" / "peers.py"
    monkeypatch.setattr(peers, "__file__", str(installed))   # as from a wheel: no checkout around it
    peers.external.cache_clear()
    try:
        assert peers.external() is None
    finally:
        peers.external.cache_clear()
    assert not marker.exists()


if __name__ == "__main__":  # print the graph (of the package dir given, or this one), one module a line
    import sys

    g = import_graph(sys.argv[1] if len(sys.argv) > 1 else PKG_DIR)
    print("loops:", _cycles(g))
    for mod, deps in sorted(g.items()):
        print(mod, "->", ", ".join(sorted(d.removeprefix("flashwrite.") for d in deps)))
