"""nfs:// as a real I/O path (issue 22): a save sends its chunks from the staging pool
straight to the server, a load reads the stripes straight into its buffers; the save
features (extra_files=, CheckpointManager(name=), load(into=)) and ``flashwrite tune``'s
connections sweep, against the same real server as test_nfs.py (nfs-ganesha on
127.0.0.1, tests/nfs_server.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import flashwrite as fw
from conftest import assert_same
from fault_util import flip_byte, make_state, temp_entries
from flashwrite.ops import main as cli
from flashwrite.loading import read as read_mod
from flashwrite.targets import nfs

pytestmark = [pytest.mark.nfs, pytest.mark.usefixtures("nfs_staging")]




def _state(mib: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 8
    return {"a": torch.randn(n, generator=g), "b": torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32),
            "step": seed}


def test_a_pool_smaller_than_the_save_commits_to_free_its_slots(nfs_server):
    """Each slot comes back only once its chunk is committed: with a pool of 4 chunks for
    a save of 24, the backend has to COMMIT when nothing else is left to send (else the
    copy threads wait for slots forever)."""
    state = _state(24, seed=1)
    with fw.Writer(stripes=2, chunk_bytes=1 << 20, max_staging_bytes=4 << 20) as w:
        fut = w.save_async(state, nfs_server.url("ck") + "?connections=3&depth=4")
        st = fut.result(timeout=120)
        assert w.pool_bytes <= 4 << 20
    assert st.backend == "nfs"
    local = os.path.join(nfs_server.export, "ck")
    fw.verify(local)
    assert_same(fw.load(local), state)


def test_a_load_reads_the_stripes_from_the_server_not_a_local_copy(nfs_server, nfs_staging, monkeypatch):
    """The load job gets its files from the target (its NFS client) and the stripes by their
    paths on the server: no local stand-in directory, no copy; a stripe damaged on the
    server is caught."""
    state = _state(8, seed=2)
    fw.save(state, nfs_server.url("ck"), stripes=2)
    target, inner = nfs.target_for(nfs_server.url("ck"), "test")
    seen = []
    real = read_mod._core.start_load

    def spy(specs, *args, **kwargs):
        seen.append(([p for p, _ in specs], kwargs.get("remote")))
        return real(specs, *args, **kwargs)

    monkeypatch.setattr(read_mod._core, "start_load", spy)
    assert_same(fw.load(nfs_server.url("ck")), state)
    (paths, remote), = seen
    assert remote is target.client
    stripes = [os.path.basename(p) for p in paths]
    assert len(stripes) == 2 and all(p == f"{inner}/{n}" for p, n in zip(paths, stripes))

    path = os.path.join(nfs_server.export, "ck", sorted(stripes)[1])
    flip_byte(path, os.path.getsize(path) - 10)
    with pytest.raises(fw.CorruptCheckpointError):
        fw.load(nfs_server.url("ck"))
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(fw.CorruptCheckpointError):
        fw.verify(nfs_server.url("ck"))


def test_extra_files_commit_with_the_checkpoint(nfs_server, tmp_path):
    src = tmp_path / "tokenizer.json"
    src.write_bytes(b'{"vocab": [1, 2, 3]}')
    state = make_state(5)
    fw.save(state, nfs_server.url("ck"), stripes=2,
            extra_files={"trainer_state.json": b'{"step": 5}', "tokenizer.json": str(src)})
    local = os.path.join(nfs_server.export, "ck")
    with open(os.path.join(local, "trainer_state.json"), "rb") as fh:
        assert json.loads(fh.read()) == {"step": 5}
    with open(os.path.join(local, "tokenizer.json"), "rb") as fh:
        assert fh.read() == src.read_bytes()
    assert_same(fw.load(nfs_server.url("ck")), state)
    with pytest.raises(ValueError):
        fw.save(state, nfs_server.url("bad"), extra_files={"flashwrite.json": b"{}"})
    assert sorted(os.listdir(nfs_server.export)) == ["ck"]


def test_manager_name_pattern_and_load_into_on_an_nfs_root(nfs_server):
    url = nfs_server.url("run")
    mgr = fw.CheckpointManager(url, every_n_steps=1, keep_last=2, name="checkpoint-{step}",
                               writer=fw.Writer(stripes=2))
    try:
        for step in range(1, 4):
            mgr.maybe_save(step, make_state(step)).result()
        mgr.wait()
        assert mgr.all_steps() == [2, 3]
    finally:
        mgr.close()
    run = os.path.join(nfs_server.export, "run")
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-3"]
    again = fw.CheckpointManager(url, keep_last=2, name="checkpoint-{step}")
    try:
        step, state = again.restore()
        assert step == 3
        assert_same(state, make_state(3))
    finally:
        again.close()

    # load(into=): the tensors of an existing state are filled in place from the server.
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in _state(4, seed=7).items()}
    ptrs = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
    saved = _state(4, seed=7)
    fw.save(saved, nfs_server.url("into"), stripes=2)
    out = fw.load(nfs_server.url("into"), into=into)
    assert out is into
    for k, p in ptrs.items():
        assert into[k].data_ptr() == p
        assert torch.equal(into[k], saved[k])
    assert temp_entries(run) == []


def test_tune_sweeps_connections_and_urls_without_them_use_the_result(nfs_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHWRITE_CONFIG_DIR", str(tmp_path / "config"))
    os.mkdir(os.path.join(nfs_server.export, "t"))
    url = nfs_server.url("t")
    assert cli.main(["tune", url, "--size", "8M", "--budget-s", "300", "--save", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [t["connections"] for t in r["trials"]] == [1, 2, 4, 8, 16]
    best = r["connections"]
    assert best == min(r["trials"], key=lambda t: (t["save_s"], t["connections"]))["connections"]
    with open(tmp_path / "config" / "nfs-tunings.json") as fh:
        assert json.load(fh)[f"nfs://127.0.0.1{nfs_server.export}"]["connections"] == best
    assert os.listdir(os.path.join(nfs_server.export, "t")) == []  # the trials are gone

    t, _ = nfs.target_for(nfs_server.url("t/ck"), "test")
    assert t.client.connections == best
    t, _ = nfs.target_for(nfs_server.url("t/ck") + "?connections=3", "test")
    assert t.client.connections == 3  # an explicit setting wins
    monkeypatch.setenv("FLASHWRITE_CONFIG_DIR", str(tmp_path / "none"))
    t, _ = nfs.target_for(nfs_server.url("t/ck"), "test")
    assert t.client.connections == nfs.DEFAULT_CONNECTIONS


def test_cli_inspect_and_verify_take_nfs_urls(nfs_server, capsys, tmp_path, monkeypatch):
    state = make_state(6)
    fw.save(state, nfs_server.url("ck"), stripes=2)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", nfs_server.url("ck"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["path"] == nfs_server.url("ck")
    from flashwrite.ops.inspect import inspect
    local = inspect(os.path.join(nfs_server.export, "ck"))
    assert r["tensors"] == local["tensors"] and r["totals"] == local["totals"]
    assert cli.main(["verify", nfs_server.url("ck"), "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == len(r["tensors"])

    stripe = sorted(f for f in os.listdir(os.path.join(nfs_server.export, "ck")) if f.endswith(".safetensors"))[0]
    path = os.path.join(nfs_server.export, "ck", stripe)
    flip_byte(path, os.path.getsize(path) - 7, 0x10)
    assert cli.main(["verify", nfs_server.url("ck"), "-q"]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    missing = nfs_server.url("nope")
    assert cli.main(["inspect", missing]) == 2  # a path that is not there: a usage error
    err = capsys.readouterr().err
    assert missing in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["nfs", "staging"]  # nothing made under the current directory


def test_a_plain_safetensors_directory_loads_from_nfs(nfs_server, nfs_staging):
    """Safetensors that flashwrite did not write load from an nfs:// directory as from a
    local one: headers read through the target by the one parser, bytes by the load job."""
    from safetensors.torch import save_file
    d = os.path.join(nfs_server.export, "plain")
    os.makedirs(d)
    a = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    b = {"v": torch.arange(5, dtype=torch.int64)}
    save_file(a, os.path.join(d, "a.safetensors"))
    save_file(b, os.path.join(d, "b.safetensors"))
    got = fw.load(nfs_server.url("plain"))
    assert_same(got, {**a, **b})
    assert_same(got, fw.load(d))
    with pytest.raises(ValueError, match="plain safetensors"):
        fw.load(nfs_server.url("plain"), into={"w": torch.empty(3, 4)})
