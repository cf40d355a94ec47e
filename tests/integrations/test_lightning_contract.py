"""FlashwriteCheckpointIO against Lightning's own expectations (issue 35, items 5-10): it
pickles (ddp_spawn, torch.save(trainer)); ModelCheckpoint's -vN names see saves in flight;
save_last="link" symlinks are removed; a plug-in Lightning never tears down still closes
and reports a failure; checkpoints load in a new process; OmegaConf hyper-parameters are
stored without pickle. Every run is a real Trainer."""

import gc
import importlib
import io
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (pip install 'flashwrite[lightning]')")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import flashwrite as fw  # noqa: E402
from flashwrite.integrations.lightning import FlashwriteCheckpointIO  # noqa: E402

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


# Lightning's own warnings in a short CPU run (few workers, no logger, torch's pytree deprecations)
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

CHILD = os.path.join(os.path.dirname(_TESTS_FILE), "lightning_contract_child.py")


def _child(*args, ok=True):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, CHILD, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=env)
    if ok:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def _json(r):
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(8, hidden)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)


def _trainer(plugins, callbacks, steps=4, **kwargs):
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=plugins, callbacks=callbacks, **kwargs)


def _state_bytes(sd):
    return {k: v.contiguous().view(torch.uint8).tolist() for k, v in sd.items()}


def _commit_threads():
    return {t for t in threading.enumerate() if t.name.startswith("flashwrite-commit")}


# ------------------------------------------------------------------ 5: pickling


def test_plugin_pickles_with_a_writer_and_the_copy_saves(tmp_path):
    plug = FlashwriteCheckpointIO(allow_pickle=True, stripes=2)
    plug.save_checkpoint({"w": torch.arange(6.0)}, tmp_path / "a.ckpt")  # a Writer, a save in flight
    copy = pickle.loads(pickle.dumps(plug))
    assert copy.allow_pickle and copy._writer_options == {"stripes": 2}
    copy.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")  # builds its own Writer
    copy.teardown()
    plug.teardown()
    assert torch.equal(fw.load(tmp_path / "a.ckpt")["w"], torch.arange(6.0))
    assert torch.equal(fw.load(tmp_path / "b.ckpt")["w"], torch.ones(3))
    trainer = _trainer([plug], [], steps=1)
    buf = io.BytesIO()
    torch.save(trainer, buf)  # what Lightning users do to ship a configured Trainer
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back.strategy.checkpoint_io, FlashwriteCheckpointIO)


@pytest.mark.slow  # README suite budget (issue 36): the slow job in CI runs it
def test_ddp_spawn_fits_with_the_plugin(tmp_path):
    out = _json(_child("spawn", tmp_path / "ck"))
    assert out["files"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]  # saved by rank 0 of the spawned two
    for step, name in enumerate(out["files"], start=1):
        ck = fw.load(tmp_path / "ck" / name)
        assert ck["global_step"] == step and set(ck["state_dict"]) == {"net.weight", "net.bias"}


# ------------------------------------------------------------------ 6: -vN versions and saves in flight


def test_fixed_filename_versions_keep_every_checkpoint(tmp_path):
    runs = {}
    for name, plugins in (("torch", []), ("flashwrite", [FlashwriteCheckpointIO()])):
        pl.seed_everything(0)
        saved = {}

        class Record(pl.Callback):  # the weights each checkpoint holds: those after the step it is saved at
            def on_train_batch_end(self, trainer, module, *args):
                saved[trainer.global_step] = {k: v.clone() for k, v in module.state_dict().items()}

        ck = ModelCheckpoint(dirpath=tmp_path / name, filename="test", every_n_train_steps=1, save_top_k=-1,
                             monitor="step", mode="max")
        _trainer(plugins, [Record(), ck]).fit(Net(), _data())
        runs[name] = (sorted(os.listdir(tmp_path / name)), saved)
    names = ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert runs["torch"][0] == names  # Lightning's own: four versions
    assert runs["flashwrite"][0] == names
    order = ["test.ckpt", "test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt"]
    for step, name in enumerate(order, start=1):
        ck = fw.load(tmp_path / "flashwrite" / name)
        assert ck["global_step"] == step
        assert _state_bytes(ck["state_dict"]) == _state_bytes(runs["flashwrite"][1][step])
        ref = torch.load(tmp_path / "torch" / name, weights_only=True)
        assert _state_bytes(ck["state_dict"]) == _state_bytes(ref["state_dict"])  # the same bits as Lightning's


