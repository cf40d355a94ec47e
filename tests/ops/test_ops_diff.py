import json
import os

import torch

from ops_helpers import run, save, state

from flashwrite.format import decode_manifest_json


def _diff(capsys, *args):
    rc, out, err = run(capsys, "diff", *args, "--json")
    return rc, json.loads(out) if out else None


def test_identical_saves_are_identical(capsys, tmp_path):
    a, b = save(str(tmp_path / "a")), save(str(tmp_path / "b"))
    rc, r = _diff(capsys, a, b)
    assert rc == 0 and r["identical"] and r["same"] == 5
    rc, r = _diff(capsys, a, b, "--deep")
    assert rc == 0 and r["identical"]


def test_changes_are_named(capsys, tmp_path):
    a = save(str(tmp_path / "a"))
    sd = state()
    sd["model"]["b"] = sd["model"]["b"] + 1                 # content
    sd["model"]["i"] = sd["model"]["i"].to(torch.int32)     # dtype
    del sd["model"]["c"]                                     # removed
    sd["model"]["new"] = torch.ones(2)                       # added
    sd["optim"]["step"] = 8                                  # leaf
    b = save(str(tmp_path / "b"), sd)
    for deep in ((), ("--deep",)):
        rc, r = _diff(capsys, a, b, *deep)
        assert rc == 1 and not r["identical"]
        assert r["changed_content"] == ["model.b"] and [c["key"] for c in r["changed_meta"]] == ["model.i"]
        assert r["removed"] == ["model.c"] and r["added"] == ["model.new"]
        assert [(x["path"], x["a"], x["b"]) for x in r["leaves"]] == [("optim.step", 7, 8)]
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 1 and "model.b" in out and "checksums differ" in out


def test_only_bytes_differ(capsys, tmp_path):
    """Same keys, dtypes, shapes and leaves: only one tensor's bytes differ. That alone
    makes the two checkpoints different (rc 1), with and without --deep."""
    a = save(str(tmp_path / "a"))
    sd = state()
    sd["model"]["b"][0] += 1
    b = save(str(tmp_path / "b"), sd)
    for deep in ((), ("--deep",)):
        rc, r = _diff(capsys, a, b, *deep)
        assert (rc, r["identical"], r["changed_content"]) == (1, False, ["model.b"]), (deep, r)
        assert not (r["added"] or r["removed"] or r["changed_meta"] or r["unknown"] or r["leaves"])


def test_frozen_part_did_not_move(capsys, tmp_path):
    a = save(str(tmp_path / "a"))
    sd = state()
    sd["model"]["b"] += 1
    b = save(str(tmp_path / "b"), sd)
    rc, r = _diff(capsys, a, b, "--tensors", "model.w")
    assert rc == 0 and r["identical"]


def test_different_layouts_need_deep(capsys, tmp_path):
    # "a" shifts "x" within its stripe when both share one: pieces are then cut elsewhere.
    big = {"a": torch.randn(10), "x": torch.randn(3 << 20), "y": torch.randn(5 << 20)}
    a = save(str(tmp_path / "a"), big, stripes=1, chunk_bytes=1 << 20)
    b = save(str(tmp_path / "b"), big, stripes=3, chunk_bytes=1 << 20)
    rc, r = _diff(capsys, a, b)
    # Issue 44 item 4: nothing differs, some tensors cannot be compared by checksums:
    # undetermined, with an exit code of its own (it said "different" and exited 1).
    assert rc == 3 and r["unknown"] and r["undetermined"] and not r["identical"] and not r["changed_content"]
    rc, out, _ = run(capsys, "diff", a, b)
    assert rc == 3 and f"undetermined: {len(r['unknown'])} laid out differently (use --deep)" in out, out
    assert "different" not in out.replace("laid out differently", ""), out
    rc, r = _diff(capsys, a, b, "--deep")
    assert rc == 0 and r["identical"]
    # With a real difference beside them it is "different" (1).
    big["a"] = torch.randn(11)
    c = save(str(tmp_path / "c"), big, stripes=3, chunk_bytes=1 << 20)
    rc, r = _diff(capsys, a, c)
    assert rc == 1 and r["unknown"] and not r["undetermined"]


def test_deep_notices_a_flip_the_manifest_hides(capsys, tmp_path):
    a, b = save(str(tmp_path / "a")), save(str(tmp_path / "b"))
    with open(os.path.join(b, "flashwrite.json")) as fh:
        m = decode_manifest_json(fh.read())
    e = m["tensors"]["model.w"]
    path = os.path.join(b, m["files"][e["file"]]["name"])
    with open(path, "r+b") as f:
        f.seek(e["offset"])
        byte = f.read(1)
        f.seek(e["offset"])
        f.write(bytes([byte[0] ^ 1]))
    assert _diff(capsys, a, b)[0] == 0           # by stored checksums: the same
    rc, r = _diff(capsys, a, b, "--deep")
    assert rc == 1 and r["changed_content"] == ["model.w"]


def test_diff_bad_inputs(capsys, tmp_path):
    a = save(str(tmp_path / "a"))
    assert run(capsys, "diff", a, tmp_path / "missing")[0] == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "flashwrite.json").write_text("{")
    rc, _, err = run(capsys, "diff", a, tmp_path / "bad")
    assert rc == 1 and "not valid JSON" in err
    assert run(capsys, "diff", a)[0] == 2
