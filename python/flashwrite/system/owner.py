"""Which process wrote something, and whether it still runs: ``this_owner()`` records
pid, start time and host; ``owner_alive()`` tells the owner from a recycled pid."""

from __future__ import annotations

import os
import socket
from typing import Any

from .. import _core

_CORE_FILE = os.path.basename(_core.__file__ or "_core")


def process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (fields[0] is the state,
    fields[19] the start time in clock ticks), or None when no live process has that pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return None if not fields or fields[0] in ("Z", "X") else fields


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it is not running."""
    fields = process_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) >= 20 else None


def boot_time() -> float | None:
    """When this machine booted (Unix time, 1 s resolution), or None where /proc cannot say."""
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def may_run_flashwrite(pid: int) -> bool:
    """Whether process ``pid`` may be a flashwrite process: its memory maps name the native
    module, or cannot be read (another user's process, /proc mounted hidepid): unknown
    counts as maybe."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return any(_CORE_FILE in line for line in fh)
    except OSError:
        return True


def this_owner() -> dict:
    pid = os.getpid()
    return {"pid": pid, "start": start_ticks(pid), "host": socket.gethostname()}


def owner_alive(owner: Any, *, started_by: float | None = None) -> bool:
    """Whether the process ``owner`` names (a dict as ``this_owner`` makes; at least its
    "pid") still runs. A recycled pid is told apart by the start time the owner recorded
    or, where it has none, by ``started_by``: the owner started no later than that (Unix
    time). Where neither can tell, a live pid counts as the owner. Another host's owner
    counts as alive: not ours to judge."""
    if not isinstance(owner, dict) or type(owner.get("pid")) is not int:
        return False
    if owner.get("host") not in (None, socket.gethostname()):
        return True
    fields = process_stat(owner["pid"])
    if fields is None:
        return False
    if len(fields) < 20:
        return True  # cannot tell: keep it
    ticks = int(fields[19])
    if owner.get("start") is not None:
        return ticks == owner["start"]
    btime = boot_time() if started_by is not None else None
    if btime is None:
        return True
    return btime + ticks / os.sysconf("SC_CLK_TCK") <= started_by
