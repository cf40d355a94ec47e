"""Locate: which Target a user's path lives on (a local directory or an nfs:// export).

Above both target kinds (``target`` and ``nfs``), so that neither imports the other's
user; save, load and the multi-rank protocol ask here.
"""

from __future__ import annotations

import os

from . import nfs
from .target import LOCAL, Target, check_path, url_scheme

__all__ = ["resolve"]


def resolve(path: str | os.PathLike, what: str) -> tuple[Target, str]:
    """(the target ``path`` lives on, its absolute name there: a local path, or the
    path inside an NFS export). URLs of other schemes raise ``UnsupportedTargetError``
    naming ``what``."""
    s = check_path(path, what)
    if url_scheme(s) == "nfs":
        return nfs.target_for(s, what)
    return LOCAL, os.path.abspath(s)
