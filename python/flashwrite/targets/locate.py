"""Locate: which Target a user's path lives on (a local directory or an nfs:// export).

Above both target kinds (``target`` and ``nfs``), so that neither imports the other's
user; save, load and the multi-rank protocol ask here.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from . import nfs
from .target import LOCAL, Target, check_path, url_scheme

__all__ = ["resolve", "local_view"]


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


@contextlib.contextmanager
def local_view(path: str | os.PathLike, what: str) -> Iterator[str]:
    """A local path to read the checkpoint ``path`` from: itself, or for nfs:// a stand-in
    directory in /dev/shm (its small files and placeholders of its stripes, whose bytes a
    load then reads over the NFS connections: ``NfsTarget.download``), removed afterwards."""
    s = check_path(path, what)
    if url_scheme(s) != "nfs":
        yield s
        return
    target, inner = resolve(s, what)
    with _naming(s, what):
        local = target.download(inner)
    try:
        yield local
    finally:
        nfs.forget_download(local)
