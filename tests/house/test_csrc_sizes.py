"""Small rooms in the native core (issue 24, item 6): no file under csrc/ over 500
lines, no function body over 80. Function bodies are found by matching braces in the
source with comments and string literals blanked out: a `{` whose head (the text since
the last `;`, `{` or `}`) has a parameter list and is not a control statement, class or
namespace opens a function; lambdas and blocks inside it count toward it."""

import pathlib
import re
import os

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


CSRC = pathlib.Path(_TESTS_FILE).resolve().parents[1] / "csrc"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _blank(src: str) -> str:
    """The source with comments and string/char literals emptied, line breaks kept."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.index("*/", i + 2)
            out.append("\n" * src.count("\n", i, j))
            i = j + 2
        elif src.startswith('R"', i):
            delim = re.match(r'R"([^(]*)\(', src[i:]).group(1)
            j = src.index(")" + delim + '"', i)
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + len(delim) + 2
        elif src[i] in "\"'" and not (src[i] == "'" and i and src[i - 1].isalnum()):  # 1'000 separators
            quote, j = src[i], i + 1
            while src[j] != quote:
                j += 2 if src[j] == "\\" else 1
            out.append(quote * 2)
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def function_lengths(src: str):
    """(first line, lines, head) of each outermost function body."""
    text, stack, last, line = _blank(src), [], 0, 1
    for i, ch in enumerate(text):
        if ch == "\n":
            line += 1
        elif ch == "{":
            head = text[last:i].strip()
            tail = head.split("\n")[-1].strip()
            is_fn = (")" in head and not re.match(r"^\}?\s*(if|for|while|switch|catch|do|else|try)\b", tail)
                     and not re.search(r"\b(class|struct|namespace|enum|union)\b", head))
            stack.append((is_fn, line, " ".join(head.split())[-100:]))
            last = i + 1
        elif ch == "}":
            if stack:
                is_fn, start, head = stack.pop()
                if is_fn and not any(f for f, _, _ in stack):
                    yield start, line - start + 1, head
            last = i + 1
        elif ch == ";":
            last = i + 1


def _sources():
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cpp", ".hpp", ".inc"):
            yield path


def test_no_native_file_is_over_500_lines():
    big = {p.relative_to(CSRC).as_posix(): n for p in _sources()
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big, f"split these by job: {big}"


def test_no_native_function_is_over_80_lines():
    long = [f"{p.relative_to(CSRC)}:{start} ({n} lines) {head}" for p in _sources()
            for start, n, head in function_lengths(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_the_scanner_sees_functions_lambdas_and_literals():
    body = "\n".join(f"  x += {i};" for i in range(81))
    src = ('// a } in a comment\nstatic const char* s = "{ not a body";\n'
           f"namespace fw {{\nint f(int x) {{\n  auto g = [&] {{ return '}}'; }};\n{body}\n  return x;\n}}\n"
           "struct S { void m() { if (true) { } } };\n}\n")
    found = list(function_lengths(src))
    assert [(start, n) for start, n, _ in found] == [(4, 85), (89, 1)], found
