"""The fault-injecting FUSE file system of tests/fuse_faults.c: built at test time (like the
LD_PRELOAD shims of shim_util.py), mounted per test with the faults it asks for, and always
unmounted and its daemon ended, also when the test fails.

    def test_x(fuse_mount):
        m = fuse_mount(write_eio_at=1 << 20)       # faults: see the head of fuse_faults.c
        fw.save(sd, m.path / "ck")                   # through the faulty file system
        m.backing                                    # the same files, without FUSE
        m.report()                                   # {"write_eio": 3, ...}: what it injected

Needs /dev/fuse, libfuse3's headers (libfuse3-dev) and, without root, fusermount3 (fuse3);
where one is missing the tests skip and say which (FLASHWRITE_REQUIRE_FUSE_TESTS=1 makes
that a failure, see conftest.py).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MOUNT_TIMEOUT_S = 10.0


def build_fuse_faults(out_dir) -> str:
    """Compile tests/fuse_faults.c into <out_dir>/fuse_faults (skip where it cannot be built)."""
    exe = os.path.join(os.fspath(out_dir), "fuse_faults")
    if os.path.exists(exe):
        return exe
    try:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no pkg-config to find libfuse3 (apt-get install pkg-config libfuse3-dev)")
    if flags.returncode:
        pytest.skip(f"no libfuse3 development files (apt-get install libfuse3-dev): {flags.stderr.strip()[:200]}")
    try:
        src = os.path.join(HERE, "fuse_faults.c")
        cc = subprocess.run(["cc", "-O1", "-Wall", "-o", exe, src, *flags.stdout.split()], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no C compiler (cc) for the FUSE file system")
    if cc.returncode:
        pytest.skip(f"the FUSE file system does not build: {cc.stderr[:400]}")
    return exe


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == path for line in fh)


def _unmount(path: str) -> None:
    """fusermount3 -u, then lazily (-uz) if something still holds the mount; umount -l as root
    without fusermount3."""
    if not _mounted(path):
        return
    tool = shutil.which("fusermount3")
    tries = [[tool, "-u", path], [tool, "-uz", path]] if tool else []
    if os.geteuid() == 0:
        tries.append(["umount", "-l", path])
    for cmd in tries:
        subprocess.run(cmd, capture_output=True)
        if not _mounted(path):
            return


class FuseMount:
    """One mount of fuse_faults: ``path`` is the mount point, ``backing`` the directory it
    passes through to."""

    def __init__(self, exe: str, root: pathlib.Path, faults: dict, direct_io: bool):
        self.backing = root / "backing"
        self.path = root / "mnt"
        self.backing.mkdir()
        self.path.mkdir()
        self._report = root / "report"
        opts = [f"{k}={v}" for k, v in faults.items()] + [f"report={self._report}", "default_permissions"]
        if direct_io:
            opts.append("direct_io")
        if shutil.which("fusermount3"):
            opts.append("auto_unmount")  # the kernel mount goes when the daemon dies, whatever kills it
        self._log = open(root / "daemon.log", "w+")
        self.proc = subprocess.Popen([exe, str(self.backing), str(self.path), "-f", "-o", ",".join(opts)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not _mounted(str(self.path)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = self.log()
                self.close()
                raise FuseUnavailable(f"fuse_faults did not mount {self.path}: {why.strip()[-400:]}")
            time.sleep(0.01)

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def report(self) -> dict[str, int]:
        """How many faults of each kind the file system injected so far."""
        text = self._report.read_text() if self._report.exists() else ""
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split())}

    def close(self) -> None:
        try:
            _unmount(str(self.path))
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            _unmount(str(self.path))  # a daemon killed before its unmount leaves the mount behind
            self._log.close()


class FuseUnavailable(RuntimeError):
    pass


@pytest.fixture(scope="session")
def fuse_faults_exe(tmp_path_factory):
    """The built file system, once it has been seen to mount here (skip with the reason if not)."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse (modprobe fuse; in a container: --device /dev/fuse --cap-add SYS_ADMIN)")
    if os.geteuid() != 0 and not shutil.which("fusermount3"):
        pytest.skip("not root and no fusermount3 to mount FUSE with (apt-get install fuse3)")
    exe = build_fuse_faults(tmp_path_factory.mktemp("fuse_build"))
    try:
        FuseMount(exe, tmp_path_factory.mktemp("fuse_probe"), {}, False).close()
    except FuseUnavailable as e:
        pytest.skip(f"FUSE cannot mount here: {e}")
    return exe


@pytest.fixture
def fuse_mount(fuse_faults_exe, tmp_path):
    """A factory: fuse_mount(direct_io=False, **faults) mounts a fresh file system under the
    test's tmp_path; every mount is unmounted and its daemon ended after the test."""
    mounts: list[FuseMount] = []

    def mount(direct_io: bool = False, **faults) -> FuseMount:
        root = tmp_path / f"fuse{len(mounts)}"
        root.mkdir()
        mounts.append(FuseMount(fuse_faults_exe, root, faults, direct_io))
        return mounts[-1]

    yield mount
    errors = []
    for m in mounts:
        try:
            m.close()
        except Exception as e:  # close every mount, then say what went wrong
            errors.append(e)
    if errors:
        raise errors[0]
