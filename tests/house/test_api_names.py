"""One name, one meaning, across the public entry points (issue 24, item 7)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite import CheckpointManager, Writer
from flashwrite.errors import CheckpointExistsError

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")


def _overwrite_default(fn) -> bool:
    return inspect.signature(fn).parameters["overwrite"].default


def test_overwrite_defaults_to_false_everywhere_but_dcp():
    from flashwrite.integrations.dcp import FlashwriteStorageWriter

    assert _overwrite_default(Writer.save_async) is False
    assert _overwrite_default(CheckpointManager.save) is False
    assert _overwrite_default(CheckpointManager.save_async) is False
    # DCP's contract (torch's FileSystemWriter): code written for DCP saves to one path again
    assert _overwrite_default(FlashwriteStorageWriter.__init__) is True


def _files(path) -> dict[str, bytes]:
    out = {}
    for n in sorted(os.listdir(path)):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_the_dcp_writer_refuses_to_replace_a_checkpoint_with_overwrite_false(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter

    def run(sd, **kw):
        w = FlashwriteStorageWriter(tmp_path / "ck", stripes=2, **kw)
        if how == "save":
            dcp.save(sd, storage_writer=w)
        else:
            dcp.async_save(sd, storage_writer=w).result(60)

    first = {"a": torch.arange(1000.0), "b": torch.ones(7, dtype=torch.int64)}
    second = {"a": torch.arange(1000.0) * 2, "b": torch.zeros(7, dtype=torch.int64)}
    run(first)
    before = _files(tmp_path / "ck")
    with pytest.raises(BaseException) as ei:  # DCP wraps it in CheckpointException, a BaseException
        run(second, overwrite=False)
    assert isinstance(ei.value, CheckpointExistsError) or "CheckpointExistsError" in str(ei.value), ei.value
    assert _files(tmp_path / "ck") == before          # the first checkpoint, byte for byte
    assert sorted(os.listdir(tmp_path)) == ["ck"]     # and no temporary directory left beside it

    run(second, overwrite=True)
    got = {"a": torch.empty(1000), "b": torch.empty(7, dtype=torch.int64)}
    dcp.load(got, storage_reader=FlashwriteStorageReader(tmp_path / "ck"))
    assert_same(got, second)


def test_fw_save_refuses_to_replace_a_checkpoint_unless_asked(tmp_path):
    fw.save({"a": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(CheckpointExistsError):
        fw.save({"a": torch.zeros(3)}, tmp_path / "ck")
    fw.save({"a": torch.zeros(3)}, tmp_path / "ck", overwrite=True)
    assert_same(fw.load(tmp_path / "ck"), {"a": torch.zeros(3)})


def test_manager_save_async_returns_once_staged_and_save_is_the_same(tmp_path):
    with CheckpointManager(tmp_path / "root") as m:
        sd = {"a": torch.arange(100.0)}
        f1 = m.save_async(1, sd)
        assert isinstance(f1, fw.SaveFuture) and f1.staged
        sd["a"].add_(1)  # staged: the caller may change its tensors at once
        f2 = m.save(2, sd)  # the old name: the same future, not SaveStats
        assert isinstance(f2, fw.SaveFuture)
        assert f2.result(60).path == m.path_for(2)
        m.wait()
        assert m.all_steps() == [1, 2]
        assert_same(fw.load(m.path_for(1)), {"a": torch.arange(100.0)})
        assert_same(fw.load(m.path_for(2)), {"a": torch.arange(100.0) + 1})


def test_local_snapshots_is_a_flag_and_find_local_snapshots_lists_them(tmp_path, shmdir):
    w = Writer(local_snapshots=True, local_dir=shmdir)
    assert w.local_snapshots is True
    with Writer() as plain:
        assert plain.local_snapshots is False
    with w, CheckpointManager(tmp_path / "root", writer=w, local_snapshots=True) as m:
        m.save_async(5, {"a": torch.ones(4)}).result(60)
        found = m.find_local_snapshots()
        assert list(found) == [5] and found[5][0].path == m.path_for(5)
        assert not hasattr(m, "local_snapshots")  # the 0.1.0 name, removed before any release
