"""The ``nfs_server`` fixture: a fresh nfs-ganesha server per test (see nfs_server.py).

Tests that use it are marked ``nfs``; they skip, with the reason, only where the server
cannot start, and FLASHWRITE_REQUIRE_NFS_TESTS=1 (CI) turns that skip into a failure."""

from __future__ import annotations

import contextlib
import os

import pytest

from nfs_server import Export, NfsServer, NfsServerUnavailable


@contextlib.contextmanager
def serving(workdir: str, exports: list[Export] | None = None):
    """A started NfsServer exporting ``exports`` (default: a fresh directory), stopped afterwards."""
    os.makedirs(workdir, exist_ok=True)
    server = NfsServer(exports=list(exports or []), workdir=workdir)
    try:
        server.start()
    except NfsServerUnavailable as e:
        server.stop()
        pytest.skip(f"no NFS server here: {e}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nfs_server(tmp_path):
    with serving(str(tmp_path / "nfs")) as server:
        yield server


@pytest.fixture
def nfs_staging(tmp_path, monkeypatch):
    """An nfs:// load reads through its target and makes no local stand-in directory (as
    loads once did, in /dev/shm or FLASHWRITE_NFS_STAGING): none may appear."""
    d = tmp_path / "staging"
    d.mkdir()
    monkeypatch.setenv("FLASHWRITE_NFS_STAGING", str(d))  # where an old stand-in would have gone
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    before = {n for n in os.listdir(shm) if n.startswith("flashwrite-nfs-")} if shm else set()
    yield d
    assert os.listdir(d) == [], f"local copies made: {os.listdir(d)}"
    after = {n for n in os.listdir(shm) if n.startswith("flashwrite-nfs-")} if shm else set()
    assert after <= before, f"local stand-ins made: {sorted(after - before)}"