def test_a_name_in_flight_exists_and_is_never_overwritten_by_another_save(tmp_path):
    one, two = FlashwriteCheckpointIO(), FlashwriteCheckpointIO()
    path = tmp_path / "x.ckpt"
    one.save_checkpoint({"w": torch.zeros(1 << 20)}, path)
    assert os.path.exists(path)  # ModelCheckpoint's file_exists sees the name taken at once
    with pytest.raises(FileExistsError, match="in flight"):
        two.save_checkpoint({"w": torch.ones(3)}, path)
    one.teardown()
    two.teardown()
    assert torch.equal(fw.load(path)["w"], torch.zeros(1 << 20))


def test_what_a_crash_mid_save_leaves_never_wins_ckpt_path_last(tmp_path):
    from flashwrite.integrations.lightning import _claim, _unclaim
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True)
    _trainer([FlashwriteCheckpointIO()], [ck], steps=2).fit(Net(), _data())
    crashed = str(tmp_path / "last-v1.ckpt")
    assert _claim(crashed) == crashed  # what a save to a new name had made when its process died
    _unclaim(crashed, None)  # (this process lives on: the name is no longer in flight)
    assert os.path.isdir(crashed) and not os.listdir(crashed) and os.path.getmtime(crashed) == 0
    seen = {}

    class Start(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["step"] = trainer.global_step

    ck2 = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True)
    _trainer([FlashwriteCheckpointIO()], [ck2, Start()], steps=3).fit(Net(), _data(), ckpt_path="last")
    assert seen["step"] == 2  # resumed from the real last.ckpt, not the empty directory


# ------------------------------------------------------------------ 7: save_last="link"


def test_save_last_link_removes_its_previous_symlink(tmp_path):
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                         save_last="link")
    ck.CHECKPOINT_NAME_LAST = "last-{step}"  # a new last name each time: the previous link is removed
    _trainer([FlashwriteCheckpointIO()], [ck]).fit(Net(), _data())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last-step=4.ckpt"]
    assert os.readlink(tmp_path / "last-step=4.ckpt") == "epoch=0-step=4.ckpt"
    assert fw.load(tmp_path / "last-step=4.ckpt")["global_step"] == 4


def test_remove_checkpoint_unlinks_only_links_to_checkpoints(tmp_path):
    plug = FlashwriteCheckpointIO()
    plug.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    os.symlink("a.ckpt", tmp_path / "link.ckpt")
    (tmp_path / "notes.txt").write_text("mine")
    os.symlink("notes.txt", tmp_path / "other.ckpt")
    plug.remove_checkpoint(tmp_path / "link.ckpt")
    assert not os.path.lexists(tmp_path / "link.ckpt") and os.path.isdir(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="not a flashwrite checkpoint"):
        plug.remove_checkpoint(tmp_path / "other.ckpt")
    assert os.path.islink(tmp_path / "other.ckpt")
    plug.teardown()


# ------------------------------------------------------------------ 8: no teardown from Lightning


def _fit_without_teardown(root):
    """A fit with the plug-in in AsyncCheckpointIO, and a save outside fit: Lightning tears
    neither plug-in down. Run in a function of its own: save_hyperparameters reads its
    callers' frames, and a frame's locals snapshot would keep the trainers alive."""
    ck = ModelCheckpoint(dirpath=root / "a", every_n_train_steps=1, save_top_k=-1, monitor="step", mode="max")
    t = _trainer([AsyncCheckpointIO(FlashwriteCheckpointIO())], [ck], steps=2)
    t.fit(Net(), _data())
    t2 = _trainer([FlashwriteCheckpointIO()], [], steps=1, enable_checkpointing=False)
    t2.fit(Net(), _data())
    t2.save_checkpoint(root / "outside.ckpt")  # Lightning calls no teardown after this


