"""Target: where a checkpoint lives, and the one place that tells a URL from a path.

Every entry point (save, load, verify, the manager, the DCP writer and reader, the
operator commands) passes the user's path through ``locate`` (or ``resolve``,
``kind_of``, ``local_path``) first, once. A string shaped like a URL (``scheme://...``) is never taken for a local
path: ``fw.save(state, "nfs://server/export/ck")`` must not quietly create a
directory named ``nfs:`` under the current directory.

``Target`` is the small set of operations a save, a commit and a clean-up need
from the place a checkpoint lives: create, list, rename, fsync, remove and open
stripe files. ``LocalTarget`` (a directory of a local or kernel-mounted file
system) is its first implementation; ``commit`` goes through it. ``nfs.NfsTarget``
(an NFSv3 export reached with the native NFS client) is the second; ``locate.resolve``
picks one for a path. Callers outside this folder ask a target its capabilities
(``os_paths``, ``scannable``, ``native_files()``...), never which kind it is.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from typing import Any

from .. import _core
from ..errors import CorruptCheckpointError, FlashwriteError
from ..format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest, read_manifest

__all__ = ["UnsupportedTargetError", "url_scheme", "local_path", "check_path", "shown", "unsupported", "Target",
           "LocalTarget", "LOCAL"]

# RFC 3986 scheme, then "://". "C:\\x" or "a:b" are not URLs; "nfs://h/e" and "s3://b/k" are.
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class UnsupportedTargetError(FlashwriteError, ValueError):
    """A path names a place flashwrite cannot read or write (a URL scheme it does not handle).

    ``url`` is the path as given, ``scheme`` its scheme."""

    def __init__(self, message: str, *, url: str, scheme: str):
        super().__init__(message)
        self.url = url
        self.scheme = scheme


def url_scheme(path: Any) -> str | None:
    """The lower-case scheme of ``path`` if it is shaped like a URL, else None."""
    try:
        s = os.fspath(path)
    except TypeError:
        return None
    if isinstance(s, bytes):
        s = s.decode("utf-8", "surrogateescape")
    m = _URL_RE.match(s)
    return m.group(1).lower() if m else None


def _refusal(path: str, scheme: str, what: str) -> UnsupportedTargetError:
    if scheme == "nfs":
        msg = (f"{what}: {path!r}: nfs:// targets are not supported here yet (fw.save, fw.save_async, "
               "Writer.save, fw.load, fw.load_async, fw.verify, CheckpointManager, the DCP writer and reader and "
               "the flashwrite commands take them). Mount the export "
               "(mount -t nfs -o vers=3,nconnect=16 SERVER:/EXPORT /mnt/ck) and pass the mounted path.")
    elif scheme == "file":
        msg = f"{what}: {path!r} is a file:// URL; pass the local path itself (without 'file://')."
    else:
        msg = (f"{what}: {path!r} is a {scheme}:// URL, which flashwrite does not support; "
               "it reads and writes local (or kernel-mounted) paths and nfs:// URLs.")
    return UnsupportedTargetError(msg, url=path, scheme=scheme)


def local_path(path: str | os.PathLike, what: str) -> str:
    """``os.fspath(path)``, after making sure it is not a URL: a URL raises
    ``UnsupportedTargetError`` naming ``what`` (the operation, e.g. "save")."""
    s = os.fspath(path)
    scheme = url_scheme(s)
    if scheme is not None:
        raise _refusal(s if isinstance(s, str) else repr(s), scheme, what)
    return s


def check_path(path: str | os.PathLike, what: str) -> str:
    """``os.fspath(path)`` if it is a local path or an nfs:// URL; other URLs raise."""
    s = os.fspath(path)
    if url_scheme(s) == "nfs":
        return s
    return local_path(s, what)


def unsupported(message: str, path: str | os.PathLike) -> UnsupportedTargetError:
    """The refusal ``message`` of what the target ``path`` names cannot do (its scheme attached)."""
    s = os.fspath(path)
    return UnsupportedTargetError(message, url=s, scheme=url_scheme(s) or "")


def shown(path: str | os.PathLike) -> str:
    """How a user's path is reported back: a URL as given, a local path made absolute."""
    s = os.fspath(path)
    return s if url_scheme(s) is not None else os.path.abspath(s)


