"""Incremental multi-rank saves to nfs:// (process_group=) with real gloo processes against
a real NFS server (nfs-ganesha on 127.0.0.1, tests/nfs_server.py): each rank compares its
own state with its own part of the last checkpoint its Writer committed there (every rank
learns of rank 0's commit from the outcome it broadcasts) and links its unchanged stripes
with NFS LINK into the shared temporary directory. Link counts and inodes are read from
the export's directory on this machine, which the server serves."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

import flashwrite as fw
from flashwrite.targets import nfs
from flashwrite.format import read_manifest

from dist_helpers import Cluster
from fault_util import temp_entries
from test_incremental import assert_same, stripes_of
from test_incremental_dist import frozen_bytes, state_of, summary

pytestmark = pytest.mark.nfs

CHUNK = 1 << 20
FIRST_NOTE = "on: no earlier checkpoint to link from (nfs://"


def _url(template: str, name: str) -> str:
    return template.replace("NAME", name)


def _save_steps(template: str, staging: str, steps: list[int], seeds: list | None = None,
                slow_link: str | None = None) -> list[dict]:
    """Every rank, with one Writer: save ``steps`` in turn to template(step-N) (rank r's
    frozen part at step s from the seed v of (s, r, v) in seeds, else 99), then load its own part of each back.
    slow_link (rank 1 only): the local path of the last step's checkpoint; each of this
    rank's NFS LINKs then waits a second once the server replied and records whether that
    checkpoint was visible yet (it must not be: rank 0 commits only after every LINK)."""
    os.environ["FLASHWRITE_NFS_STAGING"] = staging  # the workers fork from a server started earlier
    rank = dist.get_rank()
    seed_of = {(s, r): v for s, r, v in (seeds or [])}
    out = []
    seen: list[bool] = []
    real_link = nfs.NfsTarget.link

    def link(self, src: str, dst: str) -> None:
        real_link(self, src, dst)
        time.sleep(1.0)
        seen.append(os.path.exists(slow_link))

    if slow_link is not None and rank == 1:
        nfs.NfsTarget.link = link
    try:
        with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
            for step in steps:
                st = w.save(state_of(rank, step, seed_of.get((step, rank), 99)), _url(template, f"step-{step}"),
                            process_group=dist.group.WORLD, timeout=60)
                out.append(summary(st))
    finally:
        nfs.NfsTarget.link = real_link
    for step in steps:
        assert_same(fw.load(_url(template, f"step-{step}"), process_group=dist.group.WORLD),
                    state_of(rank, step, seed_of.get((step, rank), 99)))
    if slow_link is not None and rank == 1:
        out.append({"links": len(seen), "visible_during_a_link": any(seen)})
    return out


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


def _remove_through_server(server, rel: str) -> None:
    """Remove the export's ``rel`` with NFS REMOVE/RMDIR (mounting the export itself: the
    server also lets a client mount the directory, which could then not remove itself)."""
    target, root = nfs.target_for(server.url_ports(), "remove")
    assert root == "/"
    target.remove_tree("/" + rel)
    assert not target.exists("/" + rel)


def test_third_save_links_on_the_server_and_stays_whole_without_its_base(cluster2, nfs_server, nfs_staging):
    template = nfs_server.url_ports("ck/NAME")
    disk = os.path.join(nfs_server.export, "ck")
    res = cluster2.run(_save_steps, template, str(nfs_staging), [1, 2, 3])
    for rank, stats in enumerate(res):
        # The first save has no base (this Writer committed nothing there yet); the second
        # plans the unchanged tensors into stripes of their own; the third links them.
        assert stats[0]["incremental"].startswith(FIRST_NOTE) and stats[0]["linked"] == 0
        assert stats[0]["written"] == stats[0]["bytes"]
        assert stats[1]["incremental"] == "on"
        s = stats[2]
        assert s["incremental"] == "on" and s["fallbacks"] == 0 and s["stripes_linked"] > 0
        assert s["linked"] >= frozen_bytes(rank) and s["written"] + s["linked"] == s["bytes"]
        assert s["written"] < 0.25 * s["bytes"]
    # The merged manifest: the base, each rank's own section and the totals.
    raw = read_manifest(os.path.join(disk, "step-3")).raw
    sec = raw["incremental"]
    assert sec["base"] == "step-2" and len(sec["ranks"]) == 2
    for rank in (0, 1):
        assert sec["ranks"][rank]["base"] == "step-2"
        assert sec["ranks"][rank]["linked_bytes"] == res[rank][2]["linked"]
        assert sec["ranks"][rank]["written_bytes"] == res[rank][2]["written"]
    assert sec["linked_bytes"] == sum(r[2]["linked"] for r in res)
    for rank, (first, count) in enumerate(raw["ranks"]["files"]):
        mine = raw["files"][first:first + count]
        assert all(f["name"].startswith(f"model-rank{rank:05d}-") for f in mine)
        assert sum(f["size"] for f in mine if f.get("linked")) == res[rank][2]["linked"]
    # On the server's disk a linked stripe is step-2's inode with a second name; a written one is new.
    a, b = stripes_of(os.path.join(disk, "step-2")), stripes_of(os.path.join(disk, "step-3"))
    inodes_a = {f["ino"] for f in a.values()}
    for f in b.values():
        assert (f["ino"] in inodes_a) == bool(f.get("linked")), f["name"]
        assert f["nlink"] == (2 if f.get("linked") else 1), f["name"]
    # Byte-exact: every rank's part through nfs:// (each rank read its own in _save_steps), all in one process.
    whole = fw.load(_url(template, "step-3"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 3))
    assert fw.verify(_url(template, "step-3"))["tensors"] > 0
    # Deleting the bases through the server leaves the newest whole.
    _remove_through_server(nfs_server, "ck/step-1")
    _remove_through_server(nfs_server, "ck/step-2")
    assert all(f["nlink"] == 1 for f in stripes_of(os.path.join(disk, "step-3")).values())
    whole = fw.load(_url(template, "step-3"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 3))
    fw.verify(_url(template, "step-3"))
    assert sorted(os.listdir(disk)) == ["step-3"] and temp_entries(disk) == []


def test_every_link_is_on_the_server_before_rank_0_commits(cluster2, nfs_server, nfs_staging):
    """Rank 1 lingers a second after each of its LINKs: rank 0 must still not have
    committed (it waits for rank 1's "durable", which comes after its links)."""
    template = nfs_server.url_ports("ck/NAME")
    final = os.path.join(nfs_server.export, "ck", "step-3")
    res = cluster2.run(_save_steps, template, str(nfs_staging), [1, 2, 3], slow_link=final)
    probe = res[1][-1]
    assert probe["links"] == res[1][2]["stripes_linked"] > 0
    assert probe["visible_during_a_link"] is False
    assert res[0][2]["stripes_linked"] > 0
    fw.verify(_url(template, "step-3"))


def test_a_rank_whose_part_changed_writes_while_the_other_links(cluster2, nfs_server, nfs_staging):
    template = nfs_server.url_ports("ck/NAME")
    disk = os.path.join(nfs_server.export, "ck")
    # Rank 1's frozen part is new at step 3: it links nothing, rank 0 links its own.
    res = cluster2.run(_save_steps, template, str(nfs_staging), [1, 2, 3], seeds=[(3, 1, 7)])
    assert res[0][2]["linked"] >= frozen_bytes(0) and res[0][2]["stripes_linked"] > 0
    assert res[1][2]["incremental"] == "on" and res[1][2]["linked"] == 0
    assert res[1][2]["written"] == res[1][2]["bytes"]
    raw = read_manifest(os.path.join(disk, "step-3")).raw
    assert raw["incremental"]["ranks"][1]["linked_bytes"] == 0
    assert raw["incremental"]["ranks"][0]["linked_bytes"] == res[0][2]["linked"]
    first, count = raw["ranks"]["files"][1]
    assert not any(f.get("linked") for f in raw["files"][first:first + count])
    whole = fw.load(_url(template, "step-3"))
    assert_same(whole[0], state_of(0, 3))
    assert_same(whole[1], state_of(1, 3, seed=7))
    fw.verify(_url(template, "step-3"))
    # A new Writer (a restarted job) does not scan the directory: its first save writes everything.
    res = cluster2.run(_save_steps, template, str(nfs_staging), [4])
    for stats in res:
        assert stats[0]["incremental"].startswith(FIRST_NOTE)
        assert stats[0]["linked"] == 0 and stats[0]["written"] == stats[0]["bytes"]


def _manager_steps(root: str, staging: str) -> list[dict]:
    os.environ["FLASHWRITE_NFS_STAGING"] = staging
    rank = dist.get_rank()
    out = []
    with fw.CheckpointManager(root, every_n_steps=1, keep_last=1, process_group=dist.group.WORLD,
                              writer=fw.Writer(stripes=2, chunk_bytes=CHUNK)) as mgr:
        assert mgr.incremental
        for step in (1, 2, 3, 4):
            out.append(summary(mgr.maybe_save(step, state_of(rank, step)).result(60)))
            mgr.wait()
        assert_same(fw.load(mgr.path_for(4), process_group=dist.group.WORLD), state_of(rank, 4))
    return out


def test_manager_on_an_nfs_root_links_and_retention_keeps_the_last_whole(cluster2, nfs_server, nfs_staging):
    res = cluster2.run(_manager_steps, nfs_server.url_ports("m"), str(nfs_staging))
    for rank, stats in enumerate(res):
        assert stats[0]["incremental"].startswith(FIRST_NOTE)
        for s in stats[2:]:  # step 3 links from step 2, step 4 from step 3 (retention removed step 2 meanwhile)
            assert s["incremental"] == "on" and s["linked"] >= frozen_bytes(rank) and s["fallbacks"] == 0
    run = os.path.join(nfs_server.export, "m")
    left = sorted(os.listdir(run))
    assert left == ["step-00000004"], left
    # Retention removed every earlier checkpoint through the server: step 4's linked stripes
    # are the only names of their inodes now.
    stripes = stripes_of(os.path.join(run, left[0]))
    assert any(f.get("linked") for f in stripes.values())
    assert all(f["nlink"] == 1 for f in stripes.values())
    whole = fw.load(nfs_server.url_ports(f"m/{left[0]}"))
    for rank in (0, 1):
        assert_same(whole[rank], state_of(rank, 4))
    fw.verify(nfs_server.url_ports(f"m/{left[0]}"))
