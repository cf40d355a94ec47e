"""One parser, one set of bounds: every reader of safetensors headers (a foreign file
through flashwrite.load, a shard read by ``flashwrite convert``, a stripe's header
checked on load) refuses the same hostile headers with the same message, and accepts
the same good ones."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import flashwrite as fw
from flashwrite import format as fmt
from flashwrite.errors import CorruptCheckpointError
from flashwrite.format import safetensors_header
from flashwrite.ops.sources import SafetensorsSource
from flashwrite.format.safetensors_header import MAX_HEADER_BYTES


def _file(path, header, data=b"", length=None):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _foreign(path):
    fw.load(path)


def _convert_source(path):
    SafetensorsSource(str(path), [str(path)], "safetensors").close()


def _stripe(path):
    raw = path.read_bytes()
    n = min(struct.unpack("<Q", raw[:8])[0], len(raw) - 8)
    fmt.check_stripe_header(memoryview(raw[:8 + n]), fmt.FileEntry(path.name, len(raw), 8 + n), [])


READERS = {"foreign": _foreign, "convert": _convert_source, "stripe": _stripe}
F32 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}

HOSTILE = {
    # name: (header, data, length written in the first 8 bytes (None: the true one), message)
    "length-past-the-file": ({"a": F32}, b"\0" * 4, 1 << 40, "header length"),
    "length-past-the-limit": ({"a": F32}, b"\0" * 4, MAX_HEADER_BYTES + 1, "header length"),
    "length-2**64-1": ({"a": F32}, b"\0" * 4, 2**64 - 1, "header length"),
    "not-json": (b"{not json", b"", None, "not valid JSON"),
    "truncated-json": (b'{"a": {"dtype": "F32"', b"", None, "not valid JSON"),
    "a-list": (b"[1, 2]", b"", None, "not an object"),
    "a-float": ({"a": {**F32, "shape": [1.0]}}, b"\0" * 4, None, "not valid JSON"),
    "offsets-past-the-end": ({"a": {**F32, "data_offsets": [4, 8]}}, b"\0" * 4, None, "data_offsets must lie inside"),
    "offsets-reversed": ({"a": {**F32, "data_offsets": [4, 0]}}, b"\0" * 4, None, "data_offsets must lie inside"),
    "offsets-negative": ({"a": {**F32, "data_offsets": [-4, 0]}}, b"\0" * 4, None, "data_offsets must lie inside"),
    "offsets-bool": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, b"\0", None,
                     "data_offsets must lie inside"),
    "overlapping": ({"a": F32, "b": {**F32, "data_offsets": [2, 6]}}, b"\0" * 8, None, "overlap"),
    "same-bytes-twice": ({"a": F32, "b": F32}, b"\0" * 4, None, "overlap"),
    "shape-vs-bytes": ({"a": {**F32, "shape": [2]}}, b"\0" * 4, None, "do not fit"),
    "shape-65-dims": ({"a": {**F32, "shape": [1] * 65}}, b"\0" * 4, None, "at most 64"),
    "shape-negative": ({"a": {**F32, "shape": [-1]}}, b"\0" * 4, None, "shape must be"),
    "shape-huge": ({"a": {**F32, "shape": [2**63]}}, b"\0" * 4, None, "shape must be"),
    "unknown-dtype": ({"a": {**F32, "dtype": "F99"}}, b"\0" * 4, None, "unknown dtype"),
    "entry-not-an-object": ({"a": 7}, b"", None, "not an object"),
    "metadata-not-strings": ({"__metadata__": {"step": 5}, "a": F32}, b"\0" * 4, None, "must map strings"),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", HOSTILE)
def test_every_reader_refuses_the_same_hostile_header(tmp_path, reader, case):
    header, data, length, msg = HOSTILE[case]
    path = _file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CorruptCheckpointError, match=msg) as e:
        READERS[reader](path)
    assert "bad.safetensors" in str(e.value) and e.value.file.endswith("bad.safetensors")


def test_too_short_a_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x02\0\0")
    for reader in ("foreign", "convert"):
        with pytest.raises(CorruptCheckpointError, match="too short"):
            READERS[reader](path)


def test_the_parser_reads_what_safetensors_writes(tmp_path):
    state = {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int16), "empty": torch.empty(0, 2),
             "s": torch.tensor(1.5, dtype=torch.float64)}
    path = tmp_path / "m.safetensors"
    save_file(state, path, metadata={"format": "pt", "note": "x"})
    fd = os.open(path, os.O_RDONLY)
    try:
        h = safetensors_header.read(fd, "m.safetensors")
    finally:
        os.close(fd)
    assert h.metadata == {"format": "pt", "note": "x"}
    raw = path.read_bytes()
    assert h.header_bytes == 8 + struct.unpack("<Q", raw[:8])[0]
    assert safetensors_header.parse(raw, len(raw), "m.safetensors") == h
    for k, t in state.items():
        e = h.tensors[k]
        assert (e.dtype, e.shape) == (t.dtype, tuple(t.shape))
        assert raw[h.header_bytes + e.start: h.header_bytes + e.end] == t.numpy().tobytes()


def test_an_empty_tensor_may_sit_anywhere(tmp_path):
    # No bytes, no overlap: safetensors writes empty tensors at any offset.
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}
    data = torch.tensor([1.0, 2.0]).numpy().tobytes()
    path = _file(tmp_path / "ok.safetensors", header, data)
    got = fw.load(path)
    assert torch.equal(got["a"], torch.tensor([1.0, 2.0])) and got["e"].shape == (0,)
    src = SafetensorsSource(str(path), [str(path)], "safetensors")
    try:
        assert [(i.key, i.shape) for i in src.items] == [("a", (2,)), ("e", (0,))]
    finally:
        src.close()


def test_a_header_cut_short_in_memory(tmp_path):
    raw = _file(tmp_path / "m.safetensors", {"a": F32}, b"\0" * 4).read_bytes()
    with pytest.raises(CorruptCheckpointError, match="cut short"):
        safetensors_header.parse(raw[:12], len(raw), "m.safetensors")


def test_save_refuses_metadata_that_safetensors_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match="strings to strings"):
        fw.save({"w": torch.ones(2)}, tmp_path / "ck", metadata={"step": 5})
    assert not (tmp_path / "ck").exists()
