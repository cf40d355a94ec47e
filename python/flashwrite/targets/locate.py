"""Locate: which Target a user's path lives on (a local directory or an nfs:// export).

Above both target kinds (``target`` and ``nfs``), so that neither imports the other's
user; save, load and the multi-rank protocol ask here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from . import nfs
from ..format import Manifest
from .target import LOCAL, LocalTarget, Target, check_path, url_scheme

__all__ = ["resolve", "locate", "kind_of", "Located", "read_manifest"]


def resolve(path: str | os.PathLike, what: str) -> tuple[Target, str]:
    """(the target ``path`` lives on, its absolute name there: a local path, or the
    path inside an NFS export). URLs of other schemes raise ``UnsupportedTargetError``
    naming ``what``."""
    s = check_path(path, what)
    if url_scheme(s) == "nfs":
        with _naming(s, what):
            return nfs.target_for(s, what)
    return LOCAL, os.path.abspath(s)


@contextlib.contextmanager
def _naming(url: str, what: str) -> Iterator[None]:
    """OSErrors name what the user gave (the URL, with the operation), not the server's side of it."""
    try:
        yield
    except OSError as e:
        raise type(e)(e.errno, f"{what} {url}: {e.strerror or e}", e.filename) from None


def kind_of(path: str | os.PathLike, what: str) -> type[Target]:
    """The kind of target ``path`` names, without reaching it: its capabilities (class
    attributes such as ``holds_local_snapshots``) answer what a caller may do there before
    anything connects. URLs of other schemes raise ``UnsupportedTargetError``."""
    return nfs.NfsTarget if url_scheme(check_path(path, what)) == "nfs" else LocalTarget


class Located:
    """A user's path resolved once: the target it lives on, its name there, and the path
    as the user gave it (what messages name). ``os.fspath`` of it is the user's path."""

    __slots__ = ("target", "path", "given")

    def __init__(self, target: Target, path: str, given: str):
        self.target, self.path, self.given = target, path, given

    def __fspath__(self) -> str:
        return self.given

    def read_manifest(self, what: str) -> Manifest:
        """The checkpoint's checked manifest; a remote target's OSErrors name the URL and ``what``."""
        if self.target.os_paths:
            return self.target.read_manifest(self.given, shown=self.given)
        with _naming(self.given, what):
            return self.target.read_manifest(self.path, shown=self.given)


def locate(path: str | os.PathLike, what: str) -> Located:
    """``resolve``, kept with the user's path (what messages name, as the user wrote it)."""
    s = check_path(path, what)
    if url_scheme(s) != "nfs":
        return Located(LOCAL, os.path.abspath(s), s)
    target, inner = resolve(s, what)
    return Located(target, inner, s)


def read_manifest(path: str | os.PathLike | Located, what: str, shown: str | None = None) -> Manifest:
    """The checked manifest of the checkpoint ``path`` names, on whichever target it lives."""
    where = path if isinstance(path, Located) else locate(path, what)
    if shown is not None and where.target.os_paths:
        return where.target.read_manifest(where.given, shown=shown)
    return where.read_manifest(what)
