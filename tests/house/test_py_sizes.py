"""Small rooms in the Python package (issue 24, item 6): no module under python/flashwrite
over 500 lines, no function (method, nested function) over 80, counted by ast as
end_lineno - lineno + 1 (a function's own lines include those of the functions inside it)."""

import ast
import pathlib

import flashwrite

PKG = pathlib.Path(flashwrite.__file__).resolve().parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def function_lengths(src: str, filename: str = "<src>"):
    """(qualified name, first line, lines) of every function and method in ``src``."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(src, filename), "")
    return out


def _modules():
    return sorted(PKG.rglob("*.py"))


def test_no_module_is_over_500_lines():
    big = {p.relative_to(PKG).as_posix(): n for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"split these by job: {big}"


def test_no_function_is_over_80_lines():
    long = [f"{p.relative_to(PKG)}:{start} {name} ({n} lines)" for p in _modules()
            for name, start, n in function_lengths(p.read_text(), str(p)) if n > MAX_FUNCTION_LINES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_counter_sees_methods_nested_functions_and_their_full_length():
    body = "\n".join(f"        x += {i}" for i in range(78))
    src = (f"class C:\n    def m(self, x):\n        def inner():\n            return 1\n{body}\n        return x\n\n\n"
           "async def g():\n    pass\n")
    assert function_lengths(src) == [("C.m", 2, 82), ("C.m.inner", 3, 2), ("g", 86, 2)]
