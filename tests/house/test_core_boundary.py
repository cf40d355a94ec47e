"""The native boundary is typed and its defaults live in one place (issue 10, part 4):
_core.pyi names everything _core exports, and the defaults Python uses, the binding's
own default arguments and csrc/core/defaults.hpp agree."""

import ast
import inspect
import os
import pathlib
import re

import flashwrite
from flashwrite import _core, defaults

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


PKG = os.path.dirname(flashwrite.__file__)
STUB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(_TESTS_FILE))), "python", "flashwrite", "_core.pyi")


def _stub():
    tree = ast.parse(pathlib.Path(STUB).read_text())
    top, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        if isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    return top, classes


def test_stub_names_every_export_and_nothing_else():
    top, classes = _stub()
    public = {n for n in dir(_core) if not n.startswith("_")} | {"__version__"}
    missing = public - top
    assert not missing, f"_core.pyi lacks {sorted(missing)}"
    for cls in ("Engine", "SaveJob", "LoadJob", "Buffer", "WalkResult", "SnapshotMapping"):
        native = {n for n in dir(getattr(_core, cls)) if not n.startswith("_")}
        assert native <= classes[cls], f"_core.pyi {cls} lacks {sorted(native - classes[cls])}"
        stubbed = {n for n in classes[cls] if not n.startswith("_")}
        assert stubbed <= native, f"_core.pyi {cls} names {sorted(stubbed - native)} that _core lacks"
    exported_functions = {n for n in public if callable(getattr(_core, n)) and not inspect.isclass(getattr(_core, n))}
    assert exported_functions <= top


def test_stub_and_py_typed_ship_with_the_package():
    assert os.path.exists(os.path.join(PKG, "py.typed")) or os.path.exists(STUB.replace("_core.pyi", "py.typed"))


def test_python_defaults_come_from_the_native_header():
    d = _core.DEFAULTS
    assert defaults.STRIPES == d["stripes"]
    assert defaults.CHUNK_BYTES == d["chunk_bytes"]
    assert defaults.WRITE_QUEUE_DEPTH == d["write_queue_depth"]
    assert defaults.READ_QUEUE_DEPTH == d["read_queue_depth"]
    assert defaults.READ_CHUNK_BYTES == d["read_chunk_bytes"]
    header = pathlib.Path(STUB).parents[2].joinpath("csrc", "core", "defaults.hpp").read_text()
    assert re.search(r"kWriteQueueDepth = (\d+);", header).group(1) == str(d["write_queue_depth"])


def test_binding_default_arguments_use_the_header():
    d = _core.DEFAULTS
    save_sig = _core.Engine.start_save.__doc__.splitlines()[0]
    assert f"queue_depth: typing.SupportsInt | typing.SupportsIndex = {d['write_queue_depth']}" in save_sig or \
        f"queue_depth: int = {d['write_queue_depth']}" in save_sig, save_sig
    load_sig = _core.start_load.__doc__.splitlines()[0]
    assert re.search(rf"queue_depth: [^=]+= {d['read_queue_depth']},", load_sig), load_sig
    assert re.search(rf"chunk_bytes: [^=]+= {d['read_chunk_bytes']},", load_sig), load_sig
    assert re.search(rf"copy_threads: [^=]+= {d['copy_threads']},", save_sig), save_sig
    assert re.search(rf"verify_threads: [^=]+= {d['verify_threads']},", load_sig), load_sig


def test_csrc_layers_include_only_downwards():
    # core <- io, shim <- stage <- write, read <- engine <- python (bindings).
    csrc = pathlib.Path(STUB).parents[2] / "csrc"
    allowed = {"core": {"core"}, "io": {"core", "io"}, "shim": {"core", "shim"},
               "stage": {"core", "io", "shim", "stage"}, "write": {"core", "io", "shim", "stage", "write"},
               "read": {"core", "io", "shim", "stage", "read"},
               "engine": {"core", "io", "shim", "stage", "write", "read", "engine"}}
    for f in csrc.rglob("*.[ch]pp"):
        layer = f.parent.name
        if layer not in allowed:
            continue
        for inc in re.findall(r'#include "([a-z_]+)/', f.read_text()):
            assert inc in allowed[layer], f"{f.relative_to(csrc)} includes from {inc}/"
