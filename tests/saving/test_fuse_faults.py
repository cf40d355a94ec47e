"""Faults only a file system can make, from a real one: tests/fuse_faults.c, a passthrough
FUSE file system mounted per test with its faults (tests/fuse_util.py), on both backends.

O_DIRECT works on FUSE (backend_info says direct_io: True there, and saves report
direct=True, no file buffered): the kernel sends direct reads and writes straight to the
daemon. So the faults below reach flashwrite the way a misbehaving network or FUSE file
system would deliver them, O_DIRECT or not; the tests check which mode ran where it matters.

One kernel detail shapes the short-transfer test: a short reply to a write that the kernel
sent asynchronously (every io_uring write, and any O_DIRECT write outside direct_io mode) is
turned into EIO by the kernel itself (fuse_get_res_by_io); only a synchronous pwrite on a
direct_io file gets the short count. fio sees the same.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_same
from fault_util import make_state

import flashwrite as fw
from flashwrite.saving import commit

pytestmark = pytest.mark.fuse

BACKENDS = ["io_uring", "threads"]
N = 1 << 20                 # make_state(step, N): ~5.6 MB, 3 tensors with bytes
STRIPE2 = "model-00002-of-00002.safetensors"


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "io_uring" and fw.backend_info()["backend"] != "io_uring":
        pytest.skip("io_uring is not usable here: " + str(fw.backend_info()["io_uring_error"]))
    return request.param


def _writer(backend, **kw) -> fw.Writer:
    return fw.Writer(backend=backend, **{"stripes": 2, "chunk_bytes": 1 << 20, "queue_depth": 8, **kw})


def _entries(d) -> list[str]:
    return sorted(os.listdir(d))


def _range(e: OSError) -> tuple[int, int]:
    """The offset and length of the failed transfer, as its message names them."""
    length = int(re.search(r"at offset (\d+), (\d+) bytes", str(e)).group(2))
    return e.offset, length


def _assert_stripe_error(e: OSError, code: int, op: str):
    """errno, the stripe's path in the temp dir of the save, the operation and its offset."""
    assert e.errno == code and os.strerror(code) in str(e), e
    assert e.filename and os.path.basename(e.filename).startswith("model-"), e.filename
    assert commit.TMP_MARK in e.filename, e.filename
    assert op in e.op and e.offset is not None and e.offset >= 0, e


# --------------------------------------------------------------------------- fsync

def test_fsync_eio_fails_the_save_and_is_not_retried(fuse_mount, backend):
    """The first fsync of stripe 2 fails (once per mount: a second fsync would succeed, as
    after PostgreSQL's fsync bug). The save fails with EIO, nothing is committed, and
    nothing retried the fsync into a success; a new save rewrites every byte and commits."""
    m = fuse_mount(fsync_eio="model-00002")
    state = make_state(1, N)
    with _writer(backend) as w:
        with pytest.raises(OSError) as ei:
            w.save(state, m.path / "ck")
        e = ei.value
        assert e.errno == errno.EIO and "fsync" in str(e), e
        assert os.path.basename(e.filename) == STRIPE2 and commit.TMP_MARK in e.filename, e.filename
        assert _entries(m.backing) == [] and not (m.path / "ck").exists()
        assert m.report()["fsync_eio"] == 1
        # The retry is a new save: every byte written again, then fsync'd (now it succeeds).
        st = w.save(state, m.path / "ck")
    assert st.backend == backend and st.direct
    assert _entries(m.backing) == ["ck"]
    assert_same(fw.load(m.backing / "ck"), state)


# --------------------------------------------------------------------------- write EIO

