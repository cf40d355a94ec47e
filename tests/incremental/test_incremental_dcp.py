"""Incremental DCP saves (flashwrite.dcp with Writer(incremental=True)), with real processes
(gloo on localhost): each rank compares the write items DCP gave it with its own part of
the newest committed DCP checkpoint and hard-links the stripes that did not change."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import flashwrite as fw
from flashwrite.incremental import link as incremental
from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter
from flashwrite.format import decode_manifest_json, encode_manifest, read_manifest
from flashwrite.ops.diff import diff

from dist_helpers import Cluster
from test_incremental import assert_same, stripes_of

CHUNK = 1 << 20
N_FROZEN = 4

# DCP warns, by design, when it runs without an initialized process group (the one-process saves and loads here).
single_process = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")


def frozen(seed: int = 99) -> dict:
    """A LoRA-like frozen base, the same on every rank (DDP-like: DCP saves each item once)."""
    g = torch.Generator().manual_seed(seed)
    return {f"base.{i}": torch.randn(1 << 18, generator=g).to(torch.bfloat16) for i in range(N_FROZEN)}


def state_of(rank: int, step: int, *, changed: str | None = None) -> dict:
    """Rank ``rank``'s state at ``step``: the replicated frozen base (with tensor ``changed``
    different, if given), a frozen tensor of its own, and adapters + moments that change."""
    base = frozen()
    if changed is not None:
        base[changed] = base[changed] + 1
    g = torch.Generator().manual_seed(step)
    own = torch.full((1 << 16,), float(rank + 1))
    return {"model": {**base, "lora.a": torch.randn(64, 128, generator=g), f"own{rank}": own},
            "optim": {"exp_avg": torch.randn(64, 128, generator=g), "step": step}}


def template(rank: int) -> dict:
    """What dcp.load fills: the state's shapes, other values."""
    return {"model": {**{k: torch.zeros_like(v) for k, v in frozen().items()}, "lora.a": torch.zeros(64, 128),
                      f"own{rank}": torch.zeros(1 << 16)},
            "optim": {"exp_avg": torch.zeros(64, 128), "step": -1}}


def summary(s: fw.SaveStats | None) -> dict:
    if s is None:
        return {}
    return {"incremental": s.incremental, "bytes": s.bytes, "written": s.bytes_written, "linked": s.bytes_linked,
            "stripes_linked": s.stripes_linked, "fallbacks": s.link_fallbacks}


_dcp_pg = None


def dcp_group():
    """async_save's collectives run from its own thread: a group of their own, as DCP asks."""
    global _dcp_pg
    if _dcp_pg is None:
        _dcp_pg = dist.new_group(backend="gloo")
    return _dcp_pg


def _save_steps(root: str, steps: list[int], how: str, changed: dict[int, str] | None = None) -> list[dict]:
    """Save ``steps`` in turn through DCP (``how``: save, async, or mixed: odd steps async);
    each rank then loads every one back through dcp.load, byte-exact."""
    rank = dist.get_rank()
    out = []
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        for step in steps:
            sd = state_of(rank, step, changed=(changed or {}).get(step))
            sw = FlashwriteStorageWriter(os.path.join(root, f"step-{step}"), writer=w)
            if how == "save" or (how == "mixed" and step % 2 == 0):
                dcp.save(sd, storage_writer=sw)
            else:
                dcp.async_save(sd, storage_writer=sw, process_group=dcp_group()).result(120)
            out.append(summary(sw.last_stats))
    for step in steps:
        got = template(rank)
        dcp.load(got, storage_reader=FlashwriteStorageReader(os.path.join(root, f"step-{step}")))
        assert_same(got, state_of(rank, step, changed=(changed or {}).get(step)))
    return out


def flat_of(step: int, changed: str | None = None) -> dict:
    """What fw.load returns for a 2-rank checkpoint: tensors by key, DCP's byte items as bytes."""
    out = {}
    for r in (0, 1):
        s = state_of(r, step, changed=changed)
        out.update({f"model.{k}": v for k, v in s["model"].items()})
        out["optim.exp_avg"] = s["optim"]["exp_avg"]
    return out


