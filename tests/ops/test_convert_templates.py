"""What users hit converting and loading (issue 25, section 3): a DCP written by
``flashwrite convert --to dcp`` loads with the original state as template wherever torch's
own ``dcp.save`` does (non-tensor leaves, tied weights); an ``hf_model=`` checkpoint
converted to a Hugging Face directory keeps config.json; ``fw.load`` of an index file."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import flashwrite as fw
from ops_helpers import run

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():  # "assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        return fn(*a, **kw)


def _tiny_gpt2(seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                                  tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(cfg)


def _state(seed: int) -> dict:
    model = _tiny_gpt2(seed)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()  # tied, as GPT-2 is
    g = torch.Generator().manual_seed(seed)
    return {"model": sd, "opt": {"exp_avg": torch.randn(5, generator=g), "step": 10 + seed},
            "extra": {"lr": 0.1 * (seed + 1), "name": f"run{seed}", "betas": (0.9, 0.99), "none": None,
                      "milestones": [1, 2, 3]}}


def _template() -> dict:
    """What a resuming job holds: the same structure, other values (ties included)."""
    t = _state(1)
    for k, v in t["model"].items():
        v.zero_()
    t["opt"]["exp_avg"].zero_()
    return t


def _assert_same(got, want, path="") -> None:
    assert type(got) is type(want), path
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}.{i}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), path
    else:
        assert got == want, path


def test_convert_to_dcp_loads_with_the_original_template_like_torchs_own(capsys, tmp_path):
    state = _state(0)
    fw.save(state, tmp_path / "fw")
    rc, _, err = run(capsys, "convert", tmp_path / "fw", tmp_path / "ours", "--to", "dcp", "-q")
    assert rc == 0, err
    _quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchs")), no_dist=True)
    for d in ("torchs", "ours"):
        template = _template()
        _quiet(dcp.load, template, storage_reader=dcp.FileSystemReader(str(tmp_path / d)), no_dist=True)
        _assert_same(template, state, d)
        m = template["model"]
        assert m["lm_head.weight"].data_ptr() == m["transformer.wte.weight"].data_ptr(), d  # still one tensor
    # Both name the same items: every tensor (each tied name too) and every non-tensor leaf.
    ours = _quiet(dcp.FileSystemReader(str(tmp_path / "ours")).read_metadata).state_dict_metadata
    theirs = _quiet(dcp.FileSystemReader(str(tmp_path / "torchs")).read_metadata).state_dict_metadata
    assert set(ours) == set(theirs)
    assert {type(v) for v in ours.values()} == {type(v) for v in theirs.values()}


def test_dcp_from_convert_converts_back_to_the_same_state(capsys, tmp_path):
    state = _state(0)
    fw.save(state, tmp_path / "fw")
    assert run(capsys, "convert", tmp_path / "fw", tmp_path / "dcp", "--to", "dcp", "-q")[0] == 0
    rc, _, err = run(capsys, "convert", tmp_path / "dcp", tmp_path / "back", "-q")
    assert rc == 0, err
    back = fw.load(tmp_path / "back")
    _assert_same(back, state)
    assert back["model"]["lm_head.weight"].data_ptr() == back["model"]["transformer.wte.weight"].data_ptr()


def test_hf_model_checkpoint_to_hf_directory_keeps_config(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _tiny_gpt2(0)
    fw.save({"model": model.state_dict(), "step": 3}, tmp_path / "ck", hf_model="model", hf_config=model.config)
    rc, _, err = run(capsys, "convert", tmp_path / "ck", tmp_path / "hf", "--to", "hf", "-q")
    assert rc == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_bytes()) == \
        json.loads((tmp_path / "ck" / "config.json").read_bytes())
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_load_of_a_flashwrite_index_file_loads_its_checkpoint(tmp_path):
    state = _state(0)
    fw.save(state, tmp_path / "ck")
    _assert_same(fw.load(tmp_path / "ck" / "model.safetensors.index.json"), fw.load(tmp_path / "ck"))


def test_load_of_a_hugging_face_index_file_loads_the_shards_it_lists(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    shards = {"model-00001-of-00002.safetensors": {"a": torch.randn(4, 4, generator=g)},
              "model-00002-of-00002.safetensors": {"b": torch.arange(6, dtype=torch.int32)}}
    d = tmp_path / "hf"
    d.mkdir()
    for name, tensors in shards.items():
        st.save_file(tensors, d / name)
    st.save_file({"stray": torch.ones(1)}, d / "not-listed.safetensors")  # the index decides, not the glob
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 88}, "weight_map": {k: n for n, ts in shards.items() for k in ts}}))
    got = fw.load(str(d / "model.safetensors.index.json"))
    assert sorted(got) == ["a", "b"]
    for tensors in shards.values():
        for k, v in tensors.items():
            assert torch.equal(got[k], v), k


def test_load_of_another_json_file_says_what_to_pass(tmp_path):
    fw.save({"w": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(ValueError, match="not a safetensors file.*directory"):
        fw.load(tmp_path / "ck" / "flashwrite.json")
