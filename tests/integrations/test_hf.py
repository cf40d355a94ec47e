"""save_async(..., hf_model="model"): a training checkpoint that from_pretrained loads as a model."""

import json
import os

import pytest
import torch
from conftest import assert_same
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import flashwrite as fw  # noqa: E402


def _llama(tied):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return cfg


def _gpt2(tied):
    return transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   tie_word_embeddings=tied)


@pytest.mark.parametrize("make_config", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_training_checkpoint_loads_with_from_pretrained(tmp_path, make_config, tied):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(tied), dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 12))
    model(x, labels=x).loss.backward()
    opt.step()
    model.eval()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "rng": torch.get_rng_state()}
    fw.save(state, tmp_path / "ck", hf_model="model", hf_config=model.config)

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.bfloat16,
                                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded.eval()
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert list(mine) == list(theirs)
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)

    back = fw.load(tmp_path / "ck")  # and the whole training state, as saved
    assert_same(back, state)
    if tied:
        emb = [k for k in back["model"] if "wte" in k or "embed_tokens" in k][0]
        assert back["model"]["lm_head.weight"] is back["model"][emb]


def test_index_lists_only_the_model(tmp_path):
    state = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4)}, "optim": {"m": torch.ones(4)}, "step": 1}
    fw.save(state, tmp_path / "ck", hf_model="model", hf_config={"model_type": "none", "hidden": 4}, stripes=2)
    names = sorted(os.listdir(tmp_path / "ck"))
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["b", "w"]
    assert all(f.startswith("model-") for f in index["weight_map"].values())
    assert index["metadata"]["total_size"] == 16 * 4 + 4 * 4
    assert any(n.startswith("state-") for n in names)
    assert json.loads((tmp_path / "ck" / "config.json").read_text()) == {"hidden": 4, "model_type": "none"}
    seen = {}
    for f in names:
        if f.endswith(".safetensors"):
            seen.update(load_file(tmp_path / "ck" / f))
    assert set(seen) == {"w", "b", "optim.m"}  # a plain reader sees the model under its own names


def test_bad_hf_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a model's state_dict"):
        fw.save({"weights": {"w": torch.ones(1)}}, tmp_path / "a", hf_model="model")
    with pytest.raises(ValueError, match="holds no tensors"):
        fw.save({"model": {"n": 1}}, tmp_path / "b", hf_model="model")
    with pytest.raises(ValueError, match="same name as a tensor elsewhere"):
        fw.save({"model": {"w": torch.ones(1)}, "w": torch.zeros(1)}, tmp_path / "c", hf_model="model")
    with pytest.raises(TypeError, match="hf_config"):
        fw.save({"model": {"w": torch.ones(1)}}, tmp_path / "d", hf_model="model", hf_config=42)
    assert not any(tmp_path.iterdir())