def assert_loads(path: str, step: int, changed: str | None = None) -> None:
    """One process: fw.load byte-exact, dcp.load of the whole state, verify and the CLI."""
    flat = fw.load(path)
    want = flat_of(step, changed)
    assert_same({k: v for k, v in flat.items() if torch.is_tensor(v)}, want)
    got = {"model": {**template(0)["model"], "own1": torch.zeros(1 << 16)}, "optim": template(0)["optim"]}
    dcp.load(got, storage_reader=FlashwriteStorageReader(path), no_dist=True)
    assert got["optim"]["step"] == step
    assert_same({f"model.{k}": v for k, v in got["model"].items()} | {"optim.exp_avg": got["optim"]["exp_avg"]},
                want)
    fw.verify(path)
    for cmd in (["verify", path], ["ls", os.path.dirname(path)]):
        p = subprocess.run([sys.executable, "-m", "flashwrite", *cmd], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


@single_process
# async and mixed (each 10-15 s on CI) run in the slow job; save stays in the README suite.
@pytest.mark.parametrize("how", ["save", pytest.param("async", marks=pytest.mark.slow),
                                 pytest.param("mixed", marks=pytest.mark.slow)])  # mixed: the owners of stage() and of DCP's dedup agree
def test_third_save_links_every_unchanged_stripe(cluster2, tmp_path, how):
    res = cluster2.run(_save_steps, str(tmp_path), [1, 2, 3], how)
    for stats in res:
        assert stats[0]["incremental"] == "on: no earlier checkpoint to link from" and stats[0]["linked"] == 0
        assert stats[1]["incremental"] == "on"
        assert stats[2]["incremental"] == "on" and stats[2]["fallbacks"] == 0
        assert stats[2]["written"] + stats[2]["linked"] == stats[2]["bytes"]
    frozen_bytes = sum(t.nbytes for t in frozen().values()) + 2 * (1 << 18)  # the base, and both own tensors
    linked = sum(r[2]["linked"] for r in res)
    written = sum(r[2]["written"] for r in res)
    assert linked >= frozen_bytes and written < 0.1 * linked
    assert all(r[2]["linked"] > 0 for r in res)  # both ranks own some of the replicated base, save after save

    # The merged manifest: each rank's incremental section, the totals, each rank's span of the files.
    raw = read_manifest(str(tmp_path / "step-3")).raw
    sec = raw["incremental"]
    assert sec["base"] == "step-2" and len(sec["ranks"]) == 2
    assert (sec["linked_bytes"], sec["written_bytes"]) == (linked, written)
    assert incremental.byte_counts(raw) == (written, linked)  # what ls/inspect show
    spans = raw["dcp"]["ranks"]
    assert spans["world_size"] == 2 and "ranks" not in raw  # a load still sees one DCP state
    for rank, (first, count) in enumerate(spans["files"]):
        files = raw["files"][first:first + count]
        assert files and all(f["name"].startswith(f"model-rank{rank:05d}-") for f in files)
        assert any(f.get("linked") for f in files) and any(f.get("hot") for f in files)
    # Linked stripes are the base's inodes (two names each); written ones are new.
    a, b = stripes_of(str(tmp_path / "step-2")), stripes_of(str(tmp_path / "step-3"))
    inodes_a = {f["ino"] for f in a.values()}
    for f in b.values():
        assert (f["ino"] in inodes_a) == bool(f.get("linked"))
        assert (f["nlink"] >= 2) == bool(f.get("linked"))
    d = diff(str(tmp_path / "step-2"), str(tmp_path / "step-3"))
    assert d["changed_content"] == ["model.lora.a", "optim.exp_avg"]
    assert_loads(str(tmp_path / "step-3"), 3)

    # Deleting the bases leaves the newest checkpoint whole.
    shutil.rmtree(tmp_path / "step-1")
    shutil.rmtree(tmp_path / "step-2")
    assert all(f["nlink"] == 1 for f in stripes_of(str(tmp_path / "step-3")).values())
    assert_loads(str(tmp_path / "step-3"), 3)


@single_process
def test_a_changed_tensor_is_written_not_linked(cluster2, tmp_path):
    res = cluster2.run(_save_steps, str(tmp_path), [1, 2, 3], "save", {3: "base.1"})
    assert sum(r[2]["linked"] for r in res) > 0
    m2, m3 = read_manifest(str(tmp_path / "step-2")), read_manifest(str(tmp_path / "step-3"))
    b = stripes_of(str(tmp_path / "step-3"))
    inodes_2 = {f["ino"] for f in stripes_of(str(tmp_path / "step-2")).values()}
    f_changed = m3.files[m3.tensors["model.base.1"].file].name
    assert not b[f_changed].get("linked") and b[f_changed]["ino"] not in inodes_2
    assert m3.tensors["model.base.1"].checksums != m2.tensors["model.base.1"].checksums
    others = [m3.files[m3.tensors[f"model.base.{i}"].file].name for i in (0, 2, 3)]
    assert any(b[n].get("linked") for n in others if n != f_changed)
    assert "model.base.1" in diff(str(tmp_path / "step-2"), str(tmp_path / "step-3"))["changed_content"]
    assert_loads(str(tmp_path / "step-3"), 3, changed="base.1")


def _one_process_save(path: str, step: int) -> fw.SaveStats:
    sd = state_of(0, step)
    sd["model"]["own1"] = torch.full((1 << 16,), 2.0)
    sw = FlashwriteStorageWriter(path, stripes=2, chunk_bytes=CHUNK, incremental=True)
    dcp.save(sd, storage_writer=sw, no_dist=True)
    return sw.last_stats


@single_process
@pytest.mark.slow
def test_another_world_size_writes_everything(cluster2, tmp_path):
    cluster2.run(_save_steps, str(tmp_path), [1, 2], "save")
    s = _one_process_save(str(tmp_path / "step-3"), 3)
    assert s.incremental == ("off: the earlier checkpoint step-2 cannot be linked from: "
                             "it was saved by 2 ranks, this save by 1")
    assert s.bytes_linked == 0 and s.bytes_written == s.bytes
    assert all(f["nlink"] == 1 for f in stripes_of(str(tmp_path / "step-3")).values())
    assert_loads(str(tmp_path / "step-3"), 3)
    # The one-process checkpoint is the next one-process save's base (which plans the
    # unchanged tensors into stripes of their own; the save after it links them).
    assert _one_process_save(str(tmp_path / "step-4"), 4).incremental == "on"
    s = _one_process_save(str(tmp_path / "step-5"), 5)
    assert s.incremental == "on" and s.bytes_linked > 0
    assert_loads(str(tmp_path / "step-5"), 5)


@single_process
def test_a_base_that_cannot_be_linked_from_says_why(tmp_path):
    """Not a DCP checkpoint, a damaged one, a DCP checkpoint from before the rank spans:
    the save writes everything and SaveStats.incremental says why."""
    fw.save({"w": torch.ones(3)}, tmp_path / "plain", chunk_bytes=CHUNK)
    s = _one_process_save(str(tmp_path / "a"), 1)
    assert s.incremental == "off: the earlier checkpoint plain cannot be linked from: it is not a dcp checkpoint"
    assert s.bytes_linked == 0
    s = _one_process_save(str(tmp_path / "b"), 2)
    assert s.incremental == "on" and s.compared_bytes > 0  # a base (its tensors shared stripes: nothing to link)
    # A plain flashwrite save does not link from a DCP checkpoint either.
    with fw.Writer(chunk_bytes=CHUNK, incremental=True) as w:
        st = w.save(state_of(0, 3), tmp_path / "plain2")
    assert st.incremental.endswith("cannot be linked from: it is a dcp checkpoint") and st.bytes_linked == 0

    mpath = tmp_path / "b" / "flashwrite.json"
    m = decode_manifest_json(mpath.read_bytes())
    del m["dcp"]["ranks"]  # as an older flashwrite wrote it
    mpath.write_bytes(encode_manifest(m))  # sealed again; b is the newest again
    s = _one_process_save(str(tmp_path / "c"), 3)
    assert s.incremental == ("off: the earlier checkpoint b cannot be linked from: its dcp section has no "
                             "per-rank file spans (saved by an older flashwrite)")
    (tmp_path / "c" / "flashwrite.json").write_text("{not json")
    s = _one_process_save(str(tmp_path / "d"), 4)
    assert s.incremental.startswith("off: the earlier checkpoint c cannot be read: ") and s.bytes_linked == 0
    for name, step in (("a", 1), ("b", 2), ("d", 4)):
        flat = fw.load(tmp_path / name)
        assert_same({k: v for k, v in flat.items() if torch.is_tensor(v)}, flat_of(step))


@single_process
@pytest.mark.nfs
def test_nfs_says_it_writes_everything(nfs_server, tmp_path, monkeypatch):
    """DCP saves to nfs:// are not incremental yet: the save writes every stripe and says so."""
    monkeypatch.setenv("FLASHWRITE_NFS_STAGING", str(tmp_path))
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        for step in (1, 2):
            sw = FlashwriteStorageWriter(nfs_server.url_ports(f"ck/step-{step}"), writer=w)
            dcp.save(state_of(0, step), storage_writer=sw, no_dist=True)
            s = sw.last_stats
            assert s.incremental == "off: DCP saves to nfs:// are not incremental yet (the save writes every stripe)"
            assert s.bytes_linked == 0 and s.bytes_written == s.bytes
    flat = fw.load(os.path.join(nfs_server.export, "ck", "step-2"))
    assert_same(flat["model.base.0"], frozen()["base.0"])


def _save_fsdp_lora(root: str) -> list[dict]:
    """An FSDP2-sharded model whose embedding and first layer are frozen (a LoRA-like
    split, each rank holding a shard: keys ``fqn`` and ``fqn@row_col``), trained a step
    between three saves; rank 0 keeps the last state as the reference."""
    from test_dcp import build, dcp_state, full_state, train

    model, optim = build(dist.get_world_size())
    for m in (model.emb, model.l1):
        m.requires_grad_(False)
    out = []
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        for step in (1, 2, 3):
            train(model, optim, 1)
            sw = FlashwriteStorageWriter(os.path.join(root, f"step-{step}"), writer=w)
            dcp.save(dcp_state(model, optim), storage_writer=sw)
            out.append(summary(sw.last_stats))
    ref = full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save(ref, os.path.join(root, "step-3.ref.pt"))
    return out


@single_process
def test_fsdp_shards_of_frozen_layers_are_linked_and_reshard_on_load(cluster2, tmp_path):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from test_dcp import assert_states_equal, build, dcp_state, full_state, train

    res = cluster2.run(_save_fsdp_lora, str(tmp_path))
    assert all(r[2]["incremental"] == "on" and r[2]["linked"] > 0 for r in res)
    m3 = read_manifest(str(tmp_path / "step-3"))
    b = stripes_of(str(tmp_path / "step-3"))
    for key in ("model.emb.weight", "model.l1.weight", "model.l1.bias"):
        shards = [k for k in m3.tensors if k == key or k.startswith(key + "@")]
        assert shards and all(b[m3.files[m3.tensors[k].file].name].get("linked") for k in shards), key
    assert not b[m3.files[m3.tensors["model.l2.weight"].file].name].get("linked")
    fw.verify(str(tmp_path / "step-3"))
    shutil.rmtree(tmp_path / "step-2")
    # 2 -> 1: one process loads the sharded, partly linked checkpoint into an unsharded model.
    model, optim = build(1)
    for m in (model.emb, model.l1):
        m.requires_grad_(False)
    train(model, optim, 1)
    sd = dcp_state(model, optim)
    dcp.load(sd, storage_reader=FlashwriteStorageReader(tmp_path / "step-3"))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_states_equal(full_state(model, optim), torch.load(tmp_path / "step-3.ref.pt", weights_only=True))


_DCP_RANK = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import flashwrite as fw
    from flashwrite.dcp import FlashwriteStorageWriter
    rank, world, init, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)  # replicated: DCP spreads the items over both ranks
    frozen = {f"base.{i}": torch.randn(1 << 19, generator=g) for i in range(4)}
    w = fw.Writer(stripes=2, chunk_bytes=1 << 20, incremental=True)
    for step in (1, 2, 3):  # the third save links the frozen tensors' stripes
        sw = FlashwriteStorageWriter(os.path.join(root, f"step-{step}"), writer=w)
        dcp.save({"model": dict(frozen, lora=torch.full((4096,), float(step))), "step": step}, storage_writer=sw)
        print(step, sw.last_stats.incremental, sw.last_stats.stripes_linked, flush=True)
    w.close()
    dist.destroy_process_group()
""")


def test_every_ranks_links_are_durable_before_rank_0_commits(tmp_path):
    """As for multi-rank saves (test_incremental_dist_order): the links every rank makes in
    write_data precede the directory fsync before rank 0's commit in finish."""
    from test_incremental_dist_order import assert_links_durable_before_commit, run_ranks_logged

    assert_links_durable_before_commit(run_ranks_logged(tmp_path, _DCP_RANK), tmp_path / "ck")
