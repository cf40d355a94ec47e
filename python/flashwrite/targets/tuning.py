"""Saved tunings: the Writer settings ``flashwrite tune --save`` measured as best
for one file system, and the lookup that lets ``Writer()`` use them.

Tunings are kept in ``$FLASHWRITE_CONFIG_DIR/tunings.json`` (default:
``$XDG_CONFIG_HOME/flashwrite`` or ``~/.config/flashwrite``), keyed by the mount's
source and mount point (``server:/export@/mnt/ckpt``, ``/dev/nvme0n1p2@/``), which
stay the same across reboots and remounts, unlike the st_dev number of an NFS mount.

A setting passed explicitly always wins; a saved tuning fills in the rest; the
built-in defaults (``defaults.py``) fill in what no tuning names.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from .. import defaults
from .target import url_scheme

SETTINGS = ("stripes", "queue_depth", "chunk_bytes")
_BUILTIN = {"stripes": defaults.STRIPES, "queue_depth": defaults.WRITE_QUEUE_DEPTH,
            "chunk_bytes": defaults.CHUNK_BYTES}
_cache: dict[str, tuple[float, dict]] = {}
_lock = threading.Lock()


def config_dir() -> str:
    d = os.environ.get("FLASHWRITE_CONFIG_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "flashwrite")


def store_path() -> str:
    return os.path.join(config_dir(), "tunings.json")


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def mount_of(path: str | os.PathLike) -> dict[str, str]:
    """{mount_point, source, fstype, device (major:minor), key} of the file system holding path."""
    p = os.path.realpath(os.fspath(path))
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)  # a checkpoint path that does not exist yet: its nearest existing parent
    best: dict[str, str] = {"mount_point": "/", "source": "?", "fstype": "?", "device": "?"}
    try:
        with open("/proc/self/mountinfo") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    best_len = -1
    for line in lines:
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 2:
            continue
        mp = _unescape(f[4])
        inside = p == mp or p.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= best_len:  # later lines over-mount earlier ones
            best_len = len(mp)
            best = {"mount_point": mp, "source": _unescape(r[1]), "fstype": r[0], "device": f[2]}
    best["key"] = f"{best['source']}@{best['mount_point']}"
    return best


def load_store() -> dict:
    path = store_path()
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return {"version": 1, "filesystems": {}}
    with _lock:
        hit = _cache.get(path)
        if hit and hit[0] == mtime:
            return hit[1]
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict) or not isinstance(raw.get("filesystems"), dict):
        raw = {"version": 1, "filesystems": {}}
    with _lock:
        _cache[path] = (mtime, raw)
    return raw


def _valid(entry: Any) -> dict[str, int] | None:
    if not isinstance(entry, dict):
        return None
    out = {}
    for k in SETTINGS:
        v = entry.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return None
        out[k] = v
    if out["chunk_bytes"] % 4096 or out["chunk_bytes"] > 1 << 30:
        return None
    return out


def saved_for(path: str | os.PathLike) -> tuple[dict[str, int], dict] | None:
    """(settings, record) of the saved tuning for the file system holding path, or None."""
    m = mount_of(path)
    entry = load_store()["filesystems"].get(m["key"])
    settings = _valid(entry)
    return (settings, entry) if settings else None


def save_tuning(path: str | os.PathLike, settings: dict[str, int], extra: dict | None = None) -> dict:
    """Store settings for the file system holding path; returns the stored record."""
    if _valid(settings) is None:
        raise ValueError(f"not a valid tuning: {settings}")
    m = mount_of(path)
    store = dict(load_store())
    fss = dict(store.get("filesystems", {}))
    rec = {**{k: int(settings[k]) for k in SETTINGS}, "mount_point": m["mount_point"], "source": m["source"],
           "fstype": m["fstype"], "device": m["device"], "measured_in": os.path.abspath(os.fspath(path)),
           "saved_unix": time.time(), **(extra or {})}
    fss[m["key"]] = rec
    store.update(version=1, filesystems=fss)
    os.makedirs(config_dir(), exist_ok=True)
    tmp = f"{store_path()}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(store, fh, indent=1)
    os.replace(tmp, store_path())
    return rec


def resolve(path: str | os.PathLike | None, explicit: dict[str, Any]) -> dict[str, Any]:
    """The settings a save to path uses and where each came from:
    {"stripes": 8, ..., "source": {"stripes": "explicit" | "tuned" | "default"}, "tuning": key or None}."""
    given = {k: v for k, v in explicit.items() if k in SETTINGS and v is not None}
    # A URL (nfs://) names no local file system: no saved tuning is its (looking it up as
    # a path would find the current directory's).
    local = path is not None and url_scheme(os.fspath(path)) is None
    saved = saved_for(path) if local and len(given) < len(SETTINGS) else None
    out: dict[str, Any] = {}
    src: dict[str, str] = {}
    for k in SETTINGS:
        if k in given:
            out[k], src[k] = given[k], "explicit"
        elif saved:
            out[k], src[k] = saved[0][k], "tuned"
        else:
            out[k], src[k] = _BUILTIN[k], "default"
    out["source"] = src
    out["tuning"] = None
    if saved:
        rec = saved[1]
        out["tuning"] = {"key": f"{rec.get('source')}@{rec.get('mount_point')}", "file": store_path(),
                         "saved_unix": rec.get("saved_unix")}
    return out