def test_async_wrapper_and_save_outside_fit_release_the_writer(tmp_path):
    before = _commit_threads()
    _fit_without_teardown(tmp_path)
    # The plug-in under AsyncCheckpointIO closed its Writer after each save (the wrapper's
    # teardown, which Lightning called, left no thread); the one saving outside fit holds its own.
    assert len(_commit_threads() - before) == 1
    deadline = time.monotonic() + 10  # a save's job may hold the last references for a moment after it ends
    while _commit_threads() - before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not _commit_threads() - before  # closed with the last reference
    assert fw.load(tmp_path / "outside.ckpt")["global_step"] == 1
    assert sorted(os.listdir(tmp_path / "a")) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]


class _SlowToPickle:
    """A value pickled while its save stages (allow_pickle): the save holds its name claimed,
    its future not yet handed over, for as long as this takes."""

    started = threading.Event()

    def __reduce__(self):
        _SlowToPickle.started.set()
        time.sleep(0.5)
        return (int, (7,))


def test_a_removal_waits_for_a_save_on_another_thread_that_has_not_handed_over(tmp_path):
    """Issue 44 item 6: under AsyncCheckpointIO, save_checkpoint runs in Lightning's executor
    while ModelCheckpoint removes on the main thread; a removal that came while the save
    was staging found the name claimed but no save in flight, and raised."""
    before = _commit_threads()  # an earlier test's Writer may still be alive
    plug = FlashwriteCheckpointIO(allow_pickle=True)
    path = tmp_path / "epoch=0-step=1.ckpt"
    _SlowToPickle.started.clear()
    errors = []

    def save():
        try:
            plug.save_checkpoint({"w": torch.ones(4), "slow": _SlowToPickle()}, path)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    t = threading.Thread(target=save)
    t.start()
    assert _SlowToPickle.started.wait(10)
    assert os.path.isdir(path) and not os.listdir(path)  # the name claimed, nothing committed yet
    plug.remove_checkpoint(path)  # waits for the save, then removes the checkpoint it committed
    t.join(10)
    assert not errors and not os.path.lexists(path)
    assert not _commit_threads() - before  # the save on another thread closed its Writer after it


