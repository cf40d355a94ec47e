"""flashwrite as a torch.distributed.checkpoint (DCP) storage backend, with real
processes: FSDP2-sharded model + optimizer state saved by 2 ranks (dcp.save and
dcp.async_save) and loaded, resharded, by 1 and by 4 (and by 2 again)."""

from __future__ import annotations

import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import flashwrite as fw
from flashwrite.saving import commit
from flashwrite.integrations.dcp import FlashwriteStorageReader, FlashwriteStorageWriter
from flashwrite.format import FORMAT_VERSION
from flashwrite.format import decode_manifest_json

from dist_helpers import Cluster

# DCP warns, by design, when it runs without an initialized process group (the
# one-process load in these tests); that is exactly the case being tested.
single_process = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 16)
        self.l1 = nn.Linear(16, 48)
        self.l2 = nn.Linear(48, 21)  # 21 rows: uneven shards over 2 and 4 ranks
        self.norm = nn.LayerNorm(21)
        self.register_buffer("scale", torch.arange(5.0))

    def forward(self, x):
        return self.norm(self.l2(torch.relu(self.l1(self.emb(x))))).sum() * self.scale.sum()


def build(world_size: int):
    """Net + AdamW, FSDP2-sharded over the CPU mesh when world_size > 1."""
    torch.manual_seed(0)
    model = Net()
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for m in (model.l1, model.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train(model, optim, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, 37, (8, 4), generator=g)
        optim.zero_grad()
        model(x).backward()
        optim.step()


def full_state(model, optim) -> dict:
    """The unsharded model + optimizer state (the reference a reshard must reproduce)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(model, optim, options=opts)
    flat = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    flat["optim.param_groups"] = [{k: v for k, v in pg.items()} for pg in osd["param_groups"]]
    return flat


def dcp_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "extra": {"step": 2, "tag": "fsdp2"}}


def assert_states_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k
        else:
            assert a[k] == b[k], k


# -------------------------------------------------------------- worker side

_dcp_pg = None


def dcp_group():
    """The gloo group DCP's background save coordinates on: async_save runs
    collectives from its own thread, so (as DCP asks) not on the training group."""
    global _dcp_pg
    if _dcp_pg is None:
        _dcp_pg = dist.new_group(backend="gloo")
    return _dcp_pg



def _save_sharded(root: str, how: str) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    model, optim = build(n)
    train(model, optim, 2)
    path = os.path.join(root, how)
    ref = full_state(model, optim)
    sd = dcp_state(model, optim)
    if how == "save":
        dcp.save(sd, storage_writer=FlashwriteStorageWriter(path, stripes=2))
    elif how == "async":  # staged into flashwrite's pool by stage(), written in the background
        fut = dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path, stripes=2), process_group=dcp_group())
        train(model, optim, 1)  # training goes on while the checkpoint is written
        fut.result(120)
    elif how == "async-checkpoint-id":  # path unknown at stage(): copy staging
        fut = dcp.async_save(sd, checkpoint_id=path, storage_writer=FlashwriteStorageWriter(stripes=2),
                             process_group=dcp_group())
        train(model, optim, 1)
        fut.result(120)
    if rank == 0:
        torch.save(ref, os.path.join(root, f"{how}.ref.pt"))
    return rank


def _load_sharded(root: str, how: str) -> int:
    """Load into a model sharded over this world size; rank 0 returns the full state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank, n = dist.get_rank(), dist.get_world_size()
    model, optim = build(n)
    train(model, optim, 1)  # optimizer state exists (and differs from the checkpoint)
    sd = dcp_state(model, optim)
    sd["extra"] = {"step": -1, "tag": ""}
    dcp.load(sd, storage_reader=FlashwriteStorageReader(os.path.join(root, how)))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert sd["extra"] == {"step": 2, "tag": "fsdp2"}
    got = full_state(model, optim)
    ref = torch.load(os.path.join(root, f"{how}.ref.pt"), weights_only=True)
    assert_states_equal(got, ref)
    return rank


def _save_replicated_and_own(root: str, how: str) -> dict:
    """Plain tensors that every rank holds (DCP saves them once), tensors only one
    rank has, non-tensor values; snapshot semantics under async_save."""
    rank = dist.get_rank()
    rep = torch.arange(1000, dtype=torch.float64)
    own = torch.full((300 + rank,), float(rank), dtype=torch.bfloat16)
    sd = {"rep": rep, f"own{rank}": own, "obj": {"epoch": 3, "names": ["a", "b"]}}
    path = os.path.join(root, how)
    w = FlashwriteStorageWriter(path)
    if how == "save":
        dcp.save(sd, storage_writer=w)
    else:
        fut = dcp.async_save(sd, storage_writer=w, process_group=dcp_group())
        rep.add_(1), own.add_(1)  # after async_save returns the snapshot is taken
        fut.result(120)
    return {"bytes": w.last_stats.bytes if w.last_stats else 0}


def _fail_on_one_rank(root: str, bad: int, how: str) -> dict:
    """Rank ``bad`` gets a real EFBIG (RLIMIT_FSIZE) when its stripes are created:
    in write_data for dcp.save, in stage() for async_save. Nothing may be committed,
    and the next save to the same path works and leaves no temporary directory."""
    rank = dist.get_rank()
    sd = {f"own{rank}": torch.full((1 << 16,), float(rank)), "rep": torch.arange(10.0)}
    path = os.path.join(root, f"fail-{how}")
    out: dict = {}
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == bad:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, old_limit[1]))
    try:
        if how == "save":
            dcp.save(sd, storage_writer=FlashwriteStorageWriter(path))
        else:
            dcp.async_save(sd, storage_writer=FlashwriteStorageWriter(path), process_group=dcp_group()).result(60)
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        out["error"] = f"{type(e).__name__}: {e}"[-2000:]  # DCP puts the traceback first, the error last
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    dist.barrier()
    out["exists"] = os.path.exists(path)
    dcp.save(sd, storage_writer=FlashwriteStorageWriter(path))
    return out


