"""nfs:// targets: checkpoints on an NFSv3 server, with no mount and no root.

``nfs://HOST[:PORT]/EXPORT/PATH[?connections=N&depth=D&timeout=S&mountport=P]``

- The export is found from the server's export list (MOUNT EXPORT through the
  portmapper): the longest exported prefix of the URL's path wins, and the rest is
  the path inside the export. NFSv3 names an export by its real path on the server.
- PORT (or ``nfsport=``) and ``mountport=`` skip the portmapper for those services;
  with ``mountport=`` the export is the longest prefix the server lets us mount.
- ``connections`` (default 4, or what ``flashwrite tune nfs://... --save`` measured
  for the export): TCP connections for bulk transfers, each with
  ``depth`` (default 16) WRITE or READ RPCs in flight; ``timeout`` (seconds,
  default 10): the longest wait for the server without progress before an
  operation fails with an error naming the server and the operation.

The transfers run in the native core (``_core.NfsClient``, csrc/io/nfs_*.cpp) on
libnfs, loaded at run time. A save stages and checksums its stripes exactly as a
local save does, into the staging pool, and sends each chunk from its pool slot
straight to the server with UNSTABLE WRITEs over the connections (no local copy);
a chunk's slot is reused only once a COMMIT of its stripe returned the verifier its
WRITEs did (a server restart between WRITE and COMMIT means the chunk is written
again). Then the index and the manifest (committed the same way), then the rename.
NFSv3 servers make directory operations stable before replying, so there is no
directory fsync. A load reads the manifest through the target (``Target.read_manifest``)
and the load job reads the stripes, by their paths on the server, over the connections
(``native_files()``) straight into its bounce slots and destinations (no local copy).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass

from .. import _core
from .nfs_reach import why_unreachable
from .target import Target, UnsupportedTargetError
from .tuning import config_dir

__all__ = ["NfsUrl", "parse_url", "NfsTarget", "target_for"]

DEFAULT_CONNECTIONS = 4
DEFAULT_DEPTH = 16
DEFAULT_TIMEOUT_S = 10.0
_QUERY_KEYS = {"connections", "depth", "timeout", "nfsport", "mountport"}
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")  # a name, IPv4, or IPv6 (unbracketed)


@dataclass(frozen=True)
class NfsUrl:
    server: str
    path: str                 # the path on the server (export + path inside it)
    nfs_port: int = 0
    mount_port: int = 0
    connections: int = DEFAULT_CONNECTIONS
    depth: int = DEFAULT_DEPTH
    timeout_s: float = DEFAULT_TIMEOUT_S
    explicit: frozenset = frozenset()  # the query parameters the URL gave


def parse_url(url: str) -> NfsUrl:
    """Split an nfs:// URL; a malformed one raises UnsupportedTargetError saying what is wrong."""
    def bad(why: str) -> UnsupportedTargetError:
        return UnsupportedTargetError(f"{url!r}: {why} (expected nfs://HOST[:PORT]/EXPORT/PATH"
                                      "[?connections=N&depth=D&timeout=S&mountport=P])", url=url, scheme="nfs")

    try:
        u = urllib.parse.urlsplit(url)
    except ValueError as e:  # "Invalid IPv6 URL": the URL's syntax, not a damaged checkpoint
        raise bad(str(e)) from None
    if u.scheme.lower() != "nfs":
        raise bad("not an nfs:// URL")
    if not u.hostname:
        raise bad("no server")
    if not _HOST_RE.fullmatch(u.hostname):
        raise bad(f"{u.hostname!r} is not a host name or address")
    path = os.path.normpath("/" + u.path.lstrip("/")) if u.path else "/"
    if path == "/":
        raise bad("no export path")
    q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
    unknown = set(q) - _QUERY_KEYS
    if unknown:
        raise bad(f"unknown parameter(s) {sorted(unknown)}; known: {sorted(_QUERY_KEYS)}")

    def num(key: str, default: float, cast=int, low: float = 1) -> float:
        if key not in q:
            return default
        try:
            v = cast(q[key][-1])
        except ValueError:
            raise bad(f"{key}={q[key][-1]!r} is not a number") from None
        if v < low:
            raise bad(f"{key} must be at least {low}")
        return v

    try:
        port = u.port or 0
    except ValueError:
        raise bad("bad port") from None
    return NfsUrl(server=u.hostname, path=path, nfs_port=int(num("nfsport", port)),
                  mount_port=int(num("mountport", 0)), connections=int(num("connections", DEFAULT_CONNECTIONS)),
                  depth=int(num("depth", DEFAULT_DEPTH)), timeout_s=float(num("timeout", DEFAULT_TIMEOUT_S, float, 0.1)),
                  explicit=frozenset(q))