def test_write_eio_past_an_offset(fuse_mount, backend):
    m = fuse_mount(write_eio_at=1 << 20)
    fw.save(make_state(0, N // 8), m.backing / "old")  # an earlier checkpoint (fits under 1 MiB/stripe)
    with _writer(backend) as w, pytest.raises(OSError) as ei:
        w.save(make_state(1, N), m.path / "ck")
    _assert_stripe_error(ei.value, errno.EIO, "write")
    offset, length = _range(ei.value)
    assert offset + length > 1 << 20, (offset, length)  # the write that reached the faulty range
    assert m.report()["write_eio"] >= 1
    assert _entries(m.backing) == ["old"]  # nothing committed, no temp directory
    assert_same(fw.load(m.path / "old", backend=backend), make_state(0, N // 8))


# --------------------------------------------------------------------------- read EIO

def test_read_eio_names_stripe_and_offset(fuse_mount, backend):
    """A checkpoint written beside FUSE, read through it: load and verify fail with EIO and
    name the stripe and a read whose range holds the failing byte."""
    at = 4096 + (512 << 10) + 12345  # inside stripe 2's data (~1 MB)
    m = fuse_mount(read_eio_at=at, only="model-00002")
    state = make_state(2, N)
    fw.save(state, m.backing / "ck", stripes=2, chunk_bytes=1 << 20)
    assert os.path.getsize(m.backing / "ck" / STRIPE2) > at
    for call in (lambda: fw.load(m.path / "ck", backend=backend),
                 lambda: fw.load(m.path / "ck", backend=backend, direct=False),
                 lambda: fw.verify(m.path / "ck")):
        with pytest.raises(OSError) as ei:
            call()
        e = ei.value
        assert e.errno == errno.EIO and os.path.basename(e.filename) == STRIPE2, e
        assert "read" in e.op and e.filename == str(m.path / "ck" / STRIPE2), e
        offset, length = _range(e)
        assert offset <= at < offset + length, (offset, length, at)
    assert m.report()["read_eio"] >= 3
    assert_same(fw.load(m.backing / "ck", backend=backend), state)  # the bytes were fine all along


# --------------------------------------------------------------------------- ENOSPC

def test_enospc_after_n_bytes(fuse_mount, backend):
    m = fuse_mount(enospc_after=3 << 20)
    small = make_state(0, N // 8)
    with _writer(backend) as w:
        w.save(small, m.path / "old")  # ~0.7 MB: fits
        with pytest.raises(OSError) as ei:
            w.save(make_state(1, N), m.path / "ck")
    _assert_stripe_error(ei.value, errno.ENOSPC, "write")
    assert m.report()["enospc"] >= 1
    assert _entries(m.backing) == ["old"]
    assert_same(fw.load(m.backing / "old"), small)


# --------------------------------------------------------------------------- short transfers

@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_short_writes_and_reads(fuse_mount, backend, direct):
    """Every read and write moves at most 5000 bytes (not a multiple of 4 KiB, so the rest
    resumes unaligned). With direct_io mode the short counts reach the caller: the threads
    backend resumes them and the checkpoint is byte-exact. io_uring's writes are async to
    the kernel, which reports a short async write as EIO: that must be a named error with
    nothing committed (a kernel that passed the short count on must give a byte-exact save)."""
    m = fuse_mount(direct_io=True, short=5000)
    state = make_state(3, N // 4)
    with _writer(backend, chunk_bytes=256 << 10, direct=direct) as w:
        try:
            st = w.save(state, m.path / "ck")
        except OSError as e:
            assert backend == "io_uring", f"the threads backend must resume short writes: {e!r}"
            _assert_stripe_error(e, errno.EIO, "write")
            assert _entries(m.backing) == []
            fw.save(state, m.backing / "ck")  # for the reads below
        else:
            assert st.backend == backend and st.direct == direct
    assert m.report()["short_write"] > 0
    before = m.report()["short_read"]
    for b in BACKENDS:
        assert_same(fw.load(m.path / "ck", backend=b, direct=direct), state)
    assert m.report()["short_read"] > before
    assert _entries(m.backing) == ["ck"]
    assert_same(fw.load(m.backing / "ck"), state)


# --------------------------------------------------------------------------- latency

def test_latency_round_trips_and_cancel_returns(fuse_mount, backend):
    """2-20 ms per operation: saves and loads finish, byte-exact; a cancel() in the middle
    of a save that would take seconds more ends it within a second (the writes already
    in flight finish, nothing more is sent), and nothing is committed."""
    m = fuse_mount(delay_ms="2-20")
    small = make_state(4, N // 8)
    big = {"x": torch.randn(16 << 20, generator=torch.Generator().manual_seed(9))}  # 64 MiB
    with _writer(backend, chunk_bytes=256 << 10, queue_depth=4) as w:
        w.save(small, m.path / "small")
        assert_same(fw.load(m.path / "small", backend=backend), small)
        fut = w.save_async(big, m.path / "big")
        deadline = time.monotonic() + 10
        while fut.progress() < 0.05 and time.monotonic() < deadline:  # writing now
            time.sleep(0.02)
        progress = fut.progress()
        assert 0.05 <= progress < 0.5, f"{progress:.2f}: the save is not under way (or nearly done)"
        t0 = time.monotonic()
        assert fut.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            fut.result(timeout=10)
        took = time.monotonic() - t0
    print(f"cancel() at {progress:.0%}: the save ended {took:.3f} s later")
    assert took < 1.0, f"cancel() at {progress:.0%} took {took:.2f} s to end the save"
    assert m.report()["delay"] > 100
    assert _entries(m.backing) == ["small"]


_CTRL_C_CHILD = textwrap.dedent("""
    import signal, sys, time, torch, flashwrite as fw
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever started us (nohup, cmd &)
    big = {"x": torch.randn(6 << 20, generator=torch.Generator().manual_seed(9))}
    with fw.Writer(backend=sys.argv[2], stripes=2, chunk_bytes=256 << 10, queue_depth=4) as w:
        fut = w.save_async(big, sys.argv[1])
        print("staged", flush=True)
        try:
            fut.result()
            print("FINISHED", flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED %.6f" % time.monotonic(), flush=True)
        fut.result()  # the interrupt ended the wait, not the save: it commits
        print("COMMITTED", flush=True)
""")


def test_latency_ctrl_c_returns_within_a_second(fuse_mount, backend):
    """Ctrl-C while waiting for a save on slow storage: KeyboardInterrupt within a second;
    the save itself goes on and commits whole."""
    m = fuse_mount(delay_ms="2-20")
    child = subprocess.Popen([sys.executable, "-c", _CTRL_C_CHILD, str(m.path / "ck"), backend],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "staged\n", child.communicate(timeout=60)
        time.sleep(0.2)  # waiting now, for 24 MiB at 128 KiB per 2-20 ms
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, out + err
    line = next((x for x in out.splitlines() if x.startswith("INTERRUPTED")), None)
    assert line, f"the wait was not interrupted (the save was done in 0.2 s?):\n{out}{err}"
    took = float(line.split()[1]) - sent
    print(f"KeyboardInterrupt {took:.3f} s after SIGINT")
    assert took < 1.0, f"KeyboardInterrupt came {took:.2f} s after SIGINT"
    assert "COMMITTED" in out and _entries(m.backing) == ["ck"]
    assert_same(fw.load(m.backing / "ck"), {"x": torch.randn(6 << 20, generator=torch.Generator().manual_seed(9))})


# --------------------------------------------------------------------------- rename

@pytest.mark.parametrize("code", [errno.EXDEV, errno.EIO], ids=["EXDEV", "EIO"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_rename_fails(fuse_mount, backend, code, overwrite):
    """The commit's rename fails: nothing is committed, the temp directory is removed, and
    a checkpoint being overwritten stays where it was, whole."""
    m = fuse_mount(rename_errno=code)
    old = make_state(0, N // 8)
    if overwrite:
        fw.save(old, m.backing / "ck")
    with _writer(backend) as w, pytest.raises(OSError) as ei:
        w.save(make_state(1, N // 4), m.path / "ck", overwrite=overwrite)
    assert ei.value.errno == code, ei.value
    assert m.report()["rename"] >= 1
    assert _entries(m.backing) == (["ck"] if overwrite else [])
    if overwrite:
        assert_same(fw.load(m.path / "ck", backend=backend), old)