class Target:
    """Where checkpoints live: the operations save, commit and clean-up use.

    Paths are the target's own (absolute) names; errors are ``OSError`` subclasses
    that carry errno and the path."""

    name = "abstract"
    # Capabilities: what callers ask instead of which kind of target this is.
    # Whether this process may judge a save's temporary directory here dead by its
    # name (pid and host) and remove it: see ``commit.clean_dead_saves``.
    sweeps_dead_saves = False
    # Whether its paths are this machine's own (open(2) takes them): the other formats'
    # readers and writers, ``flashwrite info``'s probes, held GPU stripes and the saved
    # Writer tunings (keyed by mount) need that.
    os_paths = False
    # Whether a save here may also keep local snapshots (``tier/``) of what it wrote.
    holds_local_snapshots = False
    # Whether its directories and files can be scanned cheaply: step directories found by
    # listing, a stripe's identity told by its stat, a temporary's owner judged alive or dead.
    scannable = False
    # Whether ``flashwrite tune`` sweeps the Writer's settings here (else the target's own
    # transfer settings, its connections).
    tunes_writer = False

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def is_dir(self, path: str) -> bool:
        raise NotImplementedError

    def is_file(self, path: str) -> bool:
        raise NotImplementedError

    def list(self, path: str) -> list[str]:
        """The names in directory ``path``."""
        raise NotImplementedError

    def list_dirs(self, path: str) -> list[str]:
        """The names of the directories (not links to them) in directory ``path``."""
        return [n for n in self.list(path) if self.is_dir(os.path.join(path, n))]

    def read_small(self, path: str, limit: int) -> bytes:
        """The whole of the small regular file ``path``, read as hostile input: another kind
        of file or one over ``limit`` bytes raises ValueError (before anything sized by it is
        allocated); a missing one FileNotFoundError."""
        raise NotImplementedError

    def make_dirs(self, path: str) -> None:
        """Create ``path`` and its missing parents (no error if it exists)."""
        raise NotImplementedError

    def make_dir(self, path: str) -> None:
        """Create the directory ``path``; FileExistsError if anything is there."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def remove_file(self, path: str) -> None:
        raise NotImplementedError

    def exchange(self, a: str, b: str) -> bool:
        """Swap ``a`` and ``b`` atomically; False where the target cannot."""
        return False

    def fsync_dir(self, path: str) -> None:
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; no error if it is gone."""
        raise NotImplementedError

    def write_durable(self, path: str, data: bytes) -> None:
        """Create the new file ``path`` holding ``data``, durable when this returns."""
        raise NotImplementedError

    def open_stripe(self, path: str, write: bool) -> int:
        """A file descriptor of stripe ``path``: created new (write=True) or opened to read."""
        raise NotImplementedError

    def show(self, path: str) -> str:
        """How ``path`` is named to the user (a URL for remote targets)."""
        return path

    def facts(self, path: str) -> dict[str, Any]:
        """What ``backend_info`` reports of a target whose paths are not this machine's
        (those are probed as directories): where ``path`` is and how it is reached."""
        return {"url": self.show(path), "exists": self.exists(path)}

    # Incremental saves (``incremental.py``) link stripes of an earlier checkpoint.
    def link(self, src: str, dst: str) -> None:
        """Make ``dst`` a second name (hard link) of the file ``src``; durable with its
        directory (``fsync_dir``). OSError (e.g. EXDEV, ENOTSUP) where it cannot."""
        raise OSError(errno.ENOTSUP, "hard links are not supported on this target", self.show(dst))

    def read_at(self, path: str, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of the regular file ``path`` from ``offset``."""
        raise NotImplementedError

    def file_size(self, path: str) -> int | None:
        """The size of the regular file ``path``; None if there is none."""
        raise NotImplementedError

    def read_manifest(self, path: str, shown: str | None = None) -> Manifest:
        """The checked manifest of the checkpoint directory ``path`` (messages name ``shown``,
        default ``show(path)``), read as hostile input like ``format.read_manifest``'s."""
        shown = shown if shown is not None else self.show(path)
        mshown = f"{shown.rstrip('/')}/{MANIFEST_NAME}"
        if not self.is_dir(path):
            raise FileNotFoundError(errno.ENOENT, "checkpoint directory not found", shown)
        try:
            data = self.read_small(f"{path.rstrip('/')}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{mshown} is missing: the checkpoint is incomplete or not a flashwrite "
                                         "checkpoint (`flashwrite ls DIR` lists the checkpoints in a directory)",
                                         file=MANIFEST_NAME) from None
        except ValueError as e:
            raise CorruptCheckpointError(str(e), file=MANIFEST_NAME) from None
        return parse_manifest(data, sealed=True)

    def native_files(self) -> object | None:
        """What the native save job writes this target's stripes through: None where the
        engine opens them itself (a local file system), else the object ``start_save``
        takes as ``remote=`` (nfs://: the NFS client's connections)."""
        return None


class LocalTarget(Target):
    """A directory on a local (or kernel-mounted) file system."""

    name = "local"
    sweeps_dead_saves = True
    os_paths = True
    holds_local_snapshots = True
    scannable = True
    tunes_writer = True

    def read_manifest(self, path: str, shown: str | None = None) -> Manifest:
        return read_manifest(path, shown=shown)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path) and not os.path.islink(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def list(self, path: str) -> list[str]:
        return os.listdir(path)

    def list_dirs(self, path: str) -> list[str]:
        with os.scandir(path) as it:  # the kind of each entry comes with the listing: no stat per name
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]

    def read_small(self, path: str, limit: int) -> bytes:
        # O_NONBLOCK: a FIFO planted in a checkpoint must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if st.st_size > limit:
                raise ValueError(f"{path} is larger than {limit} bytes")
            data = fh.read(st.st_size + 1)  # read(n) allocates n up front: ask for what is there
        if len(data) > limit:
            raise ValueError(f"{path} is larger than {limit} bytes")
        return data

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def make_dir(self, path: str) -> None:
        os.mkdir(path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def remove_file(self, path: str) -> None:
        os.unlink(path)

    def exchange(self, a: str, b: str) -> bool:
        return bool(_core.rename_exchange(a, b))

    def fsync_dir(self, path: str) -> None:
        _core.fsync_dir(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def write_durable(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:  # os.write/fsync errors carry no path: name the file, as native errors do
            raise OSError(e.errno, f"{e.strerror} (writing {os.path.basename(path)})", path) from None
        finally:
            os.close(fd)

    def open_stripe(self, path: str, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
        return os.open(path, flags | os.O_CLOEXEC, 0o644)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, follow_symlinks=False)

    def read_at(self, path: str, offset: int, nbytes: int) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)

    def file_size(self, path: str) -> int | None:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None


LOCAL = LocalTarget()
