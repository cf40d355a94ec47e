"""The operator commands and DCP on nfs:// targets (issue 22), against the real server of
test_nfs.py (nfs-ganesha on 127.0.0.1, tests/nfs_server.py): ``flashwrite ls``, ``diff``
and ``convert`` read and write checkpoints on the export, and DCP's save and load go
through ``FlashwriteStorageWriter``/``Reader`` with an nfs:// path. What lands on the
server is the same format as a local save: each side loads what the other wrote."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import flashwrite as fw
from conftest import assert_same
from fault_util import flip_byte, temp_entries
from flashwrite import nfs
from flashwrite.dcp import FlashwriteStorageReader, FlashwriteStorageWriter
from flashwrite.format import decode_manifest_json
from ops_helpers import run, save, state

pytestmark = [pytest.mark.nfs, pytest.mark.usefixtures("nfs_staging"),
              # DCP warns, by design, when it runs without a process group: one process is the case here
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


# ------------------------------------------------------------------------- ls

def test_ls_lists_a_manager_root_on_the_export(capsys, nfs_server):
    url = nfs_server.url("run") + "?connections=2"
    mgr = fw.CheckpointManager(url, every_n_steps=1, keep_last=5, writer=fw.Writer(stripes=2))
    try:
        for step in (10, 20):
            mgr.maybe_save(step, state(step)).result()
    finally:
        mgr.close()
    run_dir = os.path.join(nfs_server.export, "run")
    # made through the server (ganesha caches directories: changes behind its back show late)
    target, inner = nfs.target_for(url, "test")
    target.make_dir(inner + "/step-00000030")  # a crash before the manifest
    target.make_dir(inner + "/.step-00000040.flashwrite-tmp-999999999-abc")
    target.make_dir(inner + "/logs")  # not a checkpoint: not listed
    rc, out, _ = run(capsys, "ls", url, "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [(r["step"], r["status"], r["tier"]) for r in rows] == [
        (10, "complete", "storage"), (20, "complete", "storage"), (30, "incomplete", "storage"),
        (None, "temporary", "storage")]
    for r, step in zip(rows, (10, 20)):
        with open(os.path.join(run_dir, f"step-{step:08d}", "flashwrite.json"), "rb") as fh:
            m = decode_manifest_json(fh.read().decode())
        assert r["bytes"] == sum(f["size"] for f in m["files"]) and r["tensors"] == len(m["tensors"])
        assert r["path"] == nfs_server.url(f"run/step-{step:08d}")  # a URL the other commands take
        assert r["verified"] == "no"
    # verify through nfs:// records it on the server; ls then shows it
    assert run(capsys, "verify", rows[0]["path"], "-q")[0] == 0
    rows = {r["step"]: r for r in json.loads(run(capsys, "ls", url, "--json")[1])}
    assert rows[10]["verified"] == "yes" and rows[20]["verified"] == "no"
    rc, out, _ = run(capsys, "ls", url)
    assert rc == 0 and "step-00000020" in out and "incomplete" in out and nfs_server.url("run") in out
    # one checkpoint; a damaged manifest; a missing root
    rc, out, _ = run(capsys, "ls", nfs_server.url("run/step-00000010"), "--json")
    assert rc == 0 and [r["step"] for r in json.loads(out)] == [10]
    target.remove_file(inner + "/step-00000020/flashwrite.json")
    target.write_durable(inner + "/step-00000020/flashwrite.json", b"{not json")
    rc, out, err = run(capsys, "ls", url)
    assert rc == 1 and "damaged" in out and "step-00000020" in err
    rc, _, err = run(capsys, "ls", nfs_server.url("nope"))
    assert rc == 2 and nfs_server.url("nope") in err  # not there: a usage error


# ----------------------------------------------------------------------- diff

def test_diff_with_either_side_on_nfs(capsys, nfs_server, tmp_path):
    local_a = save(str(tmp_path / "a"), stripes=2)
    sd = state()
    sd["model"]["w"] = sd["model"]["w"].clone()
    sd["model"]["w"][3, 4] += 1
    sd["optim"]["lr"] = 0.2
    fw.save(sd, nfs_server.url("b"), stripes=2)
    fw.save(state(), nfs_server.url("a"), stripes=2)
    url_a, url_b = nfs_server.url("a"), nfs_server.url("b")

    rc, out, _ = run(capsys, "diff", local_a, url_a, "--json")
    r = json.loads(out)
    assert rc == 0 and r["identical"] and r["b"] == url_a
    for deep in ((), ("--deep",)):
        for a, b in ((local_a, url_b), (url_a, url_b), (url_b, local_a)):
            rc, out, _ = run(capsys, "diff", a, b, "--json", *deep)
            r = json.loads(out)
            assert rc == 1 and r["changed_content"] == ["model.w"], (a, b, deep, r)
            assert [x["path"] for x in r["leaves"]] == ["optim.lr"]
    # --deep reads the stripes on the server: a flipped byte there is found, where the
    # stored checksums (unchanged) still agree
    name = next(n for n in os.listdir(os.path.join(nfs_server.export, "a")) if n.endswith(".safetensors")
                and "model.w" in _stripe_keys(os.path.join(nfs_server.export, "a", n)))
    path = os.path.join(nfs_server.export, "a", name)
    off = _tensor_offset(path, "model.w")
    flip_byte(path, off, 0xFF)
    assert run(capsys, "diff", local_a, url_a, "--json")[0] == 0
    rc, out, _ = run(capsys, "diff", local_a, url_a, "--json", "--deep")
    assert rc == 1 and json.loads(out)["changed_content"] == ["model.w"]


def _stripe_keys(path: str) -> set[str]:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return set(json.loads(fh.read(n))) - {"__metadata__"}


def _tensor_offset(path: str, key: str) -> int:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return 8 + n + json.loads(fh.read(n))[key]["data_offsets"][0]


# -------------------------------------------------------------------- convert

def test_convert_to_and_from_nfs(capsys, nfs_server, tmp_path):
    """A torch.save file becomes a flashwrite checkpoint on the server; that converts back
    to a local safetensors file and a local checkpoint; every step byte-exact."""
    sd = state(3)
    pt = str(tmp_path / "model.pt")
    torch.save(sd, pt)
    url = nfs_server.url("conv") + "?connections=2"
    rc, out, _ = run(capsys, "convert", pt, url, "--stripes", "2", "--json", "-q")
    assert rc == 0 and json.loads(out)["destination"] == url and json.loads(out)["to"] == "flashwrite"
    on_export = os.path.join(nfs_server.export, "conv")
    fw.verify(on_export)
    assert_same(fw.load(on_export), sd)
    assert_same(fw.load(url), sd)
    assert temp_entries(nfs_server.export) == []

    rc, _, err = run(capsys, "convert", pt, url, "-q")  # it exists now
    assert rc == 1 and "already exists" in err and nfs_server.url("conv") in err
    assert run(capsys, "convert", pt, url, "--overwrite", "-q")[0] == 0
    assert_same(fw.load(on_export), sd)

    back = str(tmp_path / "back")
    assert run(capsys, "convert", url, back, "--to", "flashwrite", "-q")[0] == 0
    assert_same(fw.load(back), sd)
    st = str(tmp_path / "flat.safetensors")
    assert run(capsys, "convert", url, st, "-q")[0] == 0
    flat = safetensors.torch.load_file(st)
    assert torch.equal(flat["model.w"], sd["model"]["w"])
    # nfs:// to nfs://
    assert run(capsys, "convert", url, nfs_server.url("conv2"), "--to", "flashwrite", "-q")[0] == 0
    assert_same(fw.load(os.path.join(nfs_server.export, "conv2")), sd)


def test_convert_refuses_foreign_formats_on_nfs_and_catches_damage(capsys, nfs_server, tmp_path):
    url = nfs_server.url("ck")
    fw.save(state(), url, stripes=1)
    for argv in (["convert", str(save(str(tmp_path / "l"))), nfs_server.url("x.safetensors")],
                 ["convert", url, nfs_server.url("y"), "--to", "torch"],
                 ["convert", url, str(tmp_path / "z"), "--from", "dcp"]):
        rc, _, err = run(capsys, *argv, "-q")
        assert rc == 2 and "nfs://" in err, (argv, err)
    assert sorted(os.listdir(nfs_server.export)) == ["ck"]
    # a stripe damaged on the server does not convert
    stripe = next(n for n in os.listdir(os.path.join(nfs_server.export, "ck")) if n.endswith(".safetensors"))
    path = os.path.join(nfs_server.export, "ck", stripe)
    off = _tensor_offset(path, "model.w")
    with open(path, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\xff\xff")
    rc, _, err = run(capsys, "convert", url, str(tmp_path / "out.safetensors"), "-q")
    assert rc == 1 and "checksum mismatch" in err
    assert not os.path.exists(tmp_path / "out.safetensors") and temp_entries(str(tmp_path)) == []


# ------------------------------------------------------------------------- DCP

def _dcp_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "i": torch.arange(1000, dtype=torch.int64), "extra": {"step": seed, "name": "run"}}


def _zeros_like(sd: dict) -> dict:
    """A load template: zeroed tensors, and None where DCP fills in a non-tensor value."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else _zeros_like(v) if isinstance(v, dict)
            else None for k, v in sd.items()}


