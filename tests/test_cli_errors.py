"""Every error path of the ``flashwrite`` command, one row each, run as a user runs it
(``python -m flashwrite ...`` in a subprocess): no traceback, the exit code the
command documents, and a message that names the path (or the bad value) and says
what to do.

BAD_INPUT: what the operator got wrong (a path that is not there or is not what the
command takes, a bad option or pattern, a URL the command does not take): exit 2.
PROBLEMS: the input is what the command takes but something is wrong with it (a
damaged checkpoint, an incomplete one, a pickle refused): exit 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import flashwrite as fw
from ops_helpers import save, state


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("inputs")
    p = {k: str(d / k) for k in ("missing", "notes", "out", "emptydir", "ck", "damaged", "mgr", "unsafe")}
    p["pt"], p["st"], p["tmp"] = str(d / "t.pt"), str(d / "w.safetensors"), str(d)
    save(p["ck"])
    save(p["damaged"], stripes=1)
    stripe = next(n for n in sorted(os.listdir(p["damaged"])) if n.endswith(".safetensors"))
    with open(os.path.join(p["damaged"], stripe), "r+b") as fh:  # the last byte: tensor data
        fh.seek(-1, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    torch.save(state(), p["pt"])
    torch.save({"w": torch.ones(2), "obj": torch.nn.Linear(2, 2)}, str(d / "unsafe.pt"))  # a module: pickled code
    p["unsafe"] = str(d / "unsafe.pt")
    safetensors.torch.save_file({"w": torch.ones(2)}, p["st"])
    with open(p["notes"], "w") as fh:
        fh.write("some notes, not a checkpoint\n")
    os.mkdir(p["emptydir"])
    mgr = fw.CheckpointManager(p["mgr"])
    for step in (5, 10):
        mgr.save(step, {"w": torch.ones(2) * step})
    mgr.wait()
    return p


# (id, argv, what the message must hold: the path or bad value, and what to do)
BAD_INPUT = [
    ("verify-missing", ["verify", "{missing}"], ["{missing}", "check the path"]),
    ("verify-plain-file", ["verify", "{notes}"], ["{notes}", "is a file", "flashwrite.json"]),
    ("verify-torch-save", ["verify", "{pt}"], ["{pt}", "torch.load", "flashwrite convert"]),
    ("verify-safetensors", ["verify", "{st}"], ["{st}", "flashwrite.load reads it", "flashwrite convert"]),
    ("verify-manager-root", ["verify", "{mgr}"], ["{mgr}", "step-00000010", ".restore()"]),
    ("verify-other-scheme", ["verify", "s3://bucket/ck"], ["s3://bucket/ck", "nfs:// URLs"]),
    ("verify-bad-nfs-url", ["verify", "nfs://host"], ["nfs://host", "expected nfs://HOST"]),
    ("verify-no-path", ["verify"], ["path", "usage:"]),
    ("info-missing", ["info", "{missing}"], ["{missing}", "pass an existing directory"]),
    ("info-nfs", ["info", "nfs://127.0.0.1/export/x"], ["nfs://127.0.0.1/export/x", "flashwrite tune"]),
    ("info-other-scheme", ["info", "s3://bucket/x"], ["s3://bucket/x", "nfs:// URLs"]),
    ("ls-missing", ["ls", "{missing}"], ["{missing}", "check the path"]),
    ("ls-plain-file", ["ls", "{notes}"], ["{notes}", "pass a directory"]),
    ("ls-other-scheme", ["ls", "s3://bucket/x"], ["s3://bucket/x", "nfs:// URLs"]),
    ("inspect-missing", ["inspect", "{missing}"], ["{missing}", "check the path"]),
    ("inspect-torch-save", ["inspect", "{pt}"], ["{pt}", "torch.load", "flashwrite convert"]),
    ("inspect-manager-root", ["inspect", "{mgr}"], ["{mgr}", "step-00000010", ".restore()"]),
    ("inspect-bad-regex", ["inspect", "{ck}", "--tensors", "re:["], ["re:[", "a valid one"]),
    ("diff-missing", ["diff", "{ck}", "{missing}"], ["{missing}", "check the path"]),
    ("diff-torch-save", ["diff", "{ck}", "{pt}"], ["{pt}", "flashwrite convert"]),
    ("diff-bad-regex", ["diff", "{ck}", "{ck}", "--tensors", "re:("], ["re:(", "a valid one"]),
    ("convert-missing", ["convert", "{missing}", "{out}"], ["{missing}", "check the path"]),
    ("convert-plain-file", ["convert", "{notes}", "{out}"], ["{notes}", "--from"]),
    ("convert-empty-dir", ["convert", "{emptydir}", "{out}"], ["{emptydir}", "--from"]),
    ("convert-no-target-format", ["convert", "{ck}", "{out}"], ["{out}", "--to"]),
    ("convert-same-path", ["convert", "{pt}", "{pt}"], ["{pt}", "another destination"]),
    ("convert-bad-format", ["convert", "{ck}", "{out}", "--to", "zip"], ["zip", "choose from"]),
    ("convert-foreign-to-nfs", ["convert", "{pt}", "nfs://127.0.0.1/export/y.pt"],
     ["nfs://127.0.0.1/export/y.pt", "local (or mounted) path"]),
    ("convert-foreign-from-nfs", ["convert", "nfs://127.0.0.1/export/y.safetensors", "{out}", "--from", "safetensors"],
     ["nfs://127.0.0.1/export/y.safetensors", "local (or mounted) path"]),
    ("tune-missing", ["tune", "{missing}", "--budget-s", "1"], ["{missing}", "check the path"]),
    ("tune-plain-file", ["tune", "{notes}", "--budget-s", "1"], ["{notes}", "pass the directory"]),
    ("tune-zero-budget", ["tune", "{tmp}", "--budget-s", "0"], ["--budget-s", "positive"]),
    ("demo-dir-is-a-file", ["demo", "--dir", "{notes}"], ["{notes}", "pass a directory"]),
    ("demo-bad-size", ["demo", "--size", "lots", "--dir", "{tmp}"], ["lots", "--size"]),
    ("bench-unknown-contender", ["bench", "--contenders", "nope", "--dir", "{tmp}"], ["nope", "choose from"]),
    ("unknown-command", ["frobnicate"], ["frobnicate", "choose from"]),
    ("no-command", [], ["COMMAND", "usage:"]),
]

PROBLEMS = [
    ("verify-damaged", ["verify", "{damaged}"], ["{damaged}", "FAILED", "checksum"]),
    ("verify-no-manifest", ["verify", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("inspect-no-manifest", ["inspect", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("diff-no-manifest", ["diff", "{ck}", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("convert-damaged", ["convert", "{damaged}", "{tmp}/x.safetensors"], ["{damaged}", "checksum"]),
    ("convert-refused-pickle", ["convert", "{unsafe}", "{out}"], ["{unsafe}", "--allow-pickle", "Linear"]),
]


def _run(inputs: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess:
    args = [a.format(**inputs) for a in argv]
    return subprocess.run([sys.executable, "-m", "flashwrite", *args, *(["-q"] if args[:1] == ["convert"] else [])],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _check(inputs: dict[str, str], argv: list[str], needles: list[str], rc: int) -> None:
    r = _run(inputs, argv)
    err = r.stderr
    assert "Traceback" not in err + r.stdout, err
    assert r.returncode == rc, (r.returncode, err)
    for n in needles:
        assert n.format(**inputs) in err, (n.format(**inputs), err)
    assert not os.path.exists(inputs["out"]), "a refused command wrote its output"


@pytest.mark.parametrize("argv, needles", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_usage_error_that_says_what_to_do(inputs, argv, needles):
    _check(inputs, argv, needles, 2)


@pytest.mark.parametrize("argv, needles", [c[1:] for c in PROBLEMS], ids=[c[0] for c in PROBLEMS])
def test_a_problem_with_the_input_is_reported_not_dumped(inputs, argv, needles):
    _check(inputs, argv, needles, 1)
