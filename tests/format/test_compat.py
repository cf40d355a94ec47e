"""Checkpoints written by earlier format versions keep loading (fixtures under tests/data/).

Each fixture directory was written by the flashwrite of its format version; the
``.expected.pt`` beside it is the same state written by ``torch.save`` at that time.
"""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite.format import decode_manifest_json
import os

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


DATA = Path(_TESTS_FILE).parent / "data"
FIXTURES = sorted(p for p in DATA.iterdir() if p.is_dir())


def test_fixtures_exist():
    versions = {decode_manifest_json((p / "flashwrite.json").read_text())["format_version"] for p in FIXTURES}
    assert {1, 2, 3} <= versions


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_old_checkpoint_loads_byte_exact(fixture, tmp_path):
    copy = tmp_path / fixture.name  # a copy: O_DIRECT and the load's pinning must not depend on the repo's fs
    shutil.copytree(fixture, copy)
    expected = torch.load(fixture.with_name(fixture.name + ".expected.pt"), weights_only=True)
    loaded = fw.load(copy)
    assert_same(loaded, expected)
    assert fw.verify(copy)["tensors"] >= 1
    if "slice" in expected:  # from format 2 on, views of one storage come back sharing it
        ptr = loaded["full"].untyped_storage().data_ptr()
        assert loaded["slice"].untyped_storage().data_ptr() == ptr == loaded["t"].untyped_storage().data_ptr()
        assert loaded["t"].stride() == expected["t"].stride()
        assert loaded["model"]["w"].requires_grad and not loaded["model"]["frozen"].requires_grad