def test_dcp_round_trip_through_nfs_and_across_paths(nfs_server):
    sd = _dcp_state(1)
    url = nfs_server.url("dcp") + "?connections=2"
    w = FlashwriteStorageWriter(url, stripes=2)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.last_stats.backend == "nfs"  # the stripes went over the NFS connections
    on_export = os.path.join(nfs_server.export, "dcp")
    fw.verify(on_export)
    assert FlashwriteStorageReader.validate_checkpoint_id(url)
    for path in (url, on_export):  # through nfs:// and from the export's local path
        got = _zeros_like(sd)
        dcp.load(got, storage_reader=FlashwriteStorageReader(path), no_dist=True)
        assert_same(got, sd)
    # the other way round: written locally into the export, read through nfs://
    sd2 = _dcp_state(2)
    dcp.save(sd2, storage_writer=FlashwriteStorageWriter(os.path.join(nfs_server.export, "local"), stripes=2),
             no_dist=True)
    got = _zeros_like(sd2)
    dcp.load(got, storage_reader=FlashwriteStorageReader(nfs_server.url("local")), no_dist=True)
    assert_same(got, sd2)
    # checkpoint_id= on reused instances; no overwrite with overwrite=False
    w2, r2 = FlashwriteStorageWriter(stripes=1), FlashwriteStorageReader()
    dcp.save(sd2, storage_writer=w2, checkpoint_id=nfs_server.url("by-id"), no_dist=True)
    got = _zeros_like(sd2)
    dcp.load(got, storage_reader=r2, checkpoint_id=nfs_server.url("by-id"), no_dist=True)
    assert_same(got, sd2)
    with pytest.raises(CheckpointException) as ei:  # DCP wraps what the storage raised, by rank
        dcp.save(sd, storage_writer=FlashwriteStorageWriter(url, stripes=2, overwrite=False), no_dist=True)
    assert isinstance(ei.value.failures[0][0], fw.CheckpointExistsError)
    assert temp_entries(nfs_server.export) == []


