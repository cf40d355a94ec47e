"""Saves and loads pause the cyclic garbage collector around per-tensor work
(flashwrite/gcpause.py). One that raises must leave it as it found it: a collector left
off makes every later allocation of the training process leak its cycles."""
import gc
import json
import os

import pytest
import torch

import flashwrite as fw
from fault_util import flip_byte
from flashwrite.errors import CorruptCheckpointError
from flashwrite.format import MANIFEST_NAME


def _stripe(path):
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0])


def _failing_calls(tmp_path):
    good = str(tmp_path / "good")
    fw.save({"w": torch.arange(1 << 16, dtype=torch.float32), "objs": {"k": [1, 2]}, "n": 3}, good)
    corrupt = str(tmp_path / "corrupt")
    fw.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, corrupt)
    flip_byte(_stripe(corrupt), os.path.getsize(_stripe(corrupt)) - 5)
    bad_manifest = str(tmp_path / "bad-manifest")
    fw.save({"w": torch.ones(8)}, bad_manifest)
    with open(os.path.join(bad_manifest, MANIFEST_NAME), "r+b") as f:
        raw = json.loads(f.read())
        raw["format_version"] = 10 ** 9
        f.seek(0)
        f.truncate()
        f.write(json.dumps(raw).encode())
    return {
        "save: a sparse tensor": (lambda: fw.save({"s": torch.eye(3).to_sparse()}, str(tmp_path / "s")), TypeError),
        "save: the target exists": (lambda: fw.save({"w": torch.ones(2)}, good), FileExistsError),
        "save_async: a sparse tensor": (
            lambda: fw.save_async({"s": torch.eye(3).to_sparse()}, str(tmp_path / "s2")).result(), TypeError),
        "load: a flipped byte": (lambda: fw.load(corrupt), CorruptCheckpointError),
        "load: a manifest from the future": (lambda: fw.load(bad_manifest), CorruptCheckpointError),
        "load: into a tensor of another shape": (
            lambda: fw.load(good, into={"w": torch.empty(3)}, strict=False), (ValueError, RuntimeError)),
        "load: no such checkpoint": (lambda: fw.load(str(tmp_path / "missing")), FileNotFoundError),
        "verify: a flipped byte": (lambda: fw.verify(corrupt), CorruptCheckpointError),
    }


@pytest.mark.parametrize("gc_on", [True, False], ids=["gc-enabled", "gc-disabled"])
def test_collector_state_survives_failing_calls(tmp_path, gc_on):
    calls = _failing_calls(tmp_path)
    was = gc.isenabled()
    try:
        (gc.enable if gc_on else gc.disable)()
        for what, (call, exc) in calls.items():
            with pytest.raises(exc):
                call()
            assert gc.isenabled() is gc_on, f"{what}: the collector was left {'off' if gc_on else 'on'}"
    finally:
        (gc.enable if was else gc.disable)()
