import os
import sys
import tempfile

import pytest
import torch

import flashwrite as fw
from fuse_util import fuse_faults_exe, fuse_mount  # noqa: F401  (fixtures of the FUSE fault tests)

from nfs_fixtures import nfs_server, nfs_staging  # noqa: F401  (a real NFS server, for tests marked nfs)
from cuda_fixtures import fake_cudart  # noqa: F401  (the stand-in CUDA runtime)

# tests/ mirrors the package's folders; the shared helpers (fixtures, child scripts) stay
# here. A few test modules import another's helpers by name across folders (test_ops_ls
# the tier's spawn helpers, test_incremental_dcp the DCP states): every folder is on the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = sorted(os.path.join(_HERE, d) for d in os.listdir(_HERE)
                  if os.path.isdir(os.path.join(_HERE, d)) and d not in ("data", "__pycache__"))
sys.path[1:1] = _FOLDERS
# ... and for the child processes tests start that import a test module by name.
os.environ["PYTHONPATH"] = os.pathsep.join([_HERE, *_FOLDERS, *filter(None, [os.environ.get("PYTHONPATH")])])

# Bounds what one test may write (see disk_guard.py): a runaway test fails alone.
pytest_plugins = ["disk_guard", "pytester"]


@pytest.fixture
def ckdir(tmp_path):
    """A directory on the default (disk-backed) file system."""
    return tmp_path


@pytest.fixture
def shmdir():
    """A directory on tmpfs (/dev/shm), where O_DIRECT also works on Linux >= 6.6."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="fwtest-") as d:
        yield d


def assert_same(a, b, path="<root>"):
    """Structural equality with byte-exact tensor comparison (dtype and shape included)."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert a.device == b.device, f"{path}: {a.device} vs {b.device}"
        ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        assert torch.equal(ac.reshape(-1).view(torch.uint8), bc.reshape(-1).view(torch.uint8)), f"{path}: bytes differ"
        return
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} vs {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], f"{path}: key types differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
        return
    if isinstance(a, float) and a != a:
        assert b != b, path
        return
    assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.fixture
def writer():
    w = fw.Writer(stripes=3, chunk_bytes=1 << 20)
    yield w
    w.close()


# CI runs as root: there a root test that skips (no mount, no loop device) hides a gap in
# coverage, so FLASHWRITE_REQUIRE_ROOT_TESTS=1 (or --require-root-tests) makes it fail;
# FLASHWRITE_REQUIRE_FUSE_TESTS=1 does the same for tests marked fuse (no /dev/fuse, no libfuse3),
# and FLASHWRITE_REQUIRE_NFS_TESTS=1 for tests marked nfs (no NFS server could start).
def pytest_addoption(parser):
    parser.addoption("--require-root-tests", action="store_true", default=False,
                     help="fail, instead of skipping, tests marked root that cannot run "
                          "(also FLASHWRITE_REQUIRE_ROOT_TESTS=1)")
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (left out by default to keep the suite under "
                          "10 minutes on 2 cores; CI runs them with -m slow)")


# The README's test command stays well under 10 minutes: tests marked slow (kill -9 trials,
# multi-rank restarts, full-size runs) run with --slow, or on their own with -m slow, as CI does.
def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or config.getoption("markexpr", ""):
        return
    slow = [it for it in items if it.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [it for it in items if not it.get_closest_marker("slow")]


def _root_tests_required(config) -> bool:
    return config.getoption("--require-root-tests") or os.environ.get("FLASHWRITE_REQUIRE_ROOT_TESTS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    required = [m for m, needed in (("root", _root_tests_required(item.config)),
                                    ("fuse", os.environ.get("FLASHWRITE_REQUIRE_FUSE_TESTS") == "1"),
                                    ("nfs", os.environ.get("FLASHWRITE_REQUIRE_NFS_TESTS") == "1"))
                if needed and item.get_closest_marker(m)]
    if rep.skipped and required:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"{required[0]} test skipped, but {required[0]} tests are required here: {reason}"