def _require_libnfs(url: str, what: str) -> None:
    if not hasattr(_core, "NfsClient") or not _core.nfs_available():
        reason = _core.nfs_unavailable_reason() if hasattr(_core, "nfs_unavailable_reason") else "no NFS client"
        raise UnsupportedTargetError(f"{what}: {url!r} needs libnfs: {reason}", url=url, scheme="nfs")


def find_export(server: str, path: str, timeout_s: float) -> str:
    """The longest export of ``server`` that is ``path`` or a parent of it (the export
    list comes from the server's MOUNT service, found through its portmapper)."""
    exports = _core.nfs_exports(server, int(timeout_s * 1000))
    best = ""
    for e in exports:
        e = os.path.normpath(e)
        if (path == e or path.startswith(e.rstrip("/") + "/")) and len(e) > len(best):
            best = e
    if not best:
        raise FileNotFoundError(2, f"no export of {server} contains {path} (exports: {', '.join(exports) or 'none'}; "
                                "asked through its portmapper, which names one NFS server per host: if several "
                                "share it, give this one's ports, nfs://HOST:NFSPORT/PATH?mountport=MOUNTPORT)",
                                f"nfs://{server}{path}")
    return best


def _mount_longest(u: NfsUrl) -> tuple[str, NfsTarget]:
    """With mountport= the portmapper is not asked, so neither is the export list: the
    longest prefix of the path the server lets us mount is the export."""
    parts = u.path.rstrip("/").split("/")
    refused: OSError | None = None
    # Parents first, the path itself last: a server that mounts any directory inside an
    # export would otherwise make an existing checkpoint its own export, whose root
    # cannot be renamed (an overwrite failed with NFS3ERR_INVAL).
    for i in [*range(len(parts) - 1, 1, -1), len(parts)]:
        export = "/".join(parts[:i])
        try:
            return export, NfsTarget(u, export)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.ENOENT, errno.EPERM):
                raise
            refused = e
    raise FileNotFoundError(2, f"the server mounts no prefix of {u.path} ({refused})",
                            f"nfs://{u.server}:{u.mount_port}{u.path}")


