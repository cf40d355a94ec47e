"""The kernel's write watch that spares incremental saves from hashing unwritten tensors.

Every way memory can change must make the watch say "changed": a CPU store, a store by
the kernel on the process's behalf (read(), flashwrite's own io_uring/O_DIRECT load into
the tensors), pages dropped, memory freed and mapped again, shared memory written by
another process, a neighbour's write to a shared page. And an incremental save that the
watch spares must still be byte-exact when a tensor was changed behind torch's back.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

import flashwrite as fw
from flashwrite import _core
from flashwrite.incremental import write_watch

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

MiB = 1 << 20


def _watch_or_skip() -> _core.WriteWatch:
    try:
        return _core.WriteWatch()
    except OSError as e:
        pytest.skip(f"the kernel cannot watch writes here (Linux 6.7 userfaultfd WP_ASYNC + PAGEMAP_SCAN): {e}")


@pytest.fixture
def watch():
    return _watch_or_skip()


def private(n: int) -> mmap.mmap:
    """Private anonymous memory (Python's mmap(-1, n) alone is shared)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def own_memory(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in a private mapping of its own. The low-level tests make a
    _core.WriteWatch of their own; the kernel refuses to register a range that another
    userfaultfd (the process-wide watch of the incremental saves before them, or an earlier
    test's) already holds, as heap tensors beside them may be."""
    m = private(-(-t.nbytes // 4096) * 4096)
    out = torch.frombuffer(m, dtype=torch.uint8)[:t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    out._keep = m  # the mapping lives as long as the tensor
    return out


def flip(address: int) -> None:
    """Change one byte with a plain store (no torch op)."""
    b = ctypes.c_ubyte.from_address(address)
    b.value ^= 0xFF


def rng_of(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def protected(watch, *tensors) -> list[tuple[int, int]]:
    ranges = [rng_of(t) for t in tensors]
    assert all(watch.arm(ranges))
    watch.scan(ranges)  # protects: from here on, only writes count
    return ranges


def own(flags: list[int]) -> bool:
    """A page of the range's own was written (its first and last page may be shared with
    heap neighbours that other threads write: those are told apart, HEAD and TAIL)."""
    return bool(flags[0] & write_watch.INSIDE)


def test_untouched_memory_is_clean_and_a_store_is_seen_once(watch):
    t = own_memory(torch.randn(4 * MiB // 4))
    (r,) = protected(watch, t)
    assert not own(watch.scan([r]))
    assert not own(watch.scan([r]))  # reading does not count
    float(t.sum())
    assert not own(watch.scan([r]))
    t[123_456] += 1  # one store, deep inside
    assert own(watch.scan([r]))
    assert not own(watch.scan([r]))  # the scan protected it again


def test_page_aligned_memory_reports_exactly(watch):
    m = private(4 * MiB)
    m.write(os.urandom(4 * MiB))
    r = (ctypes.addressof(ctypes.c_char.from_buffer(m)), 4 * MiB)  # whole pages: no shared first or last page
    assert watch.arm([r]) == [True]
    watch.scan([r])
    assert watch.scan([r]) == [0]
    flip(r[0] + 4096 * 5 + 1)
    assert watch.scan([r]) == [write_watch.INSIDE]
    assert watch.scan([r]) == [0]
    m.close()


def test_a_store_behind_torchs_back_is_seen(watch):
    t = own_memory(torch.randn(2 * MiB // 4))
    (r,) = protected(watch, t)
    v = t._version
    ctypes.memset(t.data_ptr() + MiB + 17, 0x5A, 1)
    assert t._version == v  # torch did not see it ...
    assert watch.scan([r])[0] & write_watch.INSIDE  # ... the kernel did


def test_kernel_stores_into_the_memory_are_seen(watch, tmp_path):
    t = own_memory(torch.zeros(2 * MiB, dtype=torch.uint8))
    (r,) = protected(watch, t)
    p = tmp_path / "bytes"
    p.write_bytes(os.urandom(4096))
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = (ctypes.c_char * 4096).from_address(t.data_ptr() + MiB)
        assert os.readv(fd, [memoryview(buf).cast("B")]) == 4096  # copy_to_user into a protected page
    finally:
        os.close(fd)
    assert watch.scan([r])[0] & write_watch.INSIDE
    assert bytes(t[MiB:MiB + 4096].numpy()) == p.read_bytes()


def test_flashwrites_own_load_into_the_tensors_is_seen(watch, tmp_path):
    """load(into=) fills the state in place with io_uring reads (O_DIRECT where aligned)."""
    g = torch.Generator().manual_seed(3)
    saved = {"w": torch.randn(4 * MiB // 4, generator=g)}
    fw.save(saved, str(tmp_path / "ck"))
    state = {"w": own_memory(torch.zeros(4 * MiB // 4))}
    (r,) = protected(watch, state["w"])
    fw.load(str(tmp_path / "ck"), into=state)
    assert torch.equal(state["w"], saved["w"])
    assert watch.scan([r])[0] & write_watch.INSIDE


def test_dropped_pages_count_as_changed(watch):
    n = 4 * MiB
    m = private(n)
    m.write(os.urandom(n))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    r = (addr, n)
    assert watch.arm([r]) == [True]
    watch.scan([r])
    assert watch.scan([r]) == [0]
    m.madvise(mmap.MADV_DONTNEED, MiB, MiB)  # those pages now read as zeros, with no store
    assert watch.scan([r])[0] & write_watch.INSIDE
    m.close()
    assert watch.scan([r])[0] & write_watch.INSIDE  # unmapped: not registered any more


@pytest.mark.parametrize("kind", ["torch share_memory_", "MAP_SHARED anonymous"])
def test_shared_memory_never_counts_as_unchanged(watch, kind):
    """Another process writes shared memory through its own page tables: never trusted."""
    if kind == "torch share_memory_":
        keep = torch.zeros(2 * MiB // 4).share_memory_()
        r = rng_of(keep)
    else:
        keep = mmap.mmap(-1, 2 * MiB)
        keep.write(b"\3" * (2 * MiB))
        r = (ctypes.addressof(ctypes.c_char.from_buffer(keep)), 2 * MiB)
    if not watch.arm([r])[0]:
        return  # refused outright: also never trusted
    watch.scan([r])
    assert watch.scan([r])[0] & write_watch.INSIDE


def test_a_neighbours_store_to_a_shared_page_is_seen_by_both(watch):
    n = 4 * MiB
    m = private(n)
    m.write(b"\1" * n)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    a, b = (addr + 100, MiB), (addr + 100 + MiB, MiB)  # b starts inside a's last page
    assert watch.arm([a, b]) == [True, True]
    watch.scan([a, b])
    ctypes.memset(b[0] + 8, 7, 1)  # in the page both share
    fa, fb = watch.scan([a, b])
    assert fa == write_watch.TAIL and fb == write_watch.HEAD  # a page each shares with the other
    ctypes.memset(b[0] + 8192, 7, 1)  # b's own page
    assert watch.scan([a, b]) == [0, write_watch.INSIDE]
    m.close()


def test_a_neighbours_write_to_a_shared_edge_page_keeps_the_record_its_own_does_not():
    """The allocator writes beside a heap tensor (chunk headers in its first page): that
    costs a comparison of the piece's own bytes there, not a hash; a change of those bytes
    is still seen."""
    _watch_or_skip()
    if write_watch.why_off():
        pytest.skip(write_watch.why_off())
    n = 4 * MiB
    m = private(n)
    m.write(os.urandom(n))
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    piece = (base + 100, 2 * MiB)  # shares its first page with bytes 0-99, its last with what follows
    with write_watch.compare_pass([piece]) as p:
        assert p.known(piece) is None
        p.record(piece, 0x1234)
    for where in (base + 10, piece[0] + piece[1] + 7):  # the neighbours' bytes, before and after
        flip(where)
        with write_watch.compare_pass([piece]) as p:
            assert p.known(piece) == 0x1234
    flip(piece[0] + 5)  # the piece's own byte in that shared page
    with write_watch.compare_pass([piece]) as p:
        assert p.known(piece) is None
    m.close()


def test_memory_freed_and_mapped_again_counts_as_changed(watch):
    n = 4 * MiB
    m = private(n)
    m.write(b"\2" * n)
    r = (ctypes.addressof(ctypes.c_char.from_buffer(m)), n)
    assert watch.arm([r]) == [True]
    watch.scan([r])
    m.close()
    m2 = private(n)  # most likely at the same address, with its own (unregistered) pages
    m2.write(b"\2" * n)
    try:
        assert watch.scan([r])[0] & write_watch.INSIDE
    finally:
        m2.close()


# ------------------------------------------------------------------ incremental saves


def big_state(step: int, frozen: dict) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {**frozen, "lora": torch.randn(256, 256, generator=g)}, "step": step}


def big_frozen(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(7)
    return {f"base.{i}": torch.randn(2 * MiB // 4, generator=g) for i in range(n)}


def run_saves(root, frozen, steps, **kw) -> list[fw.SaveStats]:
    out = []
    with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True, **kw) as w:
        for s in range(1, steps + 1):
            out.append(w.save(big_state(s, frozen), os.path.join(root, f"step-{s}")))
    return out


def test_saves_after_the_first_compare_skip_hashing_the_frozen_base(tmp_path):
    _watch_or_skip()
    if write_watch.why_off():
        pytest.skip(write_watch.why_off())
    frozen = big_frozen()
    fbytes = sum(t.nbytes for t in frozen.values())
    stats = run_saves(str(tmp_path), frozen, 5)
    # saves 2 and 3 hash the frozen base (and the watch records what they hashed whole);
    # from then on no write reaches it, and nothing of it is hashed again
    assert sum(s.compared_bytes for s in stats[1:3]) >= fbytes
    for s in stats[3:]:
        assert s.bytes_linked >= fbytes
        assert s.watched_bytes == fbytes
        assert s.compared_bytes < fbytes
    out = fw.load(str(tmp_path / "step-5"))
    for k, t in frozen.items():
        assert torch.equal(out["model"][k], t)
    assert fw.verify(str(tmp_path / "step-5"))


def test_a_tensor_changed_behind_torchs_back_is_written_and_loads_exactly(tmp_path):
    frozen = big_frozen()
    root = str(tmp_path)
    with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True) as w:
        for s in range(1, 4):
            w.save(big_state(s, frozen), os.path.join(root, f"step-{s}"))
        t = frozen["base.1"]
        v = t._version
        flip(t.data_ptr() + 3 * 4096 + 5)  # a plain store, no torch op: the version counter stays
        assert t._version == v
        st = w.save(big_state(4, frozen), os.path.join(root, "step-4"))
        assert st.bytes_written >= t.nbytes  # base.1's stripe was written, not linked
        out = fw.load(os.path.join(root, "step-4"))
        for k, x in frozen.items():
            assert torch.equal(out["model"][k].view(torch.uint8), x.view(torch.uint8)), k
        st = w.save(big_state(5, frozen), os.path.join(root, "step-5"))
        assert st.bytes_linked >= sum(x.nbytes for x in frozen.values()) - t.nbytes


def test_a_resume_by_load_into_between_saves_is_seen(tmp_path):
    """Loading an older checkpoint into the live state (io_uring reads) changes the bytes."""
    frozen = big_frozen()
    root = str(tmp_path)
    other = {k: torch.full_like(t, 0.5) for k, t in frozen.items()}
    fw.save({"model": other}, str(tmp_path.parent / f"{tmp_path.name}-other"))
    with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True) as w:
        for s in range(1, 4):
            w.save(big_state(s, frozen), os.path.join(root, f"step-{s}"))
        fw.load(str(tmp_path.parent / f"{tmp_path.name}-other"), into={"model": frozen})
        st = w.save(big_state(4, frozen), os.path.join(root, "step-4"))
    assert st.watched_bytes == 0
    out = fw.load(os.path.join(root, "step-4"))
    for k in frozen:
        assert torch.equal(out["model"][k], other[k])


def test_off_hashes_everything_with_the_same_result(tmp_path):
    code = (
        "import sys, torch, flashwrite as fw; sys.path.insert(0, sys.argv[2]);"
        "from test_write_watch import run_saves, big_frozen;"
        "from flashwrite.incremental import write_watch;"
        "st = run_saves(sys.argv[1], big_frozen(), 4);"
        "print(write_watch.why_off(), st[-1].watched_bytes, st[-1].bytes_linked, st[-1].compared_bytes)")
    here = os.path.dirname(os.path.abspath(_TESTS_FILE))
    env = {**os.environ, "FLASHWRITE_WRITE_WATCH": "off"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "off"), here], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    why, watched, linked, compared = r.stdout.rsplit(None, 3)
    assert why.strip() == "FLASHWRITE_WRITE_WATCH=off" and int(watched) == 0
    assert int(linked) >= 4 * 2 * MiB and int(compared) >= 4 * 2 * MiB
    env["FLASHWRITE_WRITE_WATCH"] = "sometimes"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad"), here], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "FLASHWRITE_WRITE_WATCH='sometimes'" in r.stderr


_FORK = r"""
import ctypes, faulthandler, json, os, sys
sys.path.insert(0, sys.argv[2])
import flashwrite as fw
from test_write_watch import MiB, big_frozen, big_state, run_saves

root = sys.argv[1]
frozen = big_frozen()
run_saves(root, frozen, 4)  # the parent recorded the frozen base
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(120, exit=True)  # a hung child never outlives the test
    res = {}
    try:
        ctypes.memset(frozen["base.0"].data_ptr() + 4096, 1, 1)  # the child's private copy changes
        with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True) as wr:
            st = wr.save(big_state(5, frozen), os.path.join(root, "step-5"))
        back = fw.load(os.path.join(root, "step-5"))["model"]
        # numpy, not torch: PyTorch's OpenMP pool hangs in a forked child once used
        res = {"watched": st.watched_bytes, "linked": st.bytes_linked,
               "same": all(back[k].numpy().tobytes() == t.numpy().tobytes() for k, t in frozen.items())}
    except BaseException as e:
        res["error"] = repr(e)
    os.write(w, json.dumps(res).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16).decode())
os.waitpid(pid, 0)
print(json.dumps(child))
"""


def test_a_forked_child_watches_on_its_own(tmp_path):
    """The child of a fork inherits the parent's records but not its registrations: its
    first compare hashes, and it sees its own change to the base."""
    here = os.path.dirname(os.path.abspath(_TESTS_FILE))
    r = subprocess.run([sys.executable, "-c", _FORK, str(tmp_path), here], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in child, child
    assert child["same"] is True and child["watched"] == 0
    assert child["linked"] >= 3 * 2 * MiB  # the other three frozen tensors are still linked


# ------------------------------------------------------------------ many written runs (issue 33, item 3)

BATCH = 512  # page regions per PAGEMAP_SCAN call (csrc/core/write_watch.cpp, kRegions)


def test_a_write_after_the_512th_written_run_of_one_span_is_seen(watch):
    """One scan call returns at most 512 runs of written pages; the scan goes on where the
    kernel stopped. Pieces sharing a page form one span, so a write to a piece that comes
    after 600 separately written runs of its neighbours must still be reported."""
    pages = 2000
    m = private(pages * 4096)
    m.write(os.urandom(pages * 4096))
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    # 40 pieces of 49.5 pages end to end: each shares its first and last page with a neighbour
    step = 49 * 4096 + 2048
    ranges = [(base + 100 + i * step, step) for i in range(40)]
    assert all(watch.arm(ranges))
    watch.scan(ranges)
    assert not any(f & write_watch.INSIDE for f in watch.scan(ranges))
    runs = BATCH + 100
    for k in range(runs):  # every other page from page 1: that many separate runs
        flip(base + (1 + 2 * k) * 4096 + 9)
    last = (1 + 2 * runs) * 4096  # the pages after them are clean...
    victim = next(i for i, (a, n) in enumerate(ranges) if a - base >= last + 8192)
    flip(ranges[victim][0] + ranges[victim][1] // 2)  # ... but this one's middle
    flags = watch.scan(ranges)
    assert flags[victim] & write_watch.INSIDE, (victim, flags)
    for i, (a, n) in enumerate(ranges):
        if a - base > last + 4096 and i != victim and i != victim - 1 and i != victim + 1:
            assert not flags[i] & write_watch.INSIDE, i  # and the others after them were not reported
    assert not any(f & write_watch.INSIDE for f in watch.scan(ranges))  # all protected again
    m.close()


def test_an_incremental_save_after_600_written_runs_writes_the_tensor_written_after_them(tmp_path):
    """The save's view of item 3: two tensors side by side in one mapping, their pieces
    sharing pages (one span); the first written in 600+ separate pages, the second in one
    place only. The second's stripe is written, not linked, and loads as it is now."""
    _watch_or_skip()
    if write_watch.why_off():
        pytest.skip(write_watch.why_off())
    na, n = 8 * MiB, 4 * MiB
    m = private(na + n + 3 * 4096)
    # two storages (views of one would be saved as one), neither page aligned: their pieces share pages
    a = torch.frombuffer(m, dtype=torch.uint8, offset=128, count=na)
    b = torch.frombuffer(m, dtype=torch.uint8, offset=128 + na, count=n)
    g = torch.Generator().manual_seed(5)
    a.copy_(torch.randint(0, 256, (na,), dtype=torch.uint8, generator=g))
    b.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    root = str(tmp_path)
    with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True) as w:
        for s in range(1, 4):
            st = w.save({"a": a, "b": b}, os.path.join(root, f"step-{s}"))
        assert st.watched_bytes == na + n  # both recorded: nothing hashed at step 3
        for k in range(BATCH + 100):  # 612 separate written runs in a (pages 1 to 1223 of its 2048)
            flip(a.data_ptr() + (1 + 2 * k) * 4096)
        flip(b.data_ptr() + n - 3 * MiB // 2)  # b: one byte, in a later piece
        st = w.save({"a": a, "b": b}, os.path.join(root, "step-4"))
        out = fw.load(os.path.join(root, "step-4"))
    assert torch.equal(out["b"], b) and torch.equal(out["a"], a)
    assert st.bytes_written >= na + n
    m.close()


# ------------------------------------------------------------------ the periodic re-hash (issue 33)


def fresh_frozen(n: int, seed: int) -> dict:
    """Frozen tensors with bytes no other test has: the watch is process-wide, and a record
    of an earlier test's piece at the same address with the same bytes stays valid (with
    the count of passes that trusted it)."""
    g = torch.Generator().manual_seed(seed)
    return {f"base.{i}": torch.randn(2 * MiB // 4, generator=g) for i in range(n)}


def frozen_saves(root, frozen, steps, **kw):
    """Saves of a frozen state only: every piece is hashed (and recorded) by the second."""
    with fw.Writer(stripes=2, chunk_bytes=MiB, incremental=True, **kw) as w:
        for s in range(1, steps + 1):
            yield w, w.save({"model": frozen, "step": s}, os.path.join(root, f"step-{s}"))


def test_the_periodic_rehash_catches_a_write_the_watch_missed(tmp_path, monkeypatch):
    """A watch made to miss a write on purpose (``BLIND``) links a changed tensor, until the
    re-hash due every FLASHWRITE_WATCH_RECHECK_EVERY passes finds it: then its stripe is
    written, SaveStats counts the miss, and a warning names it."""
    _watch_or_skip()
    if write_watch.why_off():
        pytest.skip(write_watch.why_off())
    monkeypatch.setenv(write_watch.RECHECK_ENV, "3")  # hashed, then vouched for twice, then hashed again
    frozen = fresh_frozen(4, 3301)
    fbytes = sum(t.nbytes for t in frozen.values())
    t = frozen["base.1"]
    root = str(tmp_path)
    saves = frozen_saves(root, frozen, 6)
    stats = [next(saves)[1] for _ in range(3)]
    assert stats[2].watched_bytes == fbytes and stats[2].rechecked_bytes == 0  # step 2 hashed, 3 trusted
    monkeypatch.setattr(write_watch, "BLIND", lambda r: t.data_ptr() <= r[0] < t.data_ptr() + t.nbytes)
    flip(t.data_ptr() + MiB + 4096 * 3 + 1)
    want = t.clone()
    _, st4 = next(saves)
    # the blind watch vouched for it (trusted a second time): linked, the earlier bytes
    assert st4.watched_bytes == fbytes and st4.watch_misses == 0 and st4.bytes_written == 0
    assert not torch.equal(fw.load(os.path.join(root, "step-4"))["model"]["base.1"], want)
    with pytest.warns(RuntimeWarning, match=r"missed a write to 1 tensors \(model\.base\.1\)"):
        _, st5 = next(saves)
    assert st5.watch_misses == 1 and st5.rechecked_bytes == fbytes and st5.watched_bytes == 0
    assert st5.bytes_written >= t.nbytes and st5.bytes_linked >= fbytes // 2  # the other stripe
    out = fw.load(os.path.join(root, "step-5"))["model"]
    assert torch.equal(out["base.1"].view(torch.uint8), want.view(torch.uint8))
    for k, x in frozen.items():
        assert torch.equal(out[k].view(torch.uint8), x.view(torch.uint8)), k
    monkeypatch.setattr(write_watch, "BLIND", None)
    _, st6 = next(saves)  # re-recorded: trusted again (base.1, changed at step 5, is a hot stripe now)
    saves.close()
    assert st6.watched_bytes == fbytes - t.nbytes and st6.watch_misses == 0 and st6.compared_bytes == 0


def test_the_rehash_interval_setting(monkeypatch):
    monkeypatch.delenv(write_watch.RECHECK_ENV, raising=False)
    assert 1 <= write_watch.recheck_every() == write_watch.RECHECK_EVERY <= 16
    monkeypatch.setenv(write_watch.RECHECK_ENV, "1")
    assert write_watch.recheck_every() == 1
    for bad in ("0", "-3", "often"):
        monkeypatch.setenv(write_watch.RECHECK_ENV, bad)
        with pytest.raises(ValueError, match=write_watch.RECHECK_ENV):
            write_watch.recheck_every()


def test_every_piece_is_hashed_again_at_least_every_n_saves(tmp_path, monkeypatch):
    """With no miss: each record vouches for at most N-1 saves in a row; the Nth hashes
    the frozen base again and still links it."""
    _watch_or_skip()
    if write_watch.why_off():
        pytest.skip(write_watch.why_off())
    monkeypatch.setenv(write_watch.RECHECK_ENV, "4")
    frozen = fresh_frozen(2, 3302)
    fbytes = sum(t.nbytes for t in frozen.values())
    stats = [st for _, st in frozen_saves(str(tmp_path), frozen, 10)]
    # step 1 writes, 2 hashes; then 3 vouched, 1 re-hashed, and again
    assert [s.rechecked_bytes for s in stats] == [0, 0, 0, 0, 0, fbytes, 0, 0, 0, fbytes]
    assert [s.watched_bytes for s in stats] == [0, 0, fbytes, fbytes, fbytes, 0, fbytes, fbytes, fbytes, 0]
    assert all(s.watch_misses == 0 and s.bytes_linked >= fbytes for s in stats[1:])
