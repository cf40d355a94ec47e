import json
import os

import pytest

from ops_helpers import run, save

from flashwrite import format as fmt
from flashwrite.format import decode_manifest_json


@pytest.fixture
def ck(tmp_path):
    return save(str(tmp_path / "ck"), metadata={"run": "r1"}, stripes=2)


def test_inspect_json_has_the_tree_totals_and_writer(capsys, ck):
    rc, out, _ = run(capsys, "inspect", ck, "--json")
    assert rc == 0
    r = json.loads(out)
    keys = {t["key"]: t for t in r["tensors"]}
    assert keys["model.w"]["dtype"] == "float32" and keys["model.w"]["shape"] == [64, 32]
    assert keys["model.c"]["dtype"] == "complex64" and keys["model.b"]["bytes"] == 64
    assert r["aliases"] == {"tied": "model.w"}
    assert r["by_top_level"]["model"]["tensors"] == 5
    assert r["by_dtype"]["float32"]["bytes"] == 64 * 32 * 4
    assert r["totals"]["bytes"] == sum(t["bytes"] for t in r["tensors"])
    assert r["settings"]["stripes"] == 2 == len(r["stripes"])
    assert r["metadata"] == {"run": "r1"} and r["format_version"] == fmt.FORMAT_VERSION and r["writer_version"]
    assert r["leaves"]["optim.step"] == 7 and r["leaves"]["optim.betas.1"] == 0.99


def test_inspect_table_and_filters(capsys, ck):
    rc, out, _ = run(capsys, "inspect", ck)
    assert rc == 0 and "model.w" in out and "64x32" in out and "complex64" in out
    for pattern, want in (("*.w", {"model.w"}), ("model.b", {"model.b"}), ("re:^model\\.(i|c)$", {"model.i", "model.c"})):
        r = json.loads(run(capsys, "inspect", ck, "--tensors", pattern, "--json")[1])
        assert {t["key"] for t in r["tensors"]} == want
    rc, _, err = run(capsys, "inspect", ck, "--tensors", "nothing-like-this")
    assert rc == 1 and "nothing matches" in err


@pytest.mark.parametrize("edit", [
    lambda m: m.update(format_version=99),
    lambda m: m["files"][0].update(name="../../etc/passwd"),
    lambda m: m["tensors"]["model.w"].update(offset=1 << 60),
    lambda m: m["tensors"]["model.w"].update(shape=[10 ** 12]),
    lambda m: m.update(tensors=[]),
    lambda m: m.update(tree={"t": "dict", "items": [[{"t": "str", "v": "x"}, {"t": "pickle", "v": "gARLAS4="}]]}),
])
def test_inspect_hostile_manifests_fail_cleanly(capsys, ck, edit):
    p = os.path.join(ck, "flashwrite.json")
    with open(p) as fh:
        m = decode_manifest_json(fh.read())
    edit(m)
    with open(p, "wb") as fh:
        fh.write(fmt.encode_manifest(m))  # sealed: the check each edit aims at must refuse it
    rc, out, err = run(capsys, "inspect", ck)
    if m.get("tree", {}).get("items", [[None, {}]])[0][1].get("t") == "pickle":
        assert rc == 0 and "pickled object" in out  # shown, never unpickled
    else:
        assert rc == 1 and err.startswith("flashwrite inspect:")


def test_inspect_missing_and_not_a_checkpoint(capsys, tmp_path):
    assert run(capsys, "inspect", tmp_path / "nope")[0] == 2  # not there: a usage error
    rc, _, err = run(capsys, "inspect", tmp_path)
    assert rc == 1 and "missing" in err
    assert run(capsys, "inspect")[0] == 2


def test_inspect_permission_error_is_a_message(capsys, ck, monkeypatch):
    real = os.open

    def deny(path, *a, **k):
        if str(path).endswith("flashwrite.json"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", deny)
    rc, _, err = run(capsys, "inspect", ck)
    assert rc == 1 and "Permission denied" in err
