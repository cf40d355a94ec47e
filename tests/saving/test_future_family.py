"""save_async and load_async return futures of one family (``CheckpointFuture``): real
``concurrent.futures.Future``s with path, wait() and stats, so code that waits on a
save and a load treats both alike."""

import concurrent.futures
import errno
import os

import pytest
import torch
from conftest import assert_same

import flashwrite as fw


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.arange(1000, dtype=torch.int16),
            "nested": {"h": torch.randn(17, generator=g).to(torch.bfloat16), "epoch": 3}}


def test_save_and_load_futures_are_one_family(writer, ckdir):
    sd = _state()
    sf = writer.save_async(sd, ckdir / "ck")
    assert isinstance(sf, fw.CheckpointFuture) and isinstance(sf, concurrent.futures.Future)
    assert sf.wait(60) is True and sf.done()
    st = sf.result()
    assert sf.stats is st and st.path == sf.path == str(ckdir / "ck")

    lf = fw.load_async(ckdir / "ck")
    assert isinstance(lf, fw.LoadFuture) and isinstance(lf, fw.CheckpointFuture)
    assert isinstance(lf, concurrent.futures.Future)  # what load_async returned before: still true
    assert lf.path == str(ckdir / "ck")
    assert lf.wait(60) is True
    assert_same(lf.result(), sd)
    ls = lf.stats
    assert (ls.tensors, ls.bytes) == (3, 300 * 70 * 4 + 1000 * 2 + 17 * 2)
    assert ls.total_s >= ls.queued_s >= 0 and ls.path == lf.path


def test_concurrent_futures_wait_and_as_completed_take_both(writer, ckdir):
    writer.save(_state(1), ckdir / "old")
    sf = writer.save_async(_state(2), ckdir / "new")
    lf = fw.load_async(ckdir / "old")
    done, pending = concurrent.futures.wait([sf, lf], timeout=60)
    assert done == {sf, lf} and not pending
    assert {f for f in concurrent.futures.as_completed([sf, lf], timeout=60)} == {sf, lf}
    assert_same(lf.result(), _state(1))
    assert_same(fw.load(ckdir / "new"), _state(2))


def test_done_callbacks_get_the_future_itself(writer, ckdir):
    seen = []
    sf = writer.save_async(_state(), ckdir / "ck")
    sf.add_done_callback(seen.append)
    sf.result(60)
    lf = fw.load_async(ckdir / "ck")
    lf.add_done_callback(seen.append)
    lf.result(60)
    assert seen == [sf, lf]


def test_wait_reports_the_end_and_result_raises_the_error(ckdir):
    lf = fw.load_async(ckdir / "missing")
    assert lf.wait(60) is True  # ended; the error is result()'s to raise, not wait()'s
    assert not lf.cancel()      # too late to cancel a load that has ended
    with pytest.raises(FileNotFoundError) as ei:
        lf.result()
    assert ei.value.errno == errno.ENOENT
    assert isinstance(lf.exception(), FileNotFoundError)
    assert lf.stats.total_s is None and "failed" in repr(lf)



def test_load_async_resolves_a_relative_path_at_the_call(tmp_path, monkeypatch):
    """Issue 44 item 8: the load's thread ran after the call returned and resolved the
    relative path then, so an os.chdir in between loaded another directory's checkpoint."""
    import threading
    from flashwrite.loading import load as loading
    for d, seed in (("a", 1), ("b", 2)):
        fw.save(_state(seed), str(tmp_path / d / "ck"))
    fw.load_async(str(tmp_path / "a" / "ck")).result()  # the load pool exists
    gate = threading.Event()
    busy = [loading._load_pool.submit(gate.wait) for _ in range(2)]  # its two threads held
    monkeypatch.chdir(tmp_path / "a")
    try:
        fut = fw.load_async("ck")
        os.chdir(tmp_path / "b")
    finally:
        gate.set()
    concurrent.futures.wait(busy)
    assert_same(fut.result(), _state(1))