class NfsTarget(Target):
    """Checkpoints in one export of one NFS server. Paths are inside the export ("/run/ck")."""

    name = "nfs"

    def __init__(self, url: NfsUrl, export: str):
        self.url = url
        self.export = export
        self.client = _core.NfsClient(url.server, export, nfs_port=url.nfs_port, mount_port=url.mount_port,
                                      connections=url.connections, depth=url.depth,
                                      timeout_ms=int(url.timeout_s * 1000))

    def show(self, path: str) -> str:
        """The URL of ``path`` (for messages, stats and ``ls``), with the mount port when
        the URL gave one: what it shows must reach the same server again."""
        url = self.client.url(path)
        return f"{url}?mountport={self.url.mount_port}" if self.url.mount_port else url

    def facts(self, path: str) -> dict:
        """The server, the export holding ``path`` and the path inside it, and the transfer
        settings saves and loads there use (``connections`` from the URL, a saved tuning, or
        the default)."""
        u = self.url
        return {**super().facts(path), "server": u.server, "export": self.export, "path": path,
                "nfs_port": u.nfs_port or None, "mount_port": u.mount_port or None, "connections": u.connections,
                "depth": u.depth, "timeout_s": u.timeout_s}

    def exists(self, path: str) -> bool:
        return self.client.stat(path)[0]

    def is_dir(self, path: str) -> bool:
        return self.client.stat(path)[1]

    def is_file(self, path: str) -> bool:
        exists, is_dir, _ = self.client.stat(path)
        return exists and not is_dir

    def list(self, path: str) -> list[str]:
        return self.client.listdir(path)

    def make_dirs(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        cur = ""
        for p in parts:
            cur += "/" + p
            exists, is_dir, _ = self.client.stat(cur)
            if not exists:
                try:
                    self.client.mkdir(cur)
                except FileExistsError:
                    pass
            elif not is_dir:
                raise NotADirectoryError(20, "not a directory", self.show(cur))

    def make_dir(self, path: str) -> None:
        self.client.mkdir(path)

    def rename(self, src: str, dst: str) -> None:
        self.client.rename(src, dst)

    def remove_file(self, path: str) -> None:
        self.client.unlink(path)

    def fsync_dir(self, path: str) -> None:
        pass  # NFSv3 makes CREATE, MKDIR, RENAME and REMOVE stable before it replies

    def remove_tree(self, path: str) -> None:
        try:
            exists, is_dir, _ = self.client.stat(path)
            if not exists:
                return
            if is_dir:
                for name in self.client.listdir(path):
                    self.remove_tree(f"{path}/{name}")
                self.client.rmdir(path)
            else:
                self.client.unlink(path)
        except OSError:
            pass  # best effort, as shutil.rmtree(ignore_errors=True)

    def write_durable(self, path: str, data: bytes) -> None:
        self.client.write_file(path, data, True)

    def link(self, src: str, dst: str) -> None:
        self.client.link(src, dst)  # NFSv3 makes LINK stable before it replies

    def read_at(self, path: str, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        n = self.client.read_into(path, buf, offset)
        return bytes(buf[:n])

    def file_size(self, path: str) -> int | None:
        exists, is_dir, size = self.client.stat(path)
        return size if exists and not is_dir else None

    def read_small(self, path: str, limit: int) -> bytes:
        exists, is_dir, size = self.client.stat(path)
        if not exists:
            raise FileNotFoundError(2, "no such file", self.show(path))
        if is_dir:
            raise ValueError(f"{self.show(path)} is not a regular file")
        if size > limit:  # checked before reading: no allocation sized by a hostile file
            raise ValueError(f"{self.show(path)} is larger than {limit} bytes")
        return self.read_at(path, 0, size)

    def native_files(self) -> object:
        """The NFS client: the save job sends each chunk from its staging slot straight to the
        server over its connections, committed before the slot is reused."""
        return self.client

    # ``flashwrite tune nfs://...`` (``ops/tune_nfs.py``): the connections are what is tuned.
    default_connections = DEFAULT_CONNECTIONS

    def tuning_store(self) -> str:
        """Where the tuned connections are kept."""
        return store_path()

    def save_tuning(self, connections: int, gbps: float | None) -> dict:
        """Store ``connections`` as this export's tuned value (what a URL of it without
        ``connections=`` then uses); the record stored, with its key."""
        key = tuning_key(self.url.server, self.url.nfs_port, self.export)
        try:
            with open(store_path()) as fh:
                store = json.load(fh)
            if not isinstance(store, dict):
                store = {}
        except (OSError, ValueError):
            store = {}
        rec = {"connections": int(connections), "gbps": gbps, "saved_unix": time.time()}
        store[key] = rec
        os.makedirs(os.path.dirname(store_path()), exist_ok=True)
        tmp = f"{store_path()}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(store, fh, indent=1)
        os.replace(tmp, store_path())
        forget_tunings()
        return {"key": key, **rec}

    def open_stripe(self, path: str, write: bool) -> int:
        raise UnsupportedTargetError(f"{self.show(path)}: stripes on nfs:// are sent by the NFS client, not opened",
                                     url=self.show(path), scheme="nfs")


_targets: dict[tuple, NfsTarget] = {}
_targets_lock = threading.Lock()


def tuning_key(server: str, nfs_port: int, export: str) -> str:
    return f"nfs://{server}{f':{nfs_port}' if nfs_port else ''}{export}"


_tunings: tuple[float, dict] | None = None


def store_path() -> str:
    """Where ``flashwrite tune nfs://... --save`` keeps its results (beside tunings.json)."""
    return os.path.join(config_dir(), "nfs-tunings.json")


def forget_tunings() -> None:
    global _tunings
    _tunings = None


def tuned_connections(server: str, nfs_port: int, path: str) -> int | None:
    """The connections ``flashwrite tune nfs://... --save`` stored for the export holding
    ``path`` on that server (the longest stored export that is a prefix of it), or None."""
    global _tunings
    try:
        mtime = os.stat(store_path()).st_mtime
    except OSError:
        return None
    if _tunings is None or _tunings[0] != mtime:
        try:
            with open(store_path()) as fh:
                raw = json.load(fh)
        except (OSError, ValueError):
            raw = {}
        _tunings = (mtime, raw if isinstance(raw, dict) else {})
    prefix = tuning_key(server, nfs_port, "")
    best, got = -1, None
    for key, rec in _tunings[1].items():
        if not key.startswith(prefix) or not isinstance(rec, dict):
            continue
        export = key[len(prefix):]
        c = rec.get("connections")
        if (path == export or path.startswith(export.rstrip("/") + "/")) and len(export) > best \
                and isinstance(c, int) and c >= 1:
            best, got = len(export), c
    return got


def target_for(url: str, what: str) -> tuple[NfsTarget, str]:
    """(the target serving ``url``, the path inside its export). Without ``connections=``
    in the URL, a saved tuning for the export (``flashwrite tune URL --save``) gives it,
    else DEFAULT_CONNECTIONS."""
    _require_libnfs(url, what)
    u = parse_url(url)
    if "connections" not in u.explicit:
        tuned = tuned_connections(u.server, u.nfs_port, u.path)
        if tuned is not None:
            u = dataclasses.replace(u, connections=tuned)
    key = (u.server, u.nfs_port, u.mount_port, u.connections, u.depth, u.timeout_s)
    with _targets_lock:
        cached = [(e, t) for (k, e), t in _targets.items() if k == key]
    try:
        export, t = _reach(u, cached)
    except OSError as e:
        # libnfs says "Connection refused" (or "mounts no prefix") for a name that does not
        # resolve and for a portmapper that lacks the server alike: say which it was.
        why = why_unreachable(u.server, u.nfs_port, u.mount_port, u.timeout_s)
        if why is None:
            raise
        raise why from e
    with _targets_lock:
        t = _targets.setdefault((key, export), t)
    return t, u.path[len(export):] or "/"


def _reach(u: NfsUrl, cached: list[tuple[str, NfsTarget]]) -> tuple[str, NfsTarget]:
    """(the export holding ``u.path``, its target): a cached one, or one connected now."""
    if u.mount_port:
        # The export list needs the portmapper; an explicit mount port means it is not asked.
        hits = [(e, t) for e, t in cached if u.path == e or u.path.startswith(e.rstrip("/") + "/")]
        return max(hits, key=lambda h: len(h[0])) if hits else _mount_longest(u)
    export = find_export(u.server, u.path, u.timeout_s)  # asked each time: exports come and go
    return export, dict(cached).get(export) or NfsTarget(u, export)


def forget(t: NfsTarget) -> None:
    """Drop a cached target (after its server failed), so the next call connects afresh."""
    with _targets_lock:
        for k, v in list(_targets.items()):
            if v is t:
                del _targets[k]
