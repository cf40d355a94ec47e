"""Incremental saves (flashwrite.incremental): unchanged stripes are hard-linked from the
previous committed checkpoint; every checkpoint stays whole on its own."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
import time

import pytest
import torch

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.incremental import link as incremental
from flashwrite.errors import CorruptCheckpointError
from flashwrite.state.flatten import flatten_columns
from flashwrite.format import read_manifest

from fault_util import flip_byte, kill_at_random, need_root, tmpfs

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))
CHUNK = 1 << 20


def lora_state(step: int, frozen: dict) -> dict:
    """A frozen base (the same tensors every step) and adapters + moments that change."""
    g = torch.Generator().manual_seed(step)
    return {"model": {**frozen,
                      "lora.a": torch.randn(64, 256, generator=g),
                      "lora.b": torch.randn(256, 64, generator=g).to(torch.bfloat16)},
            "optim": {"state": {0: {"exp_avg": torch.randn(64, 256, generator=g), "step": step}}},
            "step": step}


def frozen_base(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(99)
    return {f"base.{i}": torch.randn(1 << 18, generator=g).to(torch.bfloat16) for i in range(n)}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def stripes_of(path: str) -> dict[str, dict]:
    """{stripe name: its manifest entry, with its inode and link count}"""
    m = read_manifest(path)
    out = {}
    for f in m.raw["files"]:
        st = os.stat(os.path.join(path, f["name"]))
        out[f["name"]] = {**f, "ino": st.st_ino, "nlink": st.st_nlink}
    return out


def save_run(root: str, steps: int, frozen: dict, **opts) -> list[fw.SaveStats]:
    out = []
    with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True, **opts) as w:
        for step in range(1, steps + 1):
            out.append(w.save(lora_state(step, frozen), os.path.join(root, f"step-{step}")))
    return out


def test_frozen_part_is_linked_and_changed_part_written(tmp_path):
    frozen = frozen_base()
    frozen_bytes = sum(t.nbytes for t in frozen.values())
    stats = save_run(str(tmp_path), 4, frozen)
    assert stats[0].incremental == "on: no earlier checkpoint to link from" and stats[0].bytes_linked == 0
    for s in stats[1:]:
        assert s.incremental == "on"
    last = stats[-1]
    # The frozen base is linked whole; what is written is the changing part and headers.
    assert last.bytes_linked >= frozen_bytes
    assert last.bytes_written < 0.1 * last.bytes and last.bytes_written + last.bytes_linked == last.bytes
    assert last.link_fallbacks == 0 and last.stripes_linked >= 1
    for step in range(1, 5):
        p = str(tmp_path / f"step-{step}")
        assert_same(fw.load(p), lora_state(step, frozen))
        fw.verify(p)
    a, b = stripes_of(str(tmp_path / "step-3")), stripes_of(str(tmp_path / "step-4"))
    linked = [f for f in b.values() if f.get("linked")]
    written = [f for f in b.values() if not f.get("linked")]
    assert linked and written
    inodes_a = {f["ino"] for f in a.values()}
    for f in linked:  # the same inode as a stripe of the previous checkpoint: no byte written
        assert f["ino"] in inodes_a and f["nlink"] >= 2
    for f in written:  # written anew
        assert f["ino"] not in inodes_a and f["nlink"] == 1
    m = read_manifest(str(tmp_path / "step-4")).raw
    assert m["incremental"]["base"] == "step-3"
    assert m["incremental"]["linked_bytes"] == last.bytes_linked
    assert m["incremental"]["written_bytes"] == last.bytes_written
    # Every stripe still opens without flashwrite.
    from safetensors.torch import load_file
    for name in b:
        load_file(str(tmp_path / "step-4" / name))


def test_deleting_earlier_checkpoints_leaves_later_ones_whole(tmp_path):
    frozen = frozen_base()
    save_run(str(tmp_path), 4, frozen)
    for step in (1, 2, 3):
        shutil.rmtree(tmp_path / f"step-{step}")
    assert_same(fw.load(str(tmp_path / "step-4")), lora_state(4, frozen))
    fw.verify(str(tmp_path / "step-4"))
    assert all(f["nlink"] == 1 for f in stripes_of(str(tmp_path / "step-4")).values())


def test_manager_is_incremental_by_default_and_retention_keeps_the_rest_whole(tmp_path):
    frozen = frozen_base()
    root = str(tmp_path / "ck")
    with fw.CheckpointManager(root, every_n_steps=1, keep_last=2, writer=fw.Writer(stripes=4, chunk_bytes=CHUNK)) \
            as mgr:
        assert mgr.incremental
        stats = []
        for step in range(1, 7):
            stats.append(mgr.maybe_save(step, lora_state(step, frozen)).result())
            mgr.wait()
        assert mgr.all_steps() == [5, 6]
    assert stats[-1].bytes_linked > 0 and stats[-1].bytes_written < stats[-1].bytes / 4
    for step in (5, 6):
        assert_same(fw.load(os.path.join(root, f"step-{step:08d}")), lora_state(step, frozen))
    shutil.rmtree(os.path.join(root, "step-00000005"))
    assert_same(fw.load(os.path.join(root, "step-00000006")), lora_state(6, frozen))
    fw.verify(os.path.join(root, "step-00000006"))


def test_off_by_default_on_writer_and_save(tmp_path):
    frozen = frozen_base(2)
    fw.save(lora_state(1, frozen), str(tmp_path / "a"))
    s = fw.save(lora_state(2, frozen), str(tmp_path / "b"))
    assert s.incremental == "" and s.bytes_linked == 0 and s.bytes_written == s.bytes
    s = fw.save(lora_state(3, frozen), str(tmp_path / "c"), incremental=True)
    assert s.incremental == "on" and s.bytes_linked > 0
    assert_same(fw.load(str(tmp_path / "c")), lora_state(3, frozen))


def test_an_hf_model_save_is_not_incremental_and_says_so(tmp_path):
    frozen = {"w": torch.arange(4096, dtype=torch.float32)}
    with fw.Writer(incremental=True) as w:
        w.save({"model": frozen, "step": 1}, str(tmp_path / "a"))
        s = w.save({"model": frozen, "step": 2}, str(tmp_path / "b"), hf_model="model")
    assert s.incremental == "off: hf_model= saves are not incremental yet (the save writes every stripe)"
    assert s.bytes_linked == 0 and s.bytes_written == s.bytes
    assert torch.equal(fw.load(str(tmp_path / "b"))["model"]["w"], frozen["w"])


def test_link_refused_falls_back_to_writing(tmp_path, monkeypatch):
    frozen = frozen_base()
    save_run(str(tmp_path), 2, frozen)

    def refuse(src, dst, **kw):
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)

    monkeypatch.setattr(incremental.os, "link", refuse)
    with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True) as w:
        s = w.save(lora_state(3, frozen), str(tmp_path / "step-3"))
    assert s.link_fallbacks >= 1 and s.bytes_linked == 0 and s.bytes_written == s.bytes
    assert all(not f.get("linked") and f["nlink"] == 1 for f in stripes_of(str(tmp_path / "step-3")).values())
    assert read_manifest(str(tmp_path / "step-3")).raw["incremental"]["link_fallbacks"] == s.link_fallbacks
    assert_same(fw.load(str(tmp_path / "step-3")), lora_state(3, frozen))


@pytest.mark.root
def test_base_on_another_file_system_is_written(tmp_path):
    """The base checkpoint on a tmpfs mounted beside the target: os.link fails with a real
    EXDEV, and the save writes those stripes."""
    need_root()
    frozen = frozen_base()
    save_run(str(tmp_path / "src"), 2, frozen)
    mnt = tmp_path / "ck" / "step-2"
    mnt.mkdir(parents=True)
    with tmpfs(str(mnt), "64m"):
        for name in os.listdir(tmp_path / "src" / "step-2"):
            shutil.copy(tmp_path / "src" / "step-2" / name, mnt / name)
        with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True) as w:
            s = w.save(lora_state(3, frozen), str(tmp_path / "ck" / "step-3"))
        assert s.link_fallbacks >= 1 and s.bytes_linked == 0, s
        assert_same(fw.load(str(tmp_path / "ck" / "step-3")), lora_state(3, frozen))


def test_verify_catches_a_corrupted_linked_stripe(tmp_path):
    frozen = frozen_base()
    save_run(str(tmp_path), 3, frozen)
    p = str(tmp_path / "step-3")
    linked = [f for f in stripes_of(p).values() if f.get("linked")]
    assert linked
    f = linked[0]
    flip_byte(os.path.join(p, f["name"]), f["header_bytes"] + 100)
    with pytest.raises(CorruptCheckpointError) as ei:
        fw.verify(p)
    assert f["name"] in str(ei.value)
    with pytest.raises(CorruptCheckpointError):
        fw.load(p)


def test_a_changed_frozen_tensor_is_written_not_linked(tmp_path):
    frozen = frozen_base()
    save_run(str(tmp_path), 3, frozen)
    frozen2 = dict(frozen)
    frozen2["base.2"] = frozen["base.2"].clone()
    frozen2["base.2"][-1] += 1  # one element in the last piece of one tensor
    with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True) as w:
        s = w.save(lora_state(4, frozen2), str(tmp_path / "step-4"))
    assert 0 < s.bytes_linked < sum(t.nbytes for t in frozen.values())
    assert_same(fw.load(str(tmp_path / "step-4")), lora_state(4, frozen2))
    # diff names the changed tensors, and not the frozen ones that were linked
    from flashwrite.ops.diff import diff
    r = diff(str(tmp_path / "step-3"), str(tmp_path / "step-4"))
    changed = set(r["changed_content"]) | set(r["unknown"])
    assert "model.base.2" in changed and "model.lora.a" in changed
    assert not {f"model.base.{i}" for i in (0, 1, 3, 4, 5)} & set(r["changed_content"])


def test_shapes_and_keys_that_change_are_written(tmp_path):
    frozen = frozen_base(4)
    save_run(str(tmp_path), 2, frozen)
    frozen2 = {k: v for k, v in frozen.items() if k != "base.0"}
    frozen2["base.1"] = frozen["base.1"].view(2, -1)
    frozen2["new"] = torch.ones(10)
    with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True) as w:
        s = w.save(lora_state(3, frozen2), str(tmp_path / "step-3"))
        s2 = w.save(lora_state(4, frozen2), str(tmp_path / "step-4"))
    assert_same(fw.load(str(tmp_path / "step-3")), lora_state(3, frozen2))
    assert_same(fw.load(str(tmp_path / "step-4")), lora_state(4, frozen2))
    assert s2.bytes_linked > 0 and s.bytes == s.bytes_written + s.bytes_linked


def test_everything_changed_links_nothing_and_stops_comparing(tmp_path):
    """A full-training state: nothing is linked, and once a stripe is known to change it is
    not hashed again at every save (only every RECHECK_HOT_EVERY saves)."""
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        stats = [w.save({"w": torch.randn(1 << 16) + i, "i": i}, str(tmp_path / f"s{i}")) for i in range(5)]
    assert all(s.bytes_linked == 0 for s in stats)
    assert stats[1].compared_bytes > 0
    assert all(s.compared_bytes == 0 for s in stats[2:5])
    for i in range(5):
        fw.verify(str(tmp_path / f"s{i}"))


def test_a_tensor_that_stops_changing_is_linked_after_a_recheck(tmp_path):
    """Hot stripes are compared again every RECHECK_HOT_EVERY saves: a tensor that froze
    (an EMA copy, a layer unfrozen and then frozen again) is linked from then on."""
    big = torch.randn(1 << 18)
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        stats = []
        for i in range(incremental.RECHECK_HOT_EVERY + 3):
            ema = big + min(i, 2)  # changes at the first three saves, then stays
            stats.append(w.save({"ema": ema, "i": torch.tensor(i)}, str(tmp_path / f"s{i:02d}")))
            assert_same(fw.load(str(tmp_path / f"s{i:02d}")), {"ema": ema, "i": torch.tensor(i)})
    assert all(s.bytes_linked == 0 for s in stats[:incremental.RECHECK_HOT_EVERY])
    assert stats[-1].bytes_linked >= big.nbytes


def test_overwrite_the_base_itself(tmp_path):
    frozen = frozen_base()
    p = str(tmp_path / "ck")
    with fw.Writer(stripes=4, chunk_bytes=CHUNK, incremental=True) as w:
        w.save(lora_state(1, frozen), p)
        w.save(lora_state(2, frozen), p, overwrite=True)
        s = w.save(lora_state(3, frozen), p, overwrite=True)
    assert s.bytes_linked > 0
    assert_same(fw.load(p), lora_state(3, frozen))
    assert [e for e in os.listdir(tmp_path) if commit.is_temp_name(e)] == []


def test_all_stripes_linked(tmp_path):
    frozen = frozen_base(3)
    with fw.Writer(stripes=2, chunk_bytes=CHUNK, incremental=True) as w:
        for i in range(3):
            s = w.save(dict(frozen), str(tmp_path / f"s{i}"))
    assert s.bytes_written == 0 and s.bytes_linked == s.bytes
    assert_same(fw.load(str(tmp_path / "s2")), frozen)


def test_ls_and_inspect_show_written_and_linked(tmp_path, capsys):
    frozen = frozen_base()
    stats = save_run(str(tmp_path), 3, frozen)
    from flashwrite.ops.inspect import inspect
    from flashwrite.ops.ls import list_checkpoints
    r = inspect(str(tmp_path / "step-3"))
    assert r["totals"]["linked_bytes"] == stats[-1].bytes_linked
    assert r["totals"]["written_bytes"] == stats[-1].bytes_written
    e = {x.name: x for x in list_checkpoints(str(tmp_path))}["step-3"]
    assert e.linked_bytes == stats[-1].bytes_linked and e.written_bytes == stats[-1].bytes_written
    from flashwrite.ops.main import main
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "linked" in out


def test_gpu_tensors_are_planned_as_held_files(tmp_path):
    """GPU tensors cannot be hashed from the source without a copy: their base stripes are
    planned as held files (mirrors of the base stripe, linked or written by the save job
    once staged: held.py, test_incremental_gpu_held.py); beside host tensors, the host
    ones' stripes are compared and linked as before. (The columns say "cuda:0" for CPU
    tensors: the planner goes by the device names.)"""
    frozen = frozen_base()
    save_run(str(tmp_path), 2, frozen)
    _, _, cols = flatten_columns(lora_state(3, frozen))
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    planner = incremental.Planner(str(tmp_path / "step-3"), str(tmp), incremental.BaseCache(), 1)
    opts = dict(stripes=4, prefix="model", metadata=None, block=CHUNK)
    all_gpu = dataclasses.replace(cols, devices=["cuda:0"] * len(cols.keys))
    p = planner(all_gpu, **opts)
    assert planner.note == "on" and not p.linked and p.held and p.compared_bytes == 0
    base = incremental.find_base(str(tmp_path / "step-3"))
    for i, h in p.held.items():
        src, expected = h.src, h.expected
        f = p.files[i]  # mirrors its base stripe: same header, size and offsets
        with open(src, "rb") as fh:
            assert os.path.dirname(src) == base and fh.read(len(f.header)) == f.header
        assert f.size == os.path.getsize(src) and expected
        assert [te.offset for te in f.tensors] == sorted(te.offset for te in f.tensors)
    on_gpu = cols.keys.index("model.base.0")
    mixed = dataclasses.replace(cols, devices=[("cuda:0" if j == on_gpu else "cpu") for j in range(len(cols.keys))])
    p = planner(mixed, **opts)
    assert planner.note == "on"
    linked = {p.files[i].columns.keys[j] for i in p.linked for j in p.files[i].members}
    held_keys = {p.files[i].columns.keys[j] for i in p.held for j in p.files[i].members}
    assert "model.base.1" in linked and "model.base.0" in held_keys and not linked & held_keys
    assert "model.base.0" in {f.columns.keys[j] for f in p.staged for j in f.members}


@pytest.mark.nfs
def test_nfs_links_with_nfs_link(nfs_server, tmp_path, monkeypatch):
    """Over nfs:// the unchanged stripes are linked on the server (NFS LINK); the linked
    checkpoint stays whole when the earlier one is deleted. (Ports in the URL: the shared
    portmapper of a busy test machine may list another test's server.)"""
    monkeypatch.setenv("FLASHWRITE_NFS_STAGING", str(tmp_path))
    frozen = frozen_base(4)
    with fw.Writer(stripes=3, chunk_bytes=CHUNK, incremental=True) as w:
        stats = [w.save(lora_state(step, frozen), nfs_server.url_ports(f"ck/step-{step}")) for step in (1, 2, 3)]
    assert stats[0].incremental.startswith("on: no earlier") and stats[2].incremental == "on"
    assert stats[2].bytes_linked >= sum(t.nbytes for t in frozen.values()) and stats[2].link_fallbacks == 0
    disk = os.path.join(nfs_server.export, "ck")
    a, b = stripes_of(os.path.join(disk, "step-2")), stripes_of(os.path.join(disk, "step-3"))
    linked = [f for f in b.values() if f.get("linked")]
    assert linked and all(f["ino"] in {x["ino"] for x in a.values()} for f in linked)
    shutil.rmtree(os.path.join(disk, "step-2"))
    assert_same(fw.load(nfs_server.url_ports("ck/step-3")), lora_state(3, frozen))
    fw.verify(nfs_server.url_ports("ck/step-3"))
    with fw.CheckpointManager(nfs_server.url_ports("m"), every_n_steps=1, keep_last=1,
                              writer=fw.Writer(stripes=3, chunk_bytes=CHUNK)) as mgr:
        assert mgr.incremental
        for step in (1, 2, 3):
            mgr.maybe_save(step, lora_state(step, frozen)).result()
            mgr.wait()
    assert_same(fw.load(nfs_server.url_ports("m/step-00000003")), lora_state(3, frozen))
    assert any(f.get("linked") for f in stripes_of(os.path.join(nfs_server.export, "m", "step-00000003")).values())


# --------------------------------------------------------------------------- kill -9

_VICTIM = r"""
import os, sys, torch
sys.path.insert(0, {here!r})
import flashwrite as fw
from test_incremental import lora_state, frozen_base

frozen = frozen_base()
mgr = fw.CheckpointManager({root!r}, every_n_steps=1, keep_last=2, writer=fw.Writer(stripes=4, chunk_bytes=1 << 20))
start = (mgr.latest_step() or 0) + 1
for step in range(start, start + 6):
    fut = mgr.maybe_save(step, lora_state(step, frozen))
    print("staged", step, flush=True)
mgr.close()
print("finished", flush=True)
"""


@pytest.mark.slow
def test_kill9_during_incremental_saves(tmp_path):
    seed = int(os.environ.get("FLASHWRITE_TEST_SEED") or time.time_ns() % 2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = str(tmp_path / "ck")
    frozen = frozen_base()
    code = _VICTIM.format(here=HERE, root=root)
    killed, linked_seen = 0, False
    for was_killed in kill_at_random(code, rng, 10):  # the clean first run gives the others a base
        killed += was_killed
        mgr = fw.CheckpointManager(root)  # cleans what the victim left
        steps = mgr.all_steps()
        assert steps, f"seed {seed}: no checkpoint left"
        assert [e for e in os.listdir(root) if commit.is_temp_name(e)] == []
        for s in steps:  # every committed checkpoint is whole and byte-exact
            assert_same(fw.load(mgr.path_for(s)), lora_state(s, frozen))
            linked_seen |= any(f.get("linked") for f in read_manifest(mgr.path_for(s)).raw["files"])
        mgr.close()
    assert killed >= 5, f"seed {seed}: only {killed} of 10 victims were killed mid-run"
    assert linked_seen, "no checkpoint of the trials linked a stripe: the saves were not incremental"


def frozen_params(n: int = 6) -> dict:
    """The base as a LoRA model's state_dict(keep_vars=True) holds it: frozen Parameters."""
    return {k: torch.nn.Parameter(t, requires_grad=False) for k, t in frozen_base(n).items()}


def test_first_incremental_save_after_a_full_one_links_the_frozen_parameters(tmp_path):
    # Issue 45 item 5: the full save puts the frozen Parameters in stripes of their own,
    # so the very first incremental save links them (before, it wrote every stripe, since
    # each mixed frozen and trained tensors).
    frozen = frozen_params()
    frozen_bytes = sum(t.nbytes for t in frozen.values())
    stats = save_run(str(tmp_path), 2, frozen)
    full, first = stats
    assert full.bytes_linked == 0 and first.incremental == "on"
    assert first.bytes_linked >= frozen_bytes and first.bytes_written <= 0.1 * full.bytes
    from safetensors.torch import load_file
    step1 = str(tmp_path / "step-1")
    names = sorted(stripes_of(step1))
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    kinds = []
    for name in names:  # each stripe holds frozen tensors only, or none; opened by safetensors itself
        keys = set(load_file(os.path.join(step1, name)))
        kinds.append(all(k.startswith("model.base.") for k in keys))
        assert kinds[-1] or not any(k.startswith("model.base.") for k in keys)
    assert any(kinds) and not all(kinds)
    for step in (1, 2):
        p = str(tmp_path / f"step-{step}")
        back = fw.load(p)
        assert_same(back, lora_state(step, frozen))
        assert all(isinstance(back["model"][k], torch.nn.Parameter) and not back["model"][k].requires_grad
                   for k in frozen)
        fw.verify(p)


def test_plain_tensors_and_trainable_parameters_share_stripes_as_before(tmp_path):
    from flashwrite.layout.plan import plan_files
    g = torch.Generator().manual_seed(1)
    ts = {f"t{i}": torch.randn(1000 + i, generator=g) for i in range(8)}
    for state in (ts, {k: torch.nn.Parameter(t) for k, t in ts.items()},
                  {k: torch.nn.Parameter(t, requires_grad=False) for k, t in ts.items()}):
        files = plan_files(None, 4, columns=flatten_columns(state)[2])
        assert [f.name for f in files] == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
        assert sorted(len(f.members) for f in files) == [2, 2, 2, 2]  # balanced by bytes, no group apart
    mixed = {"big": torch.nn.Parameter(torch.zeros(4000), requires_grad=False), "small": torch.zeros(10)}
    files = plan_files(None, 8, columns=flatten_columns(mixed)[2])  # one stripe per group: never an empty one
    assert [[f.columns.keys[j] for j in f.members] for f in files] == [["big"], ["small"]]
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
