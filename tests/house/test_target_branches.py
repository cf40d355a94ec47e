"""No code outside ``targets/`` asks which kind of target a path names (issue 36, item 2).

Callers ask a ``Target`` what it can do (``os_paths``, ``holds_local_snapshots``,
``scannable``, ``tunes_writer``, ``native_files()``...) instead. Counted here, in
``python/flashwrite`` outside ``targets/``: calls of ``url_scheme``, comparisons with ``LOCAL`` (``is``, ``==``),
imports of ``targets.nfs``, and string constants that name the scheme (``"nfs"``,
``"nfs://"``; docstrings and help texts, which name it for users, are sentences and do
not count)."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "flashwrite"
SKIP = ("targets",)

# file (relative to python/flashwrite) -> (how many, why it stays)
ALLOWED: dict[str, tuple[int, str]] = {
    "saving/write.py": (1, "SaveStats.extra's nfs_rewrites (public output) is reported for the native job whose "
                           "backend is named 'nfs'"),
    "system/info.py": (1, "backend_info()'s 'nfs' key (public output: whether nfs:// works here)"),
}


def _branches(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "url_scheme":
                found.append(f"{line}: url_scheme()")
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                names = [x for x in (node.left, right) if isinstance(x, ast.Name) and x.id == "LOCAL"]
                if names and isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)):
                    found.append(f"{line}: compared with LOCAL")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.endswith("targets.nfs") or mod == "targets.nfs" or (
                    mod.endswith("targets") and any(a.name == "nfs" for a in node.names)):
                found.append(f"{line}: imports targets.nfs")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.lower().rstrip(":/") == "nfs":
                found.append(f"{line}: the string {node.value!r}")
    return found


def count() -> dict[str, list[str]]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.split("/", 1)[0] in SKIP:
            continue
        hits = _branches(path)
        if hits:
            out[rel] = hits
    return out


def test_no_branches_on_the_kind_of_target():
    found = count()
    extra = {f: hits for f, hits in found.items() if len(hits) > ALLOWED.get(f, (0, ""))[0]}
    assert not extra, ("code outside targets/ asks which kind of target it has; ask the Target a capability "
                       f"instead (targets/target.py): {extra}")


def test_allowlist_is_not_stale():
    found = count()
    stale = {f: n for f, (n, _) in ALLOWED.items() if len(found.get(f, [])) < n}
    assert not stale, f"lower these allowances (the branches are gone): {stale}"


if __name__ == "__main__":
    for f, hits in count().items():
        print(f, len(hits), hits)
    print("total", sum(len(h) for h in count().values()))
