"""A pytest plugin that keeps one runaway test from filling the disk.

A test that writes without bound (a loop of saves whose stop signal never arrives, say)
once filled the machine: 281 checkpoints, 72 GB, and every later test failed. This
plugin bounds what any one test may leave in pytest's base temp directory:

- While a test runs, a watchdog thread measures the base temp directory every
  ``POLL_S`` seconds. Once the test has added more than the limit, it kills the test's
  child processes (a child writing in a loop is the usual runaway) and raises
  ``DiskGuardExceeded`` in the test's own thread, at its next Python line.
- After the test, its growth is measured once more. A test that went past the limit is
  failed (in its teardown) and its directory is removed, so the rest of the suite runs.
- The directory of a test that passed is removed after it (pytest would keep it until
  three sessions later), so the suite's disk use is that of its largest test, not the
  sum of all of them. ``--keep-tmp`` keeps them.
- The peak use is printed at the end of the session (``.ci/run`` shows it).

Limit: ``FLASHWRITE_TEST_DISK_LIMIT`` (bytes, or with a K/M/G suffix), 4G by default.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import pytest

POLL_S = 0.25
_DEFAULT_LIMIT = 4 << 30


class DiskGuardExceeded(Exception):
    """Raised in a test that wrote more than the suite's per-test disk limit."""


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _mount_points() -> set[str]:
    try:
        with open("/proc/self/mounts") as f:
            return {line.split()[1].replace("\\040", " ") for line in f if len(line.split()) > 1}
    except OSError:
        return set()


def tree_bytes(root: Path) -> int:
    """Bytes allocated under root (st_blocks, as du counts: a sparse file costs what it holds).
    Mount points under root (a test's tmpfs, loop device or FUSE mount) are not entered: a
    hung FUSE daemon must not hang the guard, and their bytes are not on this disk."""
    total = 0
    mounts = _mount_points()
    stack = [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if e.path not in mounts:
                                stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass  # removed while we looked
        except OSError:
            pass
    return total


def _shared_helpers() -> set[int]:
    """multiprocessing's resource tracker and fork server: started once, used by every later
    test's processes. Killing them turns the next test's start into a failure of its own
    ("resource_tracker: process died unexpectedly"), so the guard spares them."""
    import multiprocessing.forkserver as fs
    import multiprocessing.resource_tracker as rt

    pids = {getattr(rt._resource_tracker, "_pid", None), getattr(fs._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


def _kill_children() -> list[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a test dependency
        return []
    killed = []
    spare = _shared_helpers()
    for child in psutil.Process().children(recursive=True):
        if child.pid in spare:
            continue
        try:
            child.kill()
            killed.append(child.pid)
        except psutil.Error:
            pass
    return killed


def _raise_in_thread(thread_id: int, exc: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


class DiskGuard:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.limit = parse_size(os.environ.get("FLASHWRITE_TEST_DISK_LIMIT", str(_DEFAULT_LIMIT)))
        self.keep = config.getoption("--keep-tmp")
        self.peak = 0
        self.peak_test = ""
        self._base: Path | None = None
        self._current: dict | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, name="disk-guard", daemon=True)
        self._thread.start()

    # The base temp directory exists once a test first asks for tmp_path.
    def base(self) -> Path | None:
        if self._base is None:
            factory = getattr(self.config, "_tmp_path_factory", None)
            if factory is not None and getattr(factory, "_basetemp", None) is not None:
                self._base = Path(factory._basetemp)
        return self._base

    def _used(self) -> int:
        base = self.base()
        return tree_bytes(base) if base is not None and base.exists() else 0

    def _note_peak(self, used: int, nodeid: str) -> None:
        if used > self.peak:
            self.peak, self.peak_test = used, nodeid

    def _watch(self) -> None:
        while not self._stop:
            self._wake.wait(POLL_S)
            with self._lock:
                cur = self._current
            if cur is None or cur["tripped"]:
                continue
            used = self._used()  # not under the lock: the test's end never waits for a scan
            with self._lock:
                if self._current is not cur:
                    continue  # the test ended meanwhile
                self._note_peak(used, cur["nodeid"])
                if used - cur["start"] > self.limit:
                    cur["tripped"] = used - cur["start"]
                    # Raise first, kill second: a test waiting on its child sees the exception
                    # as soon as the child's death wakes it, not a clean exit it might pass on.
                    _raise_in_thread(cur["thread"], DiskGuardExceeded)
                    cur["killed"] = _kill_children()

    def start(self, item: pytest.Item) -> None:
        with self._lock:
            self._current = {"nodeid": item.nodeid, "start": self._used(), "tripped": 0,
                             "killed": [], "thread": threading.get_ident()}

    def finish(self, item: pytest.Item) -> str | None:
        """Stop watching. Returns the failure message for a test that went past the limit."""
        with self._lock:
            cur, self._current = self._current, None
        if cur is None:
            return None
        used = self._used()
        self._note_peak(used, cur["nodeid"])
        grew = max(cur["tripped"], used - cur["start"])
        if grew <= self.limit:
            return None
        item.stash[_RAN_AWAY] = True
        return (f"disk guard: this test added {grew / 2**30:.2f} GiB under {self.base()}, past the "
                f"limit of {self.limit / 2**30:.2f} GiB (FLASHWRITE_TEST_DISK_LIMIT); "
                f"killed child processes {cur['killed']}; its tmp_path is removed")

    def cleanup(self, item: pytest.Item, passed: bool) -> None:
        """After teardown: remove the test's directory when it passed or ran away."""
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if tmp is not None and (item.stash.get(_RAN_AWAY, False) or (passed and not self.keep)):
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        self._stop = True
        self._wake.set()


_GUARD: DiskGuard | None = None
_RAN_AWAY = pytest.StashKey[bool]()
_PASSED = pytest.StashKey[bool]()


def pytest_addoption(parser):
    parser.addoption("--keep-tmp", action="store_true", default=False,
                     help="keep the tmp_path of tests that passed (the disk guard removes them)")


def pytest_configure(config):
    global _GUARD
    if not hasattr(config, "workerinput"):
        _GUARD = DiskGuard(config)


def pytest_unconfigure(config):
    if _GUARD is not None:
        _GUARD.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if _GUARD is not None:
        _GUARD.start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _GUARD is None:
        return
    if call.when == "call":
        item.stash[_PASSED] = rep.passed
        msg = _GUARD.finish(item)
        if msg:
            rep.outcome = "failed"
            rep.longrepr = msg + ("\n\n" + str(rep.longrepr) if rep.longrepr else "")
    elif call.when == "teardown":
        _GUARD.cleanup(item, passed=item.stash.get(_PASSED, False) and rep.passed)


def pytest_terminal_summary(terminalreporter):
    if _GUARD is not None:
        terminalreporter.write_line(
            f"disk guard: peak use of the pytest temp directory {_GUARD.peak / 2**20:.0f} MiB "
            f"(in {_GUARD.peak_test or 'no test'}); limit per test {_GUARD.limit / 2**30:.2f} GiB")
