"""FlashwriteStorageWriter keeps DCP's own contract (issue 35, items 11-12), checked against
torch's FileSystemWriter: overwrite by default and atomically, an empty directory written
into with overwrite=False, DCP's own "already exists" error; and async_save with the
process executor refused at the call, on real gloo ranks."""

from __future__ import annotations

import os
import pickle
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from flashwrite.saving import commit
from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter
from flashwrite.errors import CheckpointExistsError

from dist_helpers import Cluster

# DCP warns, by design, when it runs without an initialized process group, and its
# FileSystemWriter warns on every overwrite: both are what these tests exercise.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")]

DCP_EXISTS = re.escape("Checkpoint already exists and self.overwrite=False.")


def _state(v: float) -> dict:
    return {"a": torch.full((1000,), v), "b": torch.arange(7) + int(v)}


def _load(path) -> dict:
    got = {"a": torch.empty(1000), "b": torch.empty(7, dtype=torch.int64)}
    dcp.load(got, storage_reader=FlashwriteStorageReader(path))
    return got


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _files(path) -> dict[str, bytes]:
    out = {}
    for n in sorted(os.listdir(path)):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = f.read()
    return out


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_saving_twice_to_one_path_replaces_it_as_dcp_does(tmp_path, how):
    def run(writer, v):
        if how == "save":
            dcp.save(_state(v), storage_writer=writer)
        else:
            dcp.async_save(_state(v), storage_writer=writer).result(60)

    for v in (1.0, 2.0):  # torch's own writer: the second save replaces the first
        run(dcp.FileSystemWriter(tmp_path / "theirs"), v)
        run(FlashwriteStorageWriter(tmp_path / "ours", stripes=2), v)
    assert _same(_load(tmp_path / "ours"), _state(2.0))
    assert sorted(os.listdir(tmp_path)) == ["ours", "theirs"]  # no temporary or moved-aside directory left


def test_a_replacement_that_fails_leaves_the_earlier_checkpoint_whole(tmp_path):
    from fault_util import tmpfs
    with tmpfs(str(tmp_path / "small"), "2m") as small:
        path = os.path.join(small, "ck")
        dcp.save(_state(1.0), storage_writer=FlashwriteStorageWriter(path, stripes=2))
        before = _files(path)
        big = {"a": torch.zeros(1 << 20), "b": torch.arange(7)}  # 4 MiB into what is left of 2 MiB
        with pytest.raises(BaseException) as ei:  # DCP wraps it in CheckpointException, a BaseException
            dcp.save(big, storage_writer=FlashwriteStorageWriter(path, stripes=2))
        assert "No space left" in str(ei.value) or "ENOSPC" in str(ei.value), ei.value
        assert _files(path) == before and _same(_load(path), _state(1.0))
        # DCP tells the storage nothing of a failure: the next save to the path removes what it left
        assert all(commit.is_temp_name(n) for n in os.listdir(small) if n != "ck")
        dcp.save(_state(3.0), storage_writer=FlashwriteStorageWriter(path, stripes=2))
        assert os.listdir(small) == ["ck"] and _same(_load(path), _state(3.0))


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_overwrite_false_refuses_with_dcps_own_error_and_takes_an_empty_directory(tmp_path, how):
    def run(writer, v):
        if how == "save":
            dcp.save(_state(v), storage_writer=writer)
        else:
            dcp.async_save(_state(v), storage_writer=writer).result(60)

    errors = {}
    for name, cls in (("theirs", dcp.FileSystemWriter), ("ours", FlashwriteStorageWriter)):
        os.makedirs(tmp_path / name)  # an empty directory: written into
        run(cls(tmp_path / name, overwrite=False), 1.0)
        before = _files(tmp_path / name)
        with pytest.raises(BaseException) as ei:
            run(cls(tmp_path / name, overwrite=False), 2.0)
        errors[name] = ei.value
        assert _files(tmp_path / name) == before  # refused: the first one, byte for byte
    assert re.search(DCP_EXISTS, str(errors["theirs"])), errors["theirs"]
    assert re.search(DCP_EXISTS, str(errors["ours"])), errors["ours"]  # code matching DCP's text still matches
    ours = errors["ours"]
    ours = ours.failures[0][0] if hasattr(ours, "failures") else ours  # dcp.save wraps it by rank
    assert isinstance(ours, RuntimeError) and isinstance(ours, CheckpointExistsError)
    assert _same(_load(tmp_path / "ours"), _state(1.0))
    assert sorted(os.listdir(tmp_path)) == ["ours", "theirs"]


def test_the_writer_does_not_pickle_and_says_which_executor_to_use(tmp_path):
    with pytest.raises(TypeError, match="AsyncCheckpointerType.THREAD"):
        pickle.dumps(FlashwriteStorageWriter(tmp_path / "ck"))


# -------------------------------------------------------------- the process executor, on 2 gloo ranks


def _async_save_in_a_process(root: str) -> dict:
    group = dist.new_group(backend="gloo")
    path = os.path.join(root, "ck")
    rank = dist.get_rank()
    sd = {f"w{rank}": torch.full((100,), float(rank)), "rep": torch.arange(10.0)}
    out: dict = {}
    try:
        fut = dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path, stripes=1), process_group=group,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        try:
            fut.result(120)
            out["call"] = "saved"
        except BaseException as e:  # noqa: BLE001 - where torch reported it, before the fix
            out["call"] = "returned"
            out["result"] = f"{type(e).__name__}: {e}"[-500:]
    except ValueError as e:
        out["call"] = "raised"
        out["error"] = str(e)
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path, stripes=1), process_group=group).result(120)
    got = {f"w{rank}": torch.empty(100), "rep": torch.empty(10)}
    dcp.load(got, storage_reader=FlashwriteStorageReader(path))
    out["then_thread"] = torch.equal(got[f"w{rank}"], sd[f"w{rank}"]) and torch.equal(got["rep"], sd["rep"])
    return out


def test_async_save_with_the_process_executor_is_refused_at_the_call(tmp_path):
    with Cluster(2) as c:
        outs = c.run(_async_save_in_a_process, str(tmp_path))
    for out in outs:
        assert out["call"] == "raised", out
        assert "AsyncCheckpointerType.THREAD" in out["error"]
        assert out["left"] == []  # nothing was staged or created before the refusal
        assert out["then_thread"]  # the thread executor then saves to the same path
