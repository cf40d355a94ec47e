"""flashwrite.transformers checkpoints read by transformers' own readers of a checkpoint's
model weights: ``from_pretrained``, ``load_sharded_checkpoint`` and the Trainer's
``_load_from_checkpoint`` and ``_load_best_model`` (each run as transformers wrote it, not
flashwrite's overrides), for a PreTrainedModel and for a plain ``nn.Module``."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

import flashwrite as fw  # noqa: E402
from flashwrite.integrations import transformers as fwt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(_TESTS_FILE)))
import transformers_child as child  # noqa: E402
from transformers_child import Plain  # noqa: E402


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MODELS = {"pretrained": child.tiny_model, "plain": Plain}


@pytest.fixture(scope="module", params=sorted(MODELS))
def trained(request, tmp_path_factory):
    """(kind, checkpoint, the trained weights): 4 steps, the last one saved."""
    out = tmp_path_factory.mktemp(f"layout-{request.param}")
    trainer = fwt.FlashwriteTrainer(model=MODELS[request.param](), train_dataset=child.tiny_data(),
                                    args=child.tiny_args(str(out), max_steps=4, save_steps=4))
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return request.param, str(out / "checkpoint-4"), weights


def _fresh(kind, tmp_path):
    """A Trainer with an untrained model of the same kind."""
    trainer = transformers.Trainer(model=MODELS[kind](), args=child.tiny_args(str(tmp_path), max_steps=4),
                                   train_dataset=child.tiny_data())
    return trainer


def _same(model, weights) -> bool:
    got = model.state_dict()
    return list(got) == list(weights) and all(torch.equal(got[k], weights[k]) for k in got)


def test_the_index_names_the_models_tensors_only(trained):
    """model.safetensors.index.json lists what the Trainer's model.safetensors would hold:
    the model's state dict under its own names (tied weights once), in shards that
    safetensors opens without flashwrite; fw.load still returns the whole training state."""
    kind, ck, weights = trained
    with open(os.path.join(ck, "model.safetensors.index.json")) as fh:
        index = json.load(fh)["weight_map"]
    tied = {"lm_head.weight"} if kind == "pretrained" else set()
    assert set(index) == set(weights) - tied
    shards = {}
    for name in sorted(set(index.values())):
        shards.update(safetensors_torch.load_file(os.path.join(ck, name)))
    assert set(shards) == set(index) and all(torch.equal(shards[k], weights[k]) for k in shards)
    state = fw.load(ck)
    assert {"model", "optimizer", "scheduler", "rng"} <= set(state)
    assert list(state["model"]) == list(weights) and all(torch.equal(state["model"][k], weights[k]) for k in weights)


def test_load_sharded_checkpoint_loads_the_model(trained, tmp_path):
    kind, ck, weights = trained
    fresh = _fresh(kind, tmp_path)
    assert not _same(fresh.model, weights)
    result = transformers.trainer_utils.load_sharded_checkpoint(fresh.model, ck, strict=kind == "plain")
    assert _same(fresh.model, weights) and not result.unexpected_keys


def test_the_trainers_own_load_from_checkpoint_loads_the_model(trained, tmp_path):
    kind, ck, weights = trained
    fresh = _fresh(kind, tmp_path)
    transformers.Trainer._load_from_checkpoint(fresh, ck)
    assert _same(fresh.model, weights)


def test_the_trainers_own_load_best_model_loads_the_model(trained, tmp_path):
    kind, ck, weights = trained
    fresh = _fresh(kind, tmp_path)
    fresh.state.best_model_checkpoint = ck
    transformers.Trainer._load_best_model(fresh)
    assert _same(fresh.model, weights)


def test_from_pretrained_loads_the_model(trained):
    kind, ck, weights = trained
    if kind == "plain":
        pytest.skip("a plain nn.Module has no config.json to build it from")
    assert _same(transformers.AutoModelForCausalLM.from_pretrained(ck), weights)


def test_there_is_no_single_model_safetensors(trained):
    """By design (docs/transformers.md): the model is always in the sharded layout that
    save_pretrained writes above max_shard_size, never one model.safetensors."""
    _, ck, _ = trained
    assert not os.path.exists(os.path.join(ck, "model.safetensors"))
    assert os.path.isfile(os.path.join(ck, "model.safetensors.index.json"))


class _Clashing(Plain):
    """A model with a submodule named like a part of the training state ("rng")."""

    def __init__(self):
        super().__init__()
        self.rng = torch.nn.Linear(2, 2)


def test_a_model_whose_names_could_clash_keeps_the_whole_state_index(tmp_path, caplog):
    """Its tensors could be named like the rest of the state's, so the index names the whole
    state (with a warning saying the Trainer's loaders cannot read it); flashwrite still saves,
    resumes and loads the best model from it."""
    trainer = fwt.FlashwriteTrainer(model=_Clashing(), train_dataset=child.tiny_data(),
                                    args=child.tiny_args(str(tmp_path), max_steps=2, save_steps=2))
    with caplog.at_level("WARNING", logger="flashwrite"):
        trainer.train()
    assert "names the whole training state" in caplog.text
    ck = str(tmp_path / "checkpoint-2")
    with open(os.path.join(ck, "model.safetensors.index.json")) as fh:
        assert any(k.startswith("optimizer.") for k in json.load(fh)["weight_map"])
    fresh = fwt.FlashwriteTrainer(model=_Clashing(), train_dataset=child.tiny_data(),
                                  args=child.tiny_args(str(tmp_path / "fresh"), max_steps=2))
    fresh.state.best_model_checkpoint = ck
    fresh._load_best_model()
    assert _same(fresh.model, trainer.model.state_dict())
