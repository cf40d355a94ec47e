"""flashwrite.load reads safetensors that flashwrite did not write, like safetensors.torch.load_file."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashwrite as fw
from flashwrite.format import dtypes
from flashwrite.errors import CorruptCheckpointError, UnsafeCheckpointError

ST_DTYPES = [dt for dt in dtypes.supported_dtypes() if dtypes.safetensors_code(dt)]


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(ST_DTYPES):
        raw = torch.randint(0, 256, (3 * 5 * dt.itemsize,), dtype=torch.uint8, generator=g)
        out[f"t{i}.{str(dt)[6:]}"] = (raw & 1 if dt == torch.bool else raw).view(dt).reshape(3, 5)
    out["empty"] = torch.empty(0, 4)
    out["scalar"] = torch.tensor(2.5)
    return out


def _same(got, exp):
    assert list(got) == list(exp)
    for k in exp:
        assert got[k].dtype == exp[k].dtype and got[k].shape == exp[k].shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), exp[k].reshape(-1).view(torch.uint8)), k
        assert got[k].storage_offset() == 0 and got[k].untyped_storage().nbytes() == got[k].nbytes, k


def test_single_file_equals_load_file(tmp_path):
    save_file(_state(), tmp_path / "m.safetensors", metadata={"format": "pt"})
    _same(fw.load(tmp_path / "m.safetensors"), load_file(tmp_path / "m.safetensors"))
    _same(fw.load(str(tmp_path / "m.safetensors"), direct=False, backend="threads"),
          load_file(tmp_path / "m.safetensors"))


def test_sharded_directory_with_and_without_index(tmp_path):
    st = _state(1)
    keys = list(st)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: st[k] for k in ks}, tmp_path / name)
    merged = {}
    for name in sorted(shards):
        merged.update(load_file(tmp_path / name))
    _same(fw.load(tmp_path), merged)  # no index: every *.safetensors, in name order
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    _same(fw.load(tmp_path), merged)


def test_unaligned_tensor_data_is_copied_out(tmp_path):
    # A handmade file: a 3-byte U8 tensor, then an F32 tensor at data offset 3 and an I64 at 7.
    a, b, c = torch.arange(3, dtype=torch.uint8), torch.randn(5), torch.arange(2, dtype=torch.int64) - 9
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]},
              "c": {"dtype": "I64", "shape": [2], "data_offsets": [23, 39]}}
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8 + 5)  # and the data itself starts off any alignment
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + a.numpy().tobytes() + b.numpy().tobytes()
                     + c.numpy().tobytes())
    got = fw.load(path)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and torch.equal(got["c"], c)


def test_a_flashwrite_directory_still_loads_as_a_checkpoint(tmp_path):
    state = {"nested": {"w": torch.randn(4)}, "step": 3}
    fw.save(state, tmp_path / "ck")
    assert fw.load(tmp_path / "ck")["step"] == 3
    stripe = sorted((tmp_path / "ck").glob("*.safetensors"))[0]
    assert torch.equal(fw.load(stripe)["nested.w"], state["nested"]["w"])  # one stripe is plain safetensors too


def _write_raw(path, header, data=b""):
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize("header, data", [
    (b"not json", b""),
    (b"[1, 2]", b""),
    ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8),
    ({"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}, b"\0" * 4),
    ({"a": 7}, b""),
], ids=["not-json", "not-object", "dtype", "shape-vs-bytes", "past-end", "reversed", "negative", "overlap",
        "shape-type", "entry-type"])
def test_hostile_headers_are_named(tmp_path, header, data):
    _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CorruptCheckpointError, match="bad.safetensors"):
        fw.load(tmp_path / "bad.safetensors")


def test_absurd_header_length_allocates_nothing(tmp_path):
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="header length"):
        fw.load(tmp_path / "huge.safetensors")


def test_index_cannot_leave_the_directory(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "x.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(UnsafeCheckpointError):
        fw.load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="gone.safetensors"):
        fw.load(tmp_path)


def test_duplicate_names_across_shards_are_refused(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "1.safetensors")
    save_file({"a": torch.zeros(2)}, tmp_path / "2.safetensors")
    with pytest.raises(CorruptCheckpointError, match="'a' is also in"):
        fw.load(tmp_path)


def test_symlinked_shard_is_refused(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "real.bin")
    os.symlink(tmp_path / "real.bin", tmp_path / "link.safetensors")
    with pytest.raises(UnsafeCheckpointError):
        fw.load(tmp_path)


def test_empty_directory_is_no_checkpoint(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="flashwrite.json is missing"):
        fw.load(tmp_path)


def test_flashwrite_stripes_without_their_manifest_never_load_as_plain_safetensors(tmp_path):
    fw.save({"w": torch.randn(8)}, tmp_path / "ck")
    os.unlink(tmp_path / "ck" / "flashwrite.json")  # what a crash before the commit, or a damaged copy, leaves
    with pytest.raises(CorruptCheckpointError, match="incomplete flashwrite checkpoint"):
        fw.load(tmp_path / "ck")


@pytest.mark.cuda
def test_to_gpu_through_the_pinned_pipeline(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    save_file(_state(), tmp_path / "m.safetensors")
    got = fw.load(tmp_path / "m.safetensors", map_location="cuda")
    exp = load_file(tmp_path / "m.safetensors")
    for k in exp:
        assert got[k].device.type == "cuda"
        assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8), exp[k].reshape(-1).view(torch.uint8)), k
