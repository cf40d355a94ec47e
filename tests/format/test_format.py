"""The on-disk format: stripes are valid safetensors files that the real `safetensors`
package opens, data is 4 KiB aligned with no holes, the HF index is right."""

import json
import os
import struct

import pytest
import torch

import flashwrite as fw
from flashwrite import _core
from flashwrite.format import dtypes
from flashwrite.format import FORMAT_VERSION, INDEX_NAME, MANIFEST_NAME, read_manifest
from flashwrite.format import decode_manifest_json

safetensors_torch = pytest.importorskip("safetensors.torch")
xxhash = pytest.importorskip("xxhash")


def _state():
    g = torch.Generator().manual_seed(1)
    return {
        "model": {f"layer{i}.weight": torch.randn(64 + i, 33, generator=g) for i in range(6)},
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "mask": torch.rand(9, generator=g) > 0.5,
        "ids": torch.randint(-5, 5, (13,), dtype=torch.int8, generator=g),
        "i64": torch.arange(7),
        "f8": torch.randn(11, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "none_bytes": torch.empty(0, 3),
        "step": 12,
    }


def _saved_by_key(sd):
    """The saved tensors under the keys the format promises: dotted paths of the tree."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _saved_by_key(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_each_stripe_opens_with_safetensors(writer, ckdir):
    """The real safetensors reader, with no flashwrite involved, returns the saved state:
    every saved tensor, same dtype and shape where safetensors can name the dtype, same
    bytes always (compared with what was saved, not with flashwrite's own loader)."""
    sd = _state()
    expected = _saved_by_key(sd)
    writer.save(sd, ckdir / "ck")
    names = [f["name"] for f in decode_manifest_json((ckdir / "ck" / MANIFEST_NAME).read_text())["files"]]
    seen = {}
    for name in names:
        for key, t in safetensors_torch.load_file(str(ckdir / "ck" / name)).items():
            assert key not in seen, f"{key} in two stripes"
            seen[key] = t
    assert set(seen) == set(expected)
    for key, want in expected.items():
        got = seen[key]
        if dtypes.safetensors_code(want.dtype):
            assert got.dtype == want.dtype and got.shape == want.shape, (key, got.dtype, got.shape)
        else:  # no safetensors code: stored as bytes; the manifest keeps the true dtype
            assert got.dtype == torch.uint8 and got.shape == (want.numel() * want.element_size(),), key
        assert torch.equal(_bytes(got), _bytes(want)), f"{key}: bytes differ from the saved tensor"


def test_layout_aligned_packed_exact_size(writer, ckdir):
    writer.save(_state(), ckdir / "ck")
    m = read_manifest(ckdir / "ck")
    for f in m.files:
        path = ckdir / "ck" / f.name
        raw = path.read_bytes()
        assert len(raw) == f.size == os.path.getsize(path)
        (n,) = struct.unpack("<Q", raw[:8])
        assert (8 + n) % 4096 == 0, "tensor data must start on a 4 KiB boundary"
        header = json.loads(raw[8:8 + n])
        assert header["__metadata__"]["format"] == "pt"
        spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
        pos = 0
        for a, b in spans:
            assert a == pos, "no holes between tensors"
            pos = b
        assert 8 + n + pos == len(raw), "file ends exactly at the last tensor"
        for k, v in header.items():
            if k == "__metadata__":
                continue
            dt = dtypes.dtype_from_name(m.tensors[k].dtype)
            assert (8 + n + v["data_offsets"][0]) % dtypes.itemsize(dt) == 0, f"{k} not naturally aligned"


def test_index_and_manifest(writer, ckdir):
    sd = _state()
    writer.save(sd, ckdir / "ck")
    index = json.loads((ckdir / "ck" / INDEX_NAME).read_text())
    m = read_manifest(ckdir / "ck")
    assert set(index["weight_map"]) == set(m.tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in m.tensors.values())
    for key, fname in index["weight_map"].items():
        assert fname == m.files[m.tensors[key].file].name
    raw = decode_manifest_json((ckdir / "ck" / MANIFEST_NAME).read_text())
    assert raw["format_version"] == FORMAT_VERSION and raw["checksum"]["algorithm"] == "xxh3-64"
    assert raw["writer_version"] == fw.__version__
    assert sorted(os.listdir(ckdir / "ck")) == sorted([MANIFEST_NAME, INDEX_NAME] + [f.name for f in m.files])


def test_stripes_are_balanced(ckdir):
    sd = {f"w{i}": torch.zeros(1 << 16) for i in range(16)}
    with fw.Writer(stripes=4) as w:
        st = w.save(sd, ckdir / "ck")
    sizes = [f.size for f in read_manifest(ckdir / "ck").files]
    assert st.stripes == 4 and len(sizes) == 4 and max(sizes) == min(sizes)


def test_checksums_match_an_independent_xxh3(writer, ckdir):
    xxhash = pytest.importorskip("xxhash")
    x = torch.randn(3000)
    writer.save({"x": x}, ckdir / "ck")
    m = read_manifest(ckdir / "ck")
    e = m.tensors["x"]
    data = (ckdir / "ck" / m.files[e.file].name).read_bytes()
    for (off, n), h in zip(fw.format.piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums):
        assert xxhash.xxh3_64_hexdigest(data[off:off + n]) == h


@pytest.mark.parametrize("n", [0, 1, 16, 239, 240, 241, 1024, 4095, 131071, 131072, 131073, 1 << 20, (3 << 20) + 17])
def test_checksum_is_xxh3_at_every_length(n):
    """The native hash (AVX2 where the CPU has it, else generic) is XXH3-64, whatever
    the input length: short inputs, the 128 KiB blocks the staging copy hashes, odd tails."""
    data = os.urandom(n)
    assert _core.checksum(data) == xxhash.xxh3_64_intdigest(data)
