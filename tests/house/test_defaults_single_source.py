"""One rule per default (issue 24, item 7): csrc/core/defaults.hpp holds every tuned
default, Python reads it as _core.DEFAULTS (named by flashwrite/defaults.py), and no
module restates one: no alias of a default, no literal where a default belongs, and
no second copy of the rule that sizes thread counts by the CPU count."""

import ast
import inspect
import os
import pathlib
import subprocess
import sys

import flashwrite
from flashwrite import _core, defaults

PKG = pathlib.Path(flashwrite.__file__).parent
# A parameter, keyword or constant of one of these names holding the number DEFAULTS
# holds for it restates that default (take it from flashwrite.defaults instead).
DEFAULT_KEYS = {"stripes": ["stripes"], "chunk_bytes": ["chunk_bytes", "read_chunk_bytes"],
                "read_chunk_bytes": ["read_chunk_bytes"], "queue_depth": ["write_queue_depth", "read_queue_depth"],
                "write_queue_depth": ["write_queue_depth"], "read_queue_depth": ["read_queue_depth"],
                "gather_tensor_bytes": ["gather_tensor_bytes"], "gather_run_bytes": ["gather_run_bytes"]}
# These follow the CPU count: no number is ever their default.
CPU_FOLLOWERS = {"copy_threads", "verify_threads"}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        if path.name != "defaults.py":
            yield path, ast.parse(path.read_text(), str(path))


def _number(node):
    """The int a constant expression spells (16 << 20, 4), else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Mult, ast.Pow)):
            left, right = _number(node.left), _number(node.right)
            if left is not None and right is not None:
                return eval(compile(ast.Expression(node), "<default>", "eval"))  # constants only
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_defaults_ref(node):
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in ("defaults", "_defaults"))


def test_no_module_aliases_a_default():
    aliases = []
    for path, tree in _modules():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_defaults_ref(node.value):
                aliases.append(f"{path.relative_to(PKG)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "defaults" and any(a.asname for a in node.names):
                aliases.append(f"{path.relative_to(PKG)}:{node.lineno} (from .defaults import ... as ...)")
    assert not aliases, f"a default restated under another name (use defaults.X where it is needed): {aliases}"


def test_no_parameter_or_constant_restates_a_default_number():
    restated = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                positional = a.posonlyargs + a.args
                pairs += zip([p.arg for p in positional[len(positional) - len(a.defaults):]], a.defaults)
                pairs += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            elif isinstance(node, ast.Assign):
                pairs += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                pairs.append((node.target.id, node.value))  # dataclass fields too
            elif isinstance(node, ast.Call):
                pairs += [(k.arg, k.value) for k in node.keywords if k.arg]
            for name, value in pairs:
                bare, number = name.lower().removeprefix("default_").lstrip("_"), _number(value)
                if number is not None and (bare in CPU_FOLLOWERS or
                                           any(number == _core.DEFAULTS[k] for k in DEFAULT_KEYS.get(bare, ()))):
                    restated.append(f"{path.relative_to(PKG)}:{value.lineno} {name}={ast.unparse(value)}")
    assert not restated, f"a tuned default written as a number (take it from flashwrite.defaults): {restated}"


def test_the_cpu_count_rule_is_not_restated():
    # min(N, cpus): the rule lives in defaults.hpp (cpu_threads); the demo and tune may
    # count CPUs to report them (or to size a memcpy), but not to size the library's threads.
    copies = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
                inner = ast.unparse(node)
                if "sched_getaffinity" in inner or "cpu_count" in inner:
                    copies.append(f"{path.relative_to(PKG)}:{node.lineno} {inner}")
    assert not copies, f"a thread count sized by the CPU count outside defaults.hpp: {copies}"


def test_public_signatures_take_their_defaults_from_DEFAULTS():
    from flashwrite.loading import load as load_mod
    from flashwrite.loading import read
    from flashwrite.integrations.dcp import FlashwriteStorageReader

    d = _core.DEFAULTS
    for f in (flashwrite.load, read.read_tensors, load_mod.load_rank, FlashwriteStorageReader.__init__):
        assert inspect.signature(f).parameters["queue_depth"].default == d["read_queue_depth"], f
    w = flashwrite.Writer()
    try:
        assert (w.stripes, w.queue_depth, w.chunk_bytes, w.copy_threads) == \
            (d["stripes"], d["write_queue_depth"], d["chunk_bytes"], d["copy_threads"])
    finally:
        w.close()
    assert defaults.COPY_THREADS == d["copy_threads"] and defaults.VERIFY_THREADS == d["verify_threads"]


def test_thread_defaults_follow_the_cpus_this_process_may_use():
    # A process bound to one CPU gets one copy thread and one verify thread, from the
    # native rule; Writer and the binding's own default agree with it.
    child = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "import flashwrite as fw; from flashwrite import _core\n"
        "d = _core.DEFAULTS; w = fw.Writer()\n"
        "sig = _core.Engine.start_save.__doc__.splitlines()[0]\n"
        "print(d['copy_threads'], d['verify_threads'], w.copy_threads, 'copy_threads: int = 1,' in sig or "
        "'copy_threads: typing.SupportsInt | typing.SupportsIndex = 1,' in sig)\n"
        "w.close()\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "True"]
    cpus = len(os.sched_getaffinity(0))
    d = _core.DEFAULTS
    assert 1 <= d["copy_threads"] <= cpus and 1 <= d["verify_threads"] <= cpus
    assert d["copy_threads"] >= d["verify_threads"]