# -------------------------------------------------------------- tests


@pytest.mark.parametrize("how", ["save", "async"])
def test_failure_on_one_rank_commits_nothing(cluster2, tmp_path, how):
    res = cluster2.run(_fail_on_one_rank, str(tmp_path), 1, how)
    for r in res:
        assert "File too large" in r["error"], r
        assert not r["exists"]
    assert sorted(os.listdir(tmp_path)) == [f"fail-{how}"]  # the retry's leftovers cleaned
    flat = fw.load(tmp_path / f"fail-{how}")
    assert torch.equal(flat["own0"], torch.zeros(1 << 16)) and torch.equal(flat["own1"], torch.ones(1 << 16))


@pytest.fixture(scope="module")
def cluster2():
    with Cluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def saved(tmp_path_factory, cluster2):
    """The 2-rank cluster saves every variant; the tests load them."""
    root = tmp_path_factory.mktemp("dcp")
    for how in ("save", "async", "async-checkpoint-id"):
        assert cluster2.run(_save_sharded, str(root), how) == [0, 1]
    cluster2.run(_save_replicated_and_own, str(root), "plain-save")
    cluster2.run(_save_replicated_and_own, str(root), "plain-async")
    # 2 -> 2, same cluster
    assert cluster2.run(_load_sharded, str(root), "async") == [0, 1]
    return root


@pytest.mark.parametrize("how", ["save", "async", "async-checkpoint-id"])
def test_checkpoint_is_a_committed_flashwrite_checkpoint(saved, how):
    path = saved / how
    assert [e for e in os.listdir(saved) if commit.is_temp_name(e)] == []
    manifest = decode_manifest_json((path / "flashwrite.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION and "dcp" in manifest
    names = [f["name"] for f in manifest["files"]]
    assert any(n.startswith("model-rank00000-") for n in names) and any(n.startswith("model-rank00001-") for n in names)
    assert sorted(os.listdir(path)) == sorted(names + ["flashwrite.json", "model.safetensors.index.json"])
    assert fw.verify(path)["files"] == len(names)

    # Stripes are plain safetensors files; a shard that starts past row 0 is "fqn@row".
    st = pytest.importorskip("safetensors.torch")
    tensors = {}
    for n in names:
        tensors.update(st.load_file(str(path / n)))
    ref = torch.load(saved / f"{how}.ref.pt", weights_only=True)
    w = ref["model.l2.weight"]  # 21 rows over 2 ranks: 11 + 10
    assert torch.equal(tensors["model.l2.weight"], w[:11]) and torch.equal(tensors["model.l2.weight@11_0"], w[11:])
    assert torch.equal(tensors["optim.state.l1.weight.exp_avg"], ref["optim.l1.weight.exp_avg"][:24])


@single_process
@pytest.mark.parametrize("how", ["save", "async", "async-checkpoint-id"])
def test_reshard_2_to_1(saved, how):
    """One process, no process group: an unsharded model + optimizer loads the 2-rank checkpoint."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = build(1)
    train(model, optim, 1)
    sd = dcp_state(model, optim)
    dcp.load(sd, storage_reader=FlashwriteStorageReader(saved / how))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert sd["extra"] == {"step": 2, "tag": "fsdp2"}
    assert_states_equal(full_state(model, optim), torch.load(saved / f"{how}.ref.pt", weights_only=True))


def test_reshard_2_to_4(saved):
    with Cluster(4) as c:
        for how in ("save", "async", "async-checkpoint-id"):
            assert c.run(_load_sharded, str(saved), how) == [0, 1, 2, 3]


@single_process
@pytest.mark.parametrize("how", ["plain-save", "plain-async"])
def test_replicated_tensors_saved_once_and_objects_inline(saved, how):
    path = saved / how
    rep = torch.arange(1000, dtype=torch.float64)
    own = [torch.full((300 + r,), float(r), dtype=torch.bfloat16) for r in range(2)]
    sd = {"rep": torch.zeros(1000, dtype=torch.float64), "own0": torch.zeros(300, dtype=torch.bfloat16),
          "own1": torch.zeros(301, dtype=torch.bfloat16), "obj": {"epoch": 0, "names": []}}
    dcp.load(sd, storage_reader=FlashwriteStorageReader(path))
    assert torch.equal(sd["rep"], rep) and torch.equal(sd["own0"], own[0]) and torch.equal(sd["own1"], own[1])
    assert sd["obj"] == {"epoch": 3, "names": ["a", "b"]}

    flat = fw.load(path)  # flashwrite's own loader: chunks by key, DCP's byte items as raw bytes
    assert sorted(k for k, v in flat.items() if torch.is_tensor(v)) == ["own0", "own1", "rep"]
    assert all(isinstance(flat[k], bytes) for k in ("obj.epoch", "obj.names"))
    manifest = decode_manifest_json((path / "flashwrite.json").read_text())
    assert sum(1 for k in manifest["tensors"] if k == "rep") == 1


def test_reader_rejects_a_plain_flashwrite_checkpoint(tmp_path):
    fw.save({"w": torch.ones(3)}, tmp_path / "plain")
    with pytest.raises(fw.CorruptCheckpointError, match="not written through DCP"):
        FlashwriteStorageReader(tmp_path / "plain").read_metadata()
    assert FlashwriteStorageReader.validate_checkpoint_id(tmp_path / "plain")
    assert not FlashwriteStorageReader.validate_checkpoint_id(tmp_path / "nothing")
