"""The names of a checkpoint's temporary siblings: made and read here only.

Three kinds, all ``.<name><mark>...`` beside the checkpoint ``<name>``:

- ``.<name>.flashwrite-tmp-<pid>-<random>[-h<host>]``: a save by one process (the pid, on
  the host ``<host>`` tags, tells whether it may be alive; older names have no tag);
- ``.<name>.flashwrite-tmp-<nonce>-s<seq>``: a multi-rank save (the name every rank derives alike);
- ``.<name>.flashwrite-old-<random>``: a checkpoint moved aside to be replaced or deleted.

A leftover temporary directory is recognisable by its name and never mistaken for a
checkpoint: saving makes these names, commit and the operator's tools sweep them, and the
incremental planner skips them when it looks for a base.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from dataclasses import dataclass

TMP_MARK = ".flashwrite-tmp-"
OLD_MARK = ".flashwrite-old-"


_SHARED_RE = re.compile(r"[0-9a-f]{12}-s\d+")
_PID_RE = re.compile(r"(\d+)-")
_HOST_RE = re.compile(r".*-h([0-9a-f]{8})")


def _host_tag() -> str:
    """This machine, since its last boot, in 8 hex digits: the kernel's boot id (two hosts,
    or one host before and after a reboot, never share one), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            key = fh.read().strip()
    except OSError:
        key = socket.gethostname()
    return hashlib.sha1(key.encode()).hexdigest()[:8]


HOST_TAG = _host_tag()


def _sibling(final: str, mark: str, tail: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{mark}{tail}")


def temp_dir_for(final: str) -> str:
    """A fresh temporary sibling of ``final`` for a save by this process."""
    return _sibling(final, TMP_MARK, f"{os.getpid()}-{uuid.uuid4().hex[:12]}-h{HOST_TAG}")


def shared_temp_dir_for(final: str, nonce: str, seq: int) -> str:
    """The temporary sibling of ``final`` that every rank of a multi-rank save derives
    alike from its group's ``nonce`` (12 hex digits) and the save's sequence number."""
    return _sibling(final, TMP_MARK, f"{nonce}-s{seq}")


def old_dir_for(final: str) -> str:
    """A fresh name to move the checkpoint ``final`` aside to before it is replaced or deleted."""
    return _sibling(final, OLD_MARK, uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class TempName:
    kind: str          # "tmp" (a save's directory) or "old" (a checkpoint moved aside)
    original: str      # the name of the checkpoint it belongs to
    pid: int | None    # the process that made a "tmp" directory, where the name says
    host: str | None = None  # the host tag of that process (HOST_TAG), where the name says


def parse_temp_name(name: str) -> TempName | None:
    """What a directory entry named ``name`` is, or None if it is not one of ours."""
    if not name.startswith("."):
        return None
    for kind, mark in (("tmp", TMP_MARK), ("old", OLD_MARK)):
        at = name.find(mark)
        if at >= 0:
            rest = name[at + len(mark):]
            pid = host = None
            if kind == "tmp" and not _SHARED_RE.fullmatch(rest):
                m = _PID_RE.match(rest)
                pid = int(m.group(1)) if m else None
                h = _HOST_RE.fullmatch(rest)
                host = h.group(1) if h else None
            return TempName(kind, name[1:at], pid, host)
    return None


def is_temp_name(name: str) -> bool:
    return parse_temp_name(name) is not None
