"""Where a CheckpointManager's steps live: one directory per step under root.

``StepDirs`` names a step's directory (``name``, a pattern with one ``{step}``
field), lists the committed steps (a directory counts only under its exact name
and with its manifest in place), deletes a step so that a crash mid-deletion never
leaves something that looks like a checkpoint, and removes what crashed saves left.
Root is a local directory, or a directory in an nfs:// export (``target.py``).
"""

from __future__ import annotations

import logging
import os
import re
import string

from ..saving import commit
from ..format import MANIFEST_NAME
from ..targets.locate import resolve

log = logging.getLogger("flashwrite")

DEFAULT_NAME = "step-{step:08d}"


def _name_pattern(name: str) -> re.Pattern:
    """The regex that finds the step in directory names made by ``name.format(step=...)``:
    ``name`` must hold exactly one replacement field, ``{step}`` (with an optional integer
    format such as ``:08d``), and no path separator."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a format string such as 'checkpoint-{{step}}', not {type(name).__qualname__}")
    parts = list(string.Formatter().parse(name))
    fields = [(f, spec, conv) for _, f, spec, conv in parts if f is not None]
    if len(fields) != 1 or fields[0][0] != "step" or fields[0][2] is not None:
        raise ValueError(f"name {name!r} must hold one replacement field, {{step}} (e.g. 'checkpoint-{{step}}')")
    try:
        probe = name.format(step=12)
    except ValueError as e:
        raise ValueError(f"name {name!r}: {e}") from None
    if "/" in probe or probe.startswith("."):  # hidden names are those of temporary directories
        raise ValueError(f"name {name!r} must make plain, not hidden, directory names")
    out = []
    for literal, f, _, _ in parts:
        out.append(re.escape(literal))
        if f is not None:
            out.append(r"(\d+)")
    return re.compile("^" + "".join(out) + "$")


class StepDirs:
    """The step directories under one root."""

    def __init__(self, root: str | os.PathLike, name: str = DEFAULT_NAME):
        self.name_re = _name_pattern(name)
        self.name = name
        # root: a local directory, or for nfs:// the URL without its query, which path_for puts back.
        self.target, self.dir = resolve(root, "CheckpointManager root")
        self.query = ""
        self.local = self.target.scannable
        if self.local:
            self.root = self.dir
        else:
            url, _, query = os.fspath(root).partition("?")
            self.root, self.query = url.rstrip("/"), f"?{query}" if query else ""

    def path_for(self, step: int) -> str:
        """The checkpoint of ``step``, as save and load take it (a URL for nfs://)."""
        if self.local:
            return os.path.join(self.root, self.name.format(step=step))
        return f"{self.root}/{self.name.format(step=step)}{self.query}"

    def where(self, step: int) -> str:
        """The checkpoint of ``step`` as its Target names it."""
        return os.path.join(self.dir, self.name.format(step=step))

    def exists(self, step: int) -> bool:
        return self.target.exists(self.where(step))

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints under root, ascending."""
        steps = []
        try:
            names = self.target.list(self.dir)
        except FileNotFoundError:
            return []
        for name in names:
            m = self.name_re.match(name)
            if not m or self.name.format(step=int(m.group(1))) != name:
                continue
            path = os.path.join(self.dir, name)
            if self.target.is_dir(path) and self.target.is_file(os.path.join(path, MANIFEST_NAME)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def step_of(self, path: str) -> int | None:
        """The step whose checkpoint ``path`` is, or None (another root's, another name)."""
        if os.path.dirname(path) != self.root:
            return None
        m = self.name_re.match(os.path.basename(path))
        return int(m.group(1)) if m and self.path_for(int(m.group(1))) == path else None

    def delete(self, step: int) -> None:
        """Move the step aside, drop its manifest, then remove it."""
        path = self.where(step)
        doomed = commit.old_dir_for(path)
        self.target.rename(path, doomed)
        self.target.fsync_dir(self.dir)
        # Without its manifest the moved directory can never be taken for (or
        # restored as) a checkpoint, whatever state a crash leaves it in.
        self.target.remove_file(os.path.join(doomed, MANIFEST_NAME))
        self.target.remove_tree(doomed)
        log.info("removed checkpoint step %d (retention)", step)

    def clean_stale(self) -> list[str]:
        """Remove temporary directories of crashed saves and deletions (see ``commit.clean_stale``).
        On nfs:// the owner of one cannot be told alive from dead (another host's pid): left alone."""
        return commit.clean_stale(self.root) if self.local else []
