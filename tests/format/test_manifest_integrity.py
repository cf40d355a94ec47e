"""An altered manifest never loads as a different state.

The manifest carries a checksum of its own content (format 3): any edit is refused,
naming the manifest. Under that, every tensor's dtype, shape and byte range is
cross-checked against its stripe's safetensors header, which catches a manifest
whose checksum was recomputed after an edit, and is what guards format 1 and 2
checkpoints (written before the checksum existed; they must keep loading).
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import zlib

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite import format as fmt
from flashwrite.errors import CorruptCheckpointError
from flashwrite.format import decode_manifest_json

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


DATA = os.path.join(os.path.dirname(_TESTS_FILE), "data")


def _state():
    g = torch.Generator().manual_seed(13)
    return {"w": torch.randn(4, 6, generator=g), "w2": torch.randn(4, 6, generator=g), "u8": torch.arange(16, dtype=torch.uint8),
            "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4), "b8": torch.arange(8, dtype=torch.uint8)
            .view(torch.bits8), "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "opt": {"step": 7, "lr": 0.5, "betas": (0.9, 0.99)}}


@pytest.fixture
def saved(tmp_path):
    state = _state()
    path = tmp_path / "ck"
    fw.save(state, path, stripes=1)  # one stripe: "w" and "w2" can trade byte ranges
    return path, state


def _manifest(path) -> dict:
    return decode_manifest_json((path / fmt.MANIFEST_NAME).read_bytes())


def _write(path, m: dict, *, seal: bool) -> None:
    data = fmt.encode_manifest(m) if seal else json.dumps(m).encode()
    (path / fmt.MANIFEST_NAME).write_bytes(data)


def _refused(path, *needles, tensor=None):
    for call in (lambda: fw.load(path), lambda: fw.load(path, verify=False), lambda: fw.verify(path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        for needle in needles:
            assert needle in str(ei.value), (needle, str(ei.value))
        if tensor is not None:
            assert ei.value.tensor == tensor, ei.value
    return ei.value


def test_written_manifest_is_sealed_and_loads(saved):
    path, state = saved
    m = _manifest(path)
    assert m["format_version"] == fmt.FORMAT_VERSION >= fmt.SEALED_SINCE
    assert m[fmt.SEAL_FIELD]["algorithm"] == "sha256" and len(m[fmt.SEAL_FIELD]["digest"]) == 64
    assert_same(fw.load(path), state)


def test_respelled_manifest_still_loads(saved):
    """The checksum covers content, not spelling: re-indented JSON with keys in another
    order is the same manifest."""
    path, state = saved
    m = json.loads((path / fmt.MANIFEST_NAME).read_bytes())  # as on disk (packed)
    (path / fmt.MANIFEST_NAME).write_text(json.dumps(dict(reversed(list(m.items()))), indent=3, sort_keys=False))
    assert_same(fw.load(path), state)


@pytest.mark.parametrize("edit", [
    # The two edits of issue 13 that loaded as a different state with no error:
    "u8-dtype-to-bits8", "tree-key-to-another-tensor",
    "step-counter", "created-time", "metadata", "writer-version", "int-to-float", "alias-added",
    "seal-removed", "seal-digest-zeroed",
])
def test_any_edit_of_a_sealed_manifest_is_refused(saved, edit):
    path, _ = saved
    m = _manifest(path)
    if edit == "u8-dtype-to-bits8":
        m["tensors"]["u8"]["dtype"] = "bits8"
    elif edit == "tree-key-to-another-tensor":
        items = m["tree"]["items"]
        keys = [it[1]["k"] for it in items if it[1].get("t") == "tensor"]
        for it in items:
            if it[1].get("t") == "tensor" and it[1]["k"] == "u8":
                it[1]["k"] = next(k for k in keys if k != "u8")
    elif edit == "step-counter":
        m["tree"]["items"][-1][1]["items"][0][1]["v"] = 8
    elif edit == "created-time":
        m["created_unix"] += 1
    elif edit == "metadata":
        m["metadata"]["x"] = "y"
    elif edit == "writer-version":
        m["writer_version"] = "9.9.9"
    elif edit == "int-to-float":
        m["tensors"]["w"]["offset"] = float(m["tensors"]["w"]["offset"])
    elif edit == "alias-added":
        m["aliases"]["tied"] = "w"
    elif edit == "seal-removed":
        del m[fmt.SEAL_FIELD]
    elif edit == "seal-digest-zeroed":
        m[fmt.SEAL_FIELD]["digest"] = "0" * 64
    _write(path, m, seal=False)
    e = _refused(path, fmt.SEAL_FIELD if edit.startswith("seal-removed") else "checksum")
    assert e.file == fmt.MANIFEST_NAME


def test_version_downgrade_with_a_seal_is_refused(saved):
    """Dropping to format 1 (no checksum) cannot be used to skip the check while keeping the
    seal; and a format-1 manifest stripped of its seal falls back to the header cross-check."""
    path, _ = saved
    m = _manifest(path)
    m["format_version"] = 1
    _write(path, m, seal=False)
    _refused(path, fmt.SEAL_FIELD)


@pytest.mark.parametrize("field,edit", [
    ("dtype", lambda t: t.update(dtype="int32")),                      # F32 -> I32, same size
    ("dtype", lambda t: t.update(dtype="uint8", shape=[t["nbytes"]])),  # F32 -> U8 bytes of it
    ("shape", lambda t: t.update(shape=list(reversed(t["shape"])))),     # (4, 6) -> (6, 4)
    ("shape", lambda t: t.update(shape=[t["nbytes"] // 4])),             # flattened
    ("byte range", None),                                                # pointed at a neighbour's bytes
])
@pytest.mark.parametrize("seal", ["resealed", "format-1"])
def test_header_cross_check_names_what_disagrees(saved, field, edit, seal):
    """A manifest whose checksum is right (recomputed) or absent (format 1) but which
    disagrees with the stripe header on a tensor's dtype, shape or byte range is refused,
    naming the tensor and what disagrees."""
    path, _ = saved
    m = _manifest(path)
    t = m["tensors"]["w"]
    if edit is not None:
        edit(t)
    else:  # "w" pointed at the bytes of "w2" (same dtype and shape) and back
        t["offset"], m["tensors"]["w2"]["offset"] = m["tensors"]["w2"]["offset"], t["offset"]
    if seal == "format-1":
        m["format_version"] = 1
        del m[fmt.SEAL_FIELD]
        _write(path, m, seal=False)
    else:
        _write(path, m, seal=True)
    _refused(path)  # with verify=True the data checksums may object first (a swapped range)
    # verify=False reads no data checksums: only the header cross-check stands in the way.
    with pytest.raises(CorruptCheckpointError, match=field) as ei:
        fw.load(path, verify=False)
    assert ei.value.tensor in ("w", "w2") and f"'{ei.value.tensor}'" in str(ei.value), ei.value


@pytest.mark.parametrize("version", [v for v in fmt.READABLE_VERSIONS if v < fmt.SEALED_SINCE])
def test_unsealed_earlier_versions_still_load(saved, tmp_path, version):
    """What the writers before the checksum produced (the same files, no seal): loads."""
    path, state = saved
    old = shutil.copytree(path, tmp_path / f"v{version}")
    m = _manifest(old)
    del m[fmt.SEAL_FIELD]
    m["format_version"] = version
    (old / fmt.MANIFEST_NAME).write_text(json.dumps(m, separators=(",", ":")))
    assert_same(fw.load(old), state)
    fw.verify(old)


@pytest.mark.parametrize("fixture", [d for d in sorted(glob.glob(os.path.join(DATA, "v1-*"))) if os.path.isdir(d)]
                         or ["none"])
def test_format_1_fixtures_still_load(fixture):
    """Any format-1 checkpoint kept under tests/data/ (written by the format-1 writer)."""
    if fixture == "none" or not os.path.isdir(fixture):
        pytest.skip("no format-1 fixture under tests/data/")
    with open(os.path.join(fixture, fmt.MANIFEST_NAME)) as fh:
        assert json.load(fh)["format_version"] == 1
    loaded = fw.load(fixture)
    twin = fixture + ".expected.pt"
    if os.path.exists(twin):
        assert_same(loaded, torch.load(twin, weights_only=True))


# ------------------------------------------------------------------ format 4: the packed table

def _raw(path) -> dict:
    return json.loads((path / fmt.MANIFEST_NAME).read_bytes())


def _write_raw(path, raw: dict) -> None:
    """Write the on-disk (packed) form, resealed: the packed-table checks must refuse it."""
    body = {k: v for k, v in raw.items() if k != fmt.SEAL_FIELD}
    body[fmt.SEAL_FIELD] = {"algorithm": "sha256", "digest": fmt.content_digest(body)}
    (path / fmt.MANIFEST_NAME).write_text(json.dumps(body))


def test_manifest_is_packed_and_tools_read_it(saved):
    path, state = saved
    raw = _raw(path)
    assert raw["format_version"] == fmt.FORMAT_VERSION == 4
    assert "tensors" not in raw and "tree" not in raw and raw["packed"]["count"] == 6
    logical = _manifest(path)
    assert set(logical["tensors"]) == {"w", "w2", "u8", "i32", "b8", "c64"}
    assert logical["tensors"]["w"]["checksums"] == list(fmt.read_manifest(path).tensors["w"].checksums)
    # A plain (unpacked) version-4 manifest with a valid seal is the same manifest.
    _write(path, {k: v for k, v in logical.items() if k != fmt.SEAL_FIELD}, seal=True)
    assert "packed" in _raw(path)  # encode_manifest packs it again
    assert_same(fw.load(path), state)


def _bomb(raw: dict) -> None:
    big = json.dumps({"keys": ["x" * 10] * 2_000_000}).encode()  # 26 MB of JSON in a few KB
    raw["packed"]["data"] = base64.b64encode(zlib.compress(big, 9)).decode()


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r["packed"].update(encoding="gzip"), "encoding must be"),
    (lambda r: r["packed"].update(data="not base64!"), "does not decode"),
    (lambda r: r["packed"].update(data=base64.b64encode(b"not zlib").decode()), "does not decode"),
    (lambda r: r["packed"].update(bytes=r["packed"]["bytes"] - 1), "decodes to"),
    (lambda r: r["packed"].update(bytes=r["packed"]["bytes"] + 1), "decodes to"),
    (lambda r: r["packed"].update(bytes=2**40), "bytes must be an integer"),
    (lambda r: r["packed"].update(count=r["packed"]["count"] + 1), "keys must be a list of count names"),
    (lambda r: r.update(format_version=3), "has no packed table"),
    (_bomb, "decodes to"),
])
def test_damaged_packed_table_is_refused(saved, edit, needle):
    path, _ = saved
    raw = _raw(path)
    edit(raw)
    _write_raw(path, raw)
    _refused(path, needle)


def test_packed_table_bomb_is_refused_in_small_memory(saved):
    """A table that inflates to far more than it declares (256 MiB of zlib'd spaces in
    half a megabyte) is refused after reading at most what it declares: peak memory stays
    small. Checking the size after inflating it all would pass the other bomb test."""
    import tracemalloc

    path, _ = saved
    raw = _raw(path)
    z = zlib.compressobj(9)
    chunk = b" " * (1 << 20)
    data = b"".join(z.compress(chunk) for _ in range(256)) + z.flush()
    raw["packed"]["data"] = base64.b64encode(data).decode()   # "bytes" still says the real, small size
    _write_raw(path, raw)
    tracemalloc.start()
    try:
        _refused(path, "decodes to")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"refusing the bomb took {peak >> 20} MiB"


def _repack(path, mutate) -> None:
    """Unpack, change the columns, pack again (resealed)."""
    raw = _raw(path)
    body = json.loads(zlib.decompress(base64.b64decode(raw["packed"]["data"])))
    mutate(body)
    js = json.dumps(body).encode()
    raw["packed"].update(bytes=len(js), data=base64.b64encode(zlib.compress(js)).decode(), count=len(body["keys"]))
    _write_raw(path, raw)


@pytest.mark.parametrize("mutate, needle", [
    (lambda b: b["offset"].pop(), "column offset must be a list"),
    (lambda b: b.update(checksums=b["checksums"][:-1]), "packed checksums"),
    (lambda b: b.update(checksums=b["checksums"][:-16] + "g" * 16), "packed checksums"),
    (lambda b: b["keys"].__setitem__(1, b["keys"][0]), "listed twice"),
    (lambda b: b["shape"].__setitem__(0, [True]), "shape"),
    (lambda b: b["dtype"].__setitem__(0, 7), "not a dtype name"),
    (lambda b: b["file"].__setitem__(0, 5), "file must be an integer"),
    (lambda b: b["offset"].__setitem__(0, b["offset"][1]), "overlap"),
])
def test_hostile_packed_columns_are_refused(saved, mutate, needle):
    path, _ = saved
    _repack(path, mutate)
    _refused(path, needle)


def test_many_tensors_cost_little_manifest(tmp_path):
    """Issue 14: manifest + index at most 100 bytes per tensor for 20,000 small tensors."""
    state = {"layers": {f"l{j}": {f"p{i}": torch.full((256,), float(i + j)) for i in range(8)}
                        for j in range(2500)}}
    fw.save(state, tmp_path / "ck")
    size = sum(os.path.getsize(tmp_path / "ck" / n) for n in (fmt.MANIFEST_NAME, fmt.INDEX_NAME))
    assert size / 20000 <= 100, size / 20000
    loaded = fw.load(tmp_path / "ck")
    assert torch.equal(loaded["layers"]["l2499"]["p7"], state["layers"]["l2499"]["p7"])
