"""flashwrite.transformers: Trainer checkpoints through flashwrite, asynchronously."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")

import flashwrite as fw  # noqa: E402
from flashwrite.integrations import transformers as fwt  # noqa: E402
from flashwrite.saving.commit import is_temp_name  # noqa: E402

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))
sys.path.insert(0, HERE)
import transformers_child as child  # noqa: E402


N, HALF = 8, 4  # steps, and the step of the checkpoint a run resumes from (mid-epoch: 8 steps per epoch)


def _run(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "transformers_child.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, result: str) -> list[int]:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-4000:]
    with open(result) as fh:
        return json.load(fh)["losses"]


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    """N steps with a checkpoint at N/2, then a resume from N/2 in a fresh process: its losses
    equal, as float32 bit patterns, those of the uninterrupted run and those of the same run
    with the Trainer's own checkpoints (resumed the same way)."""
    runs = {}
    procs = {}
    for mode in ("flashwrite", "trainer"):  # the two full runs side by side
        out, res = tmp_path / f"{mode}-full", tmp_path / f"{mode}-full.json"
        procs[mode] = (_run(mode, str(out), str(N), str(HALF), "0", str(res)), str(res))
    for mode, (p, res) in procs.items():
        runs[mode] = _finish(p, res)
    assert len(runs["flashwrite"]) == N and runs["flashwrite"] == runs["trainer"]

    fw_ck = tmp_path / "flashwrite-full" / f"checkpoint-{HALF}"
    native_ck = tmp_path / "trainer-full" / f"checkpoint-{HALF}"
    fw.verify(fw_ck)
    # The small files as the Trainer writes them, and the model where from_pretrained finds it.
    for name in ("trainer_state.json", "config.json", "generation_config.json"):
        assert json.loads((fw_ck / name).read_text()) == json.loads((native_ck / name).read_text()), name
    assert {"training_args.bin", "config.json", "generation_config.json"} <= set(os.listdir(fw_ck))
    ours = transformers.AutoModelForCausalLM.from_pretrained(fw_ck).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(native_ck).state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)

    procs = {}
    for mode in ("flashwrite", "trainer"):
        out, res = tmp_path / f"{mode}-resume", tmp_path / f"{mode}-resume.json"
        out.mkdir()
        shutil.copytree(tmp_path / f"{mode}-full" / f"checkpoint-{HALF}", out / f"checkpoint-{HALF}")
        procs[mode] = (_run(mode, str(out), str(N), str(HALF), "1", str(res)), str(res))  # resume_from_checkpoint=True
    for mode, (p, res) in procs.items():
        resumed = _finish(p, res)
        assert resumed == runs[mode][HALF:], f"{mode}: resumed losses differ from the uninterrupted run"
    assert (tmp_path / "flashwrite-resume" / f"checkpoint-{N}" / fw.format.MANIFEST_NAME).is_file()


# ------------------------------------------------------------------ in-process runs


def _trainer(out, cls=fwt.FlashwriteTrainer, callbacks=None, **kw):
    kw.setdefault("max_steps", N)
    kw.setdefault("save_steps", 2)
    return cls(model=child.tiny_model(), args=child.tiny_args(str(out), **kw), train_dataset=child.tiny_data(),
               callbacks=callbacks)


class _CountAfterCommit(transformers.TrainerCallback):
    """After each save: wait for it to commit, then count the checkpoints on disk."""

    def __init__(self):
        self.trainer = None
        self.seen = []

    def on_save(self, args, state, control, **kw):
        self.trainer.wait_for_checkpoints()
        self.seen.append(sorted(e for e in os.listdir(args.output_dir)))


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    out = tmp_path_factory.mktemp("rotated")
    counter = _CountAfterCommit()
    trainer = _trainer(out, save_total_limit=2, callbacks=[counter])
    counter.trainer = trainer
    trainer.train()
    return out, trainer, counter


def test_rotation_keeps_save_total_limit(rotated):
    out, trainer, counter = rotated
    assert counter.seen == [["checkpoint-2"], ["checkpoint-2", "checkpoint-4"], ["checkpoint-4", "checkpoint-6"],
                            ["checkpoint-6", "checkpoint-8"]]
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]
    assert len(trainer.flashwrite_stats) == 4 and all(s.stall_s is not None for s in trainer.flashwrite_stats)
    # The staging pool was sized after the first step (no save due then), not by the first save.
    assert trainer._fw_writer._reserving is not None and trainer._fw_writer._reserving.result() > 0
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-8")