def _rotate_under_async_wrapper(root, wrapper, trainer_cls, checkpoint_cls):
    ck = checkpoint_cls(dirpath=root, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max",
                        save_last=True)
    t = trainer_cls(max_steps=12, accelerator="cpu", logger=False, enable_progress_bar=False,
                    enable_model_summary=False, plugins=[wrapper(FlashwriteCheckpointIO())], callbacks=[ck])
    module = pl.LightningModule if trainer_cls is pl.Trainer else importlib.import_module(
        "pytorch_lightning").LightningModule

    class Small(module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 256)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    t.fit(Small(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(96, 8)), batch_size=8))


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_rotation_under_async_checkpoint_io_many_times(tmp_path, namespace):
    """Lightning's AsyncCheckpointIO around the plug-in, a checkpoint every step, top 1 + last:
    every rotation finds its checkpoint (or waits for it), and the fit leaves no thread."""
    ns = importlib.import_module(namespace)
    wrapper = importlib.import_module(f"{namespace}.plugins.io").AsyncCheckpointIO
    before = _commit_threads()
    for run in range(5):
        root = tmp_path / str(run)
        _rotate_under_async_wrapper(root, wrapper, ns.Trainer, importlib.import_module(
            f"{namespace}.callbacks").ModelCheckpoint)
        assert sorted(os.listdir(root)) == ["epoch=0-step=12.ckpt", "last.ckpt"]
        assert fw.load(root / "last.ckpt")["global_step"] == 12
        assert not _commit_threads() - before  # the wrapper's teardown left no flashwrite thread


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_either_trainer_takes_the_plugin_and_resumes(tmp_path, namespace):
    """Issue 45 item 3: with both packages installed, pytorch_lightning's Trainer refused the
    plug-in ("Found invalid type for plugin"): it was a lightning.fabric CheckpointIO only."""
    ns = importlib.import_module(namespace)
    ModelCheckpoint_ = importlib.import_module(f"{namespace}.callbacks").ModelCheckpoint

    class Tiny(ns.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(steps, **kw):
        t = ns.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, plugins=[FlashwriteCheckpointIO()],
                       callbacks=[ModelCheckpoint_(dirpath=tmp_path, every_n_train_steps=1, save_last=True)])
        model = Tiny()
        t.fit(model, _data(), **kw)
        return t, model

    first, model = fit(2)
    saved = fw.load(tmp_path / "last.ckpt")
    assert saved["global_step"] == 2
    assert _state_bytes(saved["state_dict"]) == _state_bytes(model.state_dict())
    seen = {}

    class Start(ns.Callback):
        def on_train_start(self, trainer, module):
            seen["step"] = trainer.global_step
            seen["weights"] = _state_bytes(module.state_dict())

    t = ns.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, plugins=[FlashwriteCheckpointIO()], callbacks=[Start()],
                   enable_checkpointing=False)
    t.fit(Tiny(), _data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert seen == {"step": 2, "weights": _state_bytes(saved["state_dict"])}  # resumed from what was saved


@pytest.mark.slow
def test_a_failure_nobody_waited_for_is_reported_when_the_plugin_goes(tmp_path, capfd):
    from fault_util import tmpfs
    with tmpfs(str(tmp_path / "small"), "2m") as small:
        plug = FlashwriteCheckpointIO()
        plug.save_checkpoint({"w": torch.zeros(4 << 20)}, os.path.join(small, "big.ckpt"))  # ENOSPC, later
        del plug
        gc.collect()
        err = capfd.readouterr().err
        assert "big.ckpt" in err and "failed" in err and "No space left" in err
        assert not os.path.exists(os.path.join(small, "big.ckpt"))
        # at interpreter exit: the same report (a bare process: the plug-in needs only lightning.fabric)
        script = ("import sys, torch; from flashwrite.lightning import FlashwriteCheckpointIO as IO; io = IO(); "
                  "io.save_checkpoint({'w': torch.zeros(4 << 20)}, sys.argv[1]); print('returned')")
        r = subprocess.run([sys.executable, "-c", script, os.path.join(small, "exit.ckpt")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == "returned", r.stderr[-2000:]
        assert "exit.ckpt" in r.stderr and "No space left" in r.stderr
        assert not os.path.exists(os.path.join(small, "exit.ckpt"))


# ------------------------------------------------------------------ 9 + 10: a new process, Hydra configs


@pytest.mark.slow
def test_load_in_a_new_process_module_datamodule_and_dictconfig(tmp_path):
    pytest.importorskip("omegaconf", reason="omegaconf is not installed (pip install 'flashwrite[test]')")
    saved = _json(_child("save", tmp_path))
    back = _json(_child("load", tmp_path))
    assert back["net"] == saved["net"] and back["net_hparams"] == {"hidden": 5, "lr": 0.2}
    assert back["data_hparams"] == {"batch_size": 4, "seed": 3}
    assert back["hydra"] == saved["hydra"] and back["hydra_type"] == "DictConfig"
    assert back["hydra_name"] == "h6"
    # what Lightning's own load_from_checkpoint of a torch.save'd checkpoint gives (it resolves on the way)
    assert back["hydra_hparams"] == {"model": {"hidden": 6}, "lr": 0.05, "name": "h6", "layers": [1, 2]}


def test_omegaconf_values_are_stored_without_pickle(tmp_path):
    pytest.importorskip("omegaconf", reason="omegaconf is not installed (pip install 'flashwrite[test]')")
    from omegaconf import DictConfig, ListConfig, OmegaConf
    cfg = OmegaConf.create({"a": {"b": 1}, "c": "${a.b}"})
    ck = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": cfg, "hyper_parameters_type": DictConfig,
          "extra": {"lst": OmegaConf.create([1, {"x": 2}])}}
    plug = FlashwriteCheckpointIO()
    plug.save_checkpoint(ck, tmp_path / "a.ckpt")
    back = plug.load_checkpoint(tmp_path / "a.ckpt")
    plug.teardown()
    assert isinstance(back["hyper_parameters"], DictConfig) and back["hyper_parameters_type"] is DictConfig
    assert back["hyper_parameters"] == cfg and back["hyper_parameters"].c == 1
    assert isinstance(back["extra"]["lst"], ListConfig) and back["extra"]["lst"][1].x == 2
    raw = fw.load(tmp_path / "a.ckpt")  # without the plug-in: plain containers, nothing pickled
    assert raw["hyper_parameters"] == {"a": {"b": 1}, "c": "${a.b}"}
    assert raw["hyper_parameters_type"] == "omegaconf.DictConfig"
