"""save_async(..., extra_files=): small files committed inside a checkpoint's own atomic commit."""

import json
import os

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite.format import INDEX_NAME, MANIFEST_NAME


def test_extra_files_are_committed_with_the_checkpoint(tmp_path):
    src = tmp_path / "tok.json"
    src.write_bytes(b'{"vocab": [1, 2, 3]}')
    state = {"model": {"w": torch.randn(8, 8)}, "step": 3}
    payload = os.urandom(1000)  # any bytes, not just text
    fut = fw.save_async(state, tmp_path / "ck", extra_files={"trainer_state.json": b'{"global_step": 3}',
                                                              "tokenizer.json": src, "blob.bin": payload})
    src.write_bytes(b"changed after the call")  # a path is read when save_async is called
    fut.result()
    ck = tmp_path / "ck"
    assert (ck / "trainer_state.json").read_bytes() == b'{"global_step": 3}'
    assert (ck / "tokenizer.json").read_bytes() == b'{"vocab": [1, 2, 3]}'
    assert (ck / "blob.bin").read_bytes() == payload
    assert_same(fw.load(ck), state)
    fw.verify(ck)


def test_extra_files_with_hf_model_and_overwrite(tmp_path):
    state = {"model": {"w": torch.randn(4, 4)}, "optim": {"m": torch.ones(4)}}
    ck = tmp_path / "checkpoint-2"
    fw.save(state, ck, hf_model="model", hf_config={"model_type": "none"}, extra_files={"a.json": b"1"})
    fw.save(state, ck, hf_model="model", hf_config={"model_type": "none"}, extra_files={"b.json": b"2"},
            overwrite=True)
    names = set(os.listdir(ck))
    assert {"b.json", "config.json", INDEX_NAME, MANIFEST_NAME} <= names and "a.json" not in names
    assert json.loads((ck / "config.json").read_text()) == {"model_type": "none"}


@pytest.mark.parametrize("name", ["", "sub/x.json", "../x.json", ".hidden", MANIFEST_NAME, INDEX_NAME,
                                  "model-00001-of-00002.safetensors", "state-00002-of-00002.safetensors"])
def test_bad_extra_file_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="extra_files"):
        fw.save({"w": torch.ones(2)}, tmp_path / "ck", extra_files={name: b"x"})
    assert not os.listdir(tmp_path)  # refused before anything was created


def test_extra_files_refusals(tmp_path):
    with pytest.raises(ValueError, match="name the checkpoint itself uses"):  # config.json comes from hf_config
        fw.save({"model": {"w": torch.ones(2)}}, tmp_path / "a", hf_model="model", hf_config={"x": 1},
                extra_files={"config.json": b"{}"})
    with pytest.raises(TypeError, match="bytes or a path"):
        fw.save({"w": torch.ones(2)}, tmp_path / "b", extra_files={"x.json": {"not": "bytes"}})
    with pytest.raises(TypeError, match="mapping"):
        fw.save({"w": torch.ones(2)}, tmp_path / "c", extra_files=[b"x"])
    with pytest.raises(FileNotFoundError):
        fw.save({"w": torch.ones(2)}, tmp_path / "d", extra_files={"x.json": tmp_path / "missing"})
    with pytest.raises(ValueError, match="extra_files= apply to single-process saves"):
        fw.save({"w": torch.ones(2)}, tmp_path / "e", extra_files={"x.json": b"1"}, process_group=object())
    assert not os.listdir(tmp_path)
