"""The package reads top-down: no module imports, directly or through others, a module
that imports it back. Every import counts, including those inside functions (a loop
hidden in a function is still a loop, only a later-failing one); nothing under
python/flashwrite imports the peers that the benchmarks compare against."""

from __future__ import annotations

import ast
import os

import flashwrite

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


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
    assert "flashwrite.saving.save" in graph and "flashwrite.saving.distributed" in graph["flashwrite.saving.save"]
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


# --------------------------------------------------------------------------- private names

def _package_of(name: str, path: str) -> str:
    return name if path.endswith("__init__.py") else name.rpartition(".")[0]


def _absolute(name: str, path: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(name, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def private_reads(pkg_dir: str = PKG_DIR) -> list[str]:
    """Where a module reads another package module's underscore-prefixed name: ``mod._x``
    (mod an imported package module), ``from .mod import _x``, or ``getattr(obj, "_x")``
    (a private field reached by name, whoever owns it). A name that is itself a module
    (``_core``, the native engine) is a module, not a private name."""
    mods = _modules(pkg_dir)
    root = os.path.basename(pkg_dir)
    native = {f"{root}._core"}
    out = []
    for name, path in sorted(mods.items()):
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _absolute(name, path, node)
                if mod.split(".")[0] != root:
                    continue
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    if full in mods or full in native:
                        aliases[a.asname or a.name] = full
                    elif _is_private(a.name) and mod != name:
                        out.append(f"{name}:{node.lineno}: from {mod} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr)
                    and aliases.get(node.value.id, name) != name):
                out.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
                  and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
                out.append(f"{name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return sorted(out)


def imports_in_functions(pkg_dir: str = PKG_DIR) -> list[tuple[str, int, bool]]:
    """(module, line, has a reason comment) of every package import inside a function."""
    mods = _modules(pkg_dir)
    root = os.path.basename(pkg_dir)
    out = []
    for name, path in sorted(mods.items()):
        with open(path) as fh:
            src = fh.read()
        lines = src.splitlines()
        seen = set()
        for fn in ast.walk(ast.parse(src, path)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in seen:
                    continue
                if isinstance(node, ast.ImportFrom):
                    ours = _absolute(name, path, node).split(".")[0] == root
                elif isinstance(node, ast.Import):
                    ours = any(a.name.split(".")[0] == root for a in node.names)
                else:
                    continue
                if ours:
                    seen.add(node.lineno)
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    out.append((name, node.lineno, "#" in here or above.startswith("#")))
    return out


def test_no_module_reads_another_modules_private_names():
    assert private_reads() == []


def test_few_package_imports_hide_in_functions_and_each_says_why():
    found = imports_in_functions()
    assert len(found) <= 5, found
    assert [f for f in found if not f[2]] == []


def test_the_private_walker_sees_each_kind_of_reach_through(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\nshown = 2\n\ndef _f():\n    return _hidden\n")
    (pkg / "b.py").write_text("from . import a\nfrom .a import _f, shown\n\n\ndef g(w):\n"
                              "    return a._hidden + a.shown + getattr(w, '_local') + _f()\n")
    (pkg / "c.py").write_text("def h():\n    from . import a\n    return a.shown\n\n\n"
                              "def k():\n    # the reason, said\n    from .a import shown\n    return shown\n")
    assert private_reads(str(pkg)) == ["pkg.b:2: from pkg.a import _f", "pkg.b:6: a._hidden",
                                       "pkg.b:6: getattr(..., '_local')"]
    assert imports_in_functions(str(pkg)) == [("pkg.c", 2, False), ("pkg.c", 8, True)]


def folder_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Which folder of the package imports which other folder (a module at the top, the
    package's face, is no folder: every folder may use the face, and the face hands
    every folder's public names on)."""
    graph = import_graph() if graph is None else graph
    root = os.path.basename(PKG_DIR)

    def folder(mod: str) -> str | None:
        parts = mod.split(".")
        if len(parts) < 2 or parts[0] != root:
            return None
        sub = os.path.join(PKG_DIR, parts[1])
        return parts[1] if os.path.isdir(sub) else None

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = folder(mod)
        if a is None:
            continue
        for d in deps:
            b = folder(d)
            if b is not None and b != a:
                out.setdefault(a, set()).add(b)
    return out


def test_no_two_folders_import_each_other():
    """The folders stand in floors: a folder never imports one that imports it back
    (saving calls incremental and loading, never the reverse; see CONTRIBUTING.md)."""
    folders = folder_graph()
    assert "incremental" in folders["saving"] and "layout" in folders["incremental"]
    mutual = sorted((a, b) for a, bs in folders.items() for b in bs if a < b and a in folders.get(b, ()))
    assert mutual == []


# A namedtuple's own API, and reads inside the module that owns the object's class.
_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make"}
_OWN_MODULE = {("flashwrite.future", "fut._run"): "launch_load and LoadFuture are one module's"}


def private_attribute_reads(pkg_dir: str = PKG_DIR) -> list[str]:
    """Where code reaches into another object's private state: ``obj._x`` with ``obj`` a
    name other than ``self``/``cls`` and other than an imported module (``private_reads``
    covers those). ``super()._x`` (a framework's hook being overridden) is no reach-through."""
    mods = _modules(pkg_dir)
    out = []
    for name, path in sorted(mods.items()):
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or node.attr in _PUBLIC_UNDERSCORE:
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not isinstance(root, ast.Name) or root.id in modules:
                continue  # super()._hook, or a module's name (private_reads' job)
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # an object's own state
            what = ast.unparse(node)
            if (name, what) not in _OWN_MODULE:
                out.append(f"{name}:{node.lineno}: {what}")
    return out


def test_no_object_reaches_into_anothers_private_state():
    """Public hooks instead (``SaveFuture.start``, ``Writer.closed``, the Trainer mixin's
    ``reserve_checkpoint_memory``/``close_checkpoints``, ``Preemption.enter_call``)."""
    assert private_attribute_reads() == []


def test_the_attribute_walker_sees_a_reach_through(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef f(w, t):\n    return w._state, os._exit, t._replace(), super()._x\n\n\n"
                              "class C:\n    def g(self):\n        return self._own, self.other._theirs\n")
    assert private_attribute_reads(str(pkg)) == ["pkg.a:5: w._state", "pkg.a:10: self.other._theirs"]


if __name__ == "__main__":  # print the graph (of the package dir given, or this one), one module a line
    import sys

    g = import_graph(sys.argv[1] if len(sys.argv) > 1 else PKG_DIR)
    print("loops:", _cycles(g))
    for mod, deps in sorted(g.items()):
        print(mod, "->", ", ".join(sorted(d.removeprefix("flashwrite.") for d in deps)))