def test_the_model_part_loads_with_from_pretrained(rotated):
    out, trainer, _ = rotated
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-8")
    mine = trainer.model.state_dict()
    theirs = loaded.state_dict()
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_trainers_own_loaders_skip_what_ours_load(rotated, tmp_path):
    """The Trainer's _load_optimizer_and_scheduler / _load_rng_state find no .pt files in a
    flashwrite checkpoint and skip silently; the integration's overrides load them."""
    out, _, _ = rotated
    ck = str(out / "checkpoint-8")
    saved = fw.load(ck)
    fresh = _trainer(tmp_path)
    fresh.create_optimizer_and_scheduler(num_training_steps=N)
    transformers.Trainer._load_optimizer_and_scheduler(fresh, ck)
    assert not fresh.optimizer.state and fresh.lr_scheduler.last_epoch == 0  # nothing loaded, not a word said
    fresh._load_optimizer_and_scheduler(ck)
    assert fresh.lr_scheduler.last_epoch == saved["scheduler"]["last_epoch"] == N
    got = fresh.optimizer.state_dict()
    assert got["state"].keys() == saved["optimizer"]["state"].keys()
    for i, st in saved["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    transformers.Trainer._load_rng_state(fresh, ck)
    assert torch.equal(torch.get_rng_state(), before)
    fresh._load_rng_state(ck)
    assert torch.equal(torch.get_rng_state(), saved["rng"]["cpu"])
    import random

    import numpy as np
    assert random.getstate() == fwt._tuples(saved["rng"]["python"])
    assert np.array_equal(np.random.get_state()[1], saved["rng"]["numpy"][1])


class _HoldLastCommit(transformers.TrainerCallback):
    """Before the last step, occupy the writer's commit thread until a timer lets go: the
    last checkpoint is then still in flight when the training loop ends."""

    def __init__(self, hold_s):
        self.trainer = None
        self.hold_s = hold_s
        self.released_at = None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == args.max_steps - 1:
            gate = threading.Event()
            self.trainer._fw_writer._committer().submit(gate.wait)

            def release():
                self.released_at = time.monotonic()
                gate.set()
            threading.Timer(self.hold_s, release).start()


def test_a_save_in_flight_when_training_ends_is_waited_for(tmp_path):
    hold = _HoldLastCommit(1.5)
    trainer = _trainer(tmp_path, max_steps=4, save_steps=2, callbacks=[hold])
    hold.trainer = trainer
    trainer.train()
    returned = time.monotonic()
    assert hold.released_at is not None and returned >= hold.released_at
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    fw.verify(tmp_path / "checkpoint-4")
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.root
def test_a_failed_checkpoint_is_reported_and_nothing_half_written_appears(tmp_path, caplog):
    """A save that fails in the background (no space) is logged when it fails, training goes
    on, and the end of train() raises it; no checkpoint-N (whole-looking or not) is left."""
    from fault_util import tmpfs
    with tmpfs(str(tmp_path / "mnt"), "256k") as mnt:
        trainer = _trainer(mnt, max_steps=4, save_steps=2)
        with caplog.at_level(logging.ERROR, logger="flashwrite"), pytest.raises(OSError) as err:
            trainer.train()
        assert err.value.errno == errno.ENOSPC
        assert "checkpoint step 2 failed" in caplog.text and "checkpoint step 4 failed" in caplog.text
        assert trainer.state.global_step == 4  # training went on past the failed save
        assert os.listdir(mnt) == []


def test_with_flashwrite_mixes_into_a_trainer_subclass():
    class MyTrainer(transformers.Trainer):
        pass

    mixed = fwt.with_flashwrite(MyTrainer)
    assert issubclass(mixed, MyTrainer) and issubclass(mixed, fwt.FlashwriteTrainerMixin)
    assert mixed.__mro__.index(fwt.FlashwriteTrainerMixin) < mixed.__mro__.index(MyTrainer)
    assert fwt.with_flashwrite(mixed) is mixed
    with pytest.raises(TypeError, match="Trainer subclass"):
        fwt.with_flashwrite(object)


# ------------------------------------------------- the private methods it overrides

# sha256 of inspect.getsource(...) in the transformers versions of fwt.TESTED_VERSIONS. When a new
# transformers changes one, read the change against flashwrite/transformers.py's override (and the
# call order it relies on: _load_from_checkpoint in train(), _load_optimizer_and_scheduler and
# _load_scaler once the optimizer exists, _load_rng_state at the epoch start), then update here and
# TESTED_VERSIONS (and the pin of the `transformers` extra in pyproject.toml).
OVERRIDDEN = {
    "Trainer._save_checkpoint": "a9111e30faa99339",
    "Trainer._load_from_checkpoint": "a2804e8d93a297e3",
    "Trainer._load_optimizer_and_scheduler": "741032f57d6fb802",
    "Trainer._load_scaler": "c0695f79116426e2",
    "Trainer._load_rng_state": "d5ebdfc0a0884c4b",
    "Trainer._load_best_model": "0e183d55a9db7414",
    "Trainer._finalize_training": "6d6d83d6a2715f2a",
    "Trainer.train": "9a3c2bcd066d8f99",
    "Trainer._inner_training_loop": "20ec4276e99fe7ae",
    "Trainer._prepare_for_training": "28182cbf71da73dd",
    "Trainer._run_epoch": "31aff00f34c302a2",
    "trainer_utils.rotate_checkpoints": "4aac03e039844595",
    "trainer_utils.get_last_checkpoint": "8b16bf27680b5364",
    "trainer_utils.sort_checkpoints": "dad8bd44da25f919",
}


def _source_hash(qualname: str) -> str:
    owner, name = qualname.split(".")
    obj = getattr(transformers.Trainer if owner == "Trainer" else transformers.trainer_utils, name)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_transformers_version_is_a_tested_one():
    assert fwt._version_tested(), (f"transformers {transformers.__version__} is not among the versions "
                                   f"flashwrite.transformers was tested with ({fwt.TESTED_VERSIONS})")


@pytest.mark.parametrize("qualname", sorted(OVERRIDDEN))
def test_the_trainer_methods_it_relies_on_are_unchanged(qualname):
    got = _source_hash(qualname)
    assert got == OVERRIDDEN[qualname], (
        f"transformers {transformers.__version__} changed {qualname} (source sha256 {got}): flashwrite.transformers "
        "overrides or relies on it; review the change, then update OVERRIDDEN and TESTED_VERSIONS")


def test_the_overrides_keep_the_trainers_signatures():
    for name in ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
                 "_load_rng_state", "_load_best_model", "_finalize_training"):
        ours = inspect.signature(getattr(fwt.FlashwriteTrainerMixin, name))
        theirs = inspect.signature(getattr(transformers.Trainer, name))
        assert list(ours.parameters) == list(theirs.parameters), name
