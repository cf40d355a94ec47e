"""flashwrite.lightning: a real Trainer saves, resumes and validates through flashwrite."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (pip install 'flashwrite[lightning]')")

import flashwrite as fw  # noqa: E402
from flashwrite.integrations.lightning import FlashwriteCheckpointIO  # noqa: E402

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


CHILD = os.path.join(os.path.dirname(_TESTS_FILE), "lightning_child.py")


def _run(io, dirpath, devices, namespace="lightning.pytorch"):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, CHILD, io, str(dirpath), str(devices), namespace], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize("devices,namespace", [
    (1, "lightning.pytorch"),
    # issue 45 item 3: its Trainer refused the plug-in when both were installed (README suite: the
    # rotation test of test_lightning_contract.py fits with it too)
    pytest.param(1, "pytorch_lightning", marks=pytest.mark.slow),
    pytest.param(2, "lightning.pytorch", marks=pytest.mark.slow)], ids=["1-rank", "1-rank-pytorch_lightning",
                                                                        "ddp-2-ranks"])
def test_fit_resume_validate_bit_identical_to_torch_io(tmp_path, devices, namespace):
    pytest.importorskip(namespace, reason=f"{namespace} is not installed")
    ours = _run("flashwrite", tmp_path / "fw", devices, namespace)
    theirs = _run("torch", tmp_path / "pt", devices, namespace)
    assert ours["global_step"] == theirs["global_step"] == 10
    assert ours["final"] == theirs["final"]  # every weight, to the last bit
    assert ours["val"] == theirs["val"]
    assert ours["files"] == theirs["files"]  # the same top-k + last, by name
    for name in ours["files"]:  # each one a flashwrite checkpoint directory that loads on its own
        assert os.path.isfile(tmp_path / "fw" / name / "flashwrite.json")
    ck = fw.load(tmp_path / "fw" / "last.ckpt")
    assert ck["global_step"] == 10 and ck["hyper_parameters"] == {"hidden": 16, "lr": 0.05, "tag": "other"}
    assert type(ck["state_dict"]["net.0.weight"]) is torch.Tensor


def _checkpoint():
    from lightning.fabric.utilities.data import AttributeDict
    return {"state_dict": {"w": torch.randn(4, 4)}, "global_step": 3, "epoch": 0,
            "hyper_parameters": AttributeDict(lr=0.1, layers=[1, 2], name="m"), "optimizer_states": [{}],
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "kth_value": torch.tensor(1.5)}}}


def test_checkpoint_dict_round_trips_without_pickle(tmp_path):
    io = FlashwriteCheckpointIO()
    ck = _checkpoint()
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    io.teardown()
    back = io.load_checkpoint(tmp_path / "a.ckpt")
    assert back["hyper_parameters"] == {"lr": 0.1, "layers": [1, 2], "name": "m"}
    assert torch.equal(back["state_dict"]["w"], ck["state_dict"]["w"])
    assert back["callbacks"]["ModelCheckpoint{'monitor': None}"]["kth_value"] == 1.5
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_objects_need_allow_pickle(tmp_path):
    ck = _checkpoint()
    ck["extra"] = {1, 2}  # a set is not plain data
    with pytest.raises(TypeError, match="allow_pickle"):
        FlashwriteCheckpointIO().save_checkpoint(ck, tmp_path / "a.ckpt")
    io = FlashwriteCheckpointIO(allow_pickle=True)
    io.save_checkpoint(ck, tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt")["extra"] == {1, 2}
    assert io.load_checkpoint(tmp_path / "b.ckpt", weights_only=None)["extra"] == {1, 2}
    from flashwrite.errors import UnsafeCheckpointError
    with pytest.raises(UnsafeCheckpointError):
        io.load_checkpoint(tmp_path / "b.ckpt", weights_only=True)
    io.teardown()


def test_one_save_in_flight_and_state_may_change_once_staged(tmp_path):
    io = FlashwriteCheckpointIO()
    w = torch.zeros(1 << 20)
    for i in range(3):
        w.fill_(i)
        io.save_checkpoint({"w": w, "i": i}, tmp_path / f"{i}.ckpt")
        w.fill_(-1)  # staged: changing the tensor now must not reach the checkpoint
    io.teardown()
    for i in range(3):
        back = fw.load(tmp_path / f"{i}.ckpt")
        assert back["i"] == i and bool((back["w"] == i).all())


def test_remove_checkpoint_removes_only_flashwrite_checkpoints(tmp_path):
    io = FlashwriteCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # waits for the save in flight first
    assert not (tmp_path / "a.ckpt").exists()
    io.remove_checkpoint(tmp_path / "never.ckpt")  # nothing there: nothing to do
    (tmp_path / "other.ckpt").write_bytes(b"not ours")
    (tmp_path / "dir.ckpt").mkdir()
    for name in ("other.ckpt", "dir.ckpt"):
        with pytest.raises(ValueError, match="not a flashwrite checkpoint"):
            io.remove_checkpoint(tmp_path / name)
        assert (tmp_path / name).exists()
    io.teardown()


def test_a_failed_save_is_raised_by_the_next_call(tmp_path):
    from fault_util import tmpfs
    with tmpfs(str(tmp_path / "small"), "2m") as small:
        io = FlashwriteCheckpointIO()
        io.save_checkpoint({"w": torch.zeros(4 << 20)}, os.path.join(small, "big.ckpt"))  # 16 MiB into 2 MiB
        with pytest.raises(OSError) as e:
            io.save_checkpoint({"w": torch.zeros(1)}, os.path.join(small, "next.ckpt"))
        assert e.value.errno == 28  # ENOSPC, from the save before
        assert not os.path.exists(os.path.join(small, "big.ckpt"))
        io.save_checkpoint({"w": torch.ones(2)}, os.path.join(small, "small.ckpt"))  # reported once, then on
        io.teardown()
        assert torch.equal(fw.load(os.path.join(small, "small.ckpt"))["w"], torch.ones(2))