def test_dcp_async_save_through_nfs(nfs_server):
    sd = _dcp_state(3)
    url = nfs_server.url("async")
    fut = dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(url, stripes=2), no_dist=True)
    fut.result(timeout=120)
    got = _zeros_like(sd)
    dcp.load(got, storage_reader=FlashwriteStorageReader(os.path.join(nfs_server.export, "async")), no_dist=True)
    assert_same(got, sd)
    assert temp_entries(nfs_server.export) == []


def _dcp_ranks(url: str, staging: str) -> list:
    import torch.distributed as dist
    os.environ["FLASHWRITE_NFS_STAGING"] = staging  # the workers fork from an earlier test's forkserver
    rank = dist.get_rank()
    sd = {"shared": torch.arange(5000, dtype=torch.float32), f"own{rank}": torch.full((777,), float(rank)),
          "step": 4}
    dcp.save(sd, storage_writer=FlashwriteStorageWriter(url, stripes=2))
    got = {"shared": torch.zeros(5000), f"own{rank}": torch.zeros(777), "step": None}
    dcp.load(got, storage_reader=FlashwriteStorageReader(url))
    assert torch.equal(got["shared"], sd["shared"]) and torch.equal(got[f"own{rank}"], sd[f"own{rank}"])
    assert got["step"] == 4
    return [rank]


def test_dcp_two_gloo_ranks_save_and_load_through_nfs(nfs_server, nfs_staging):
    from dist_helpers import Cluster
    url = nfs_server.url("ranks") + "?connections=2&timeout=30"
    with Cluster(2) as cluster:
        assert cluster.run(_dcp_ranks, url, str(nfs_staging)) == [[0], [1]]
    whole = fw.load(os.path.join(nfs_server.export, "ranks"))
    assert torch.equal(whole["shared"], torch.arange(5000, dtype=torch.float32))
    assert torch.equal(whole["own1"], torch.full((777,), 1.0))
    assert temp_entries(nfs_server.export) == []
