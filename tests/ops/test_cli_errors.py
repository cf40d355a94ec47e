"""Every error path of the ``flashwrite`` command, one row each, run as a user runs it
(the command's main() in a child process, as ``python -m flashwrite ...`` runs it): no traceback, the exit code the
command documents, and a message that names the path (or the bad value) and says
what to do.

BAD_INPUT: what the operator got wrong (a path that is not there or is not what the
command takes, a bad option or pattern, a URL the command does not take): exit 2.
PROBLEMS: the input is what the command takes but something is wrong with it (a
damaged checkpoint, an incomplete one, a pickle refused): exit 1."""

from __future__ import annotations

import json
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
    ("info-bad-nfs-url", ["info", "nfs://host"], ["nfs://host", "expected nfs://HOST"]),
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
    ("bench-moved", ["bench", "--contenders", "nope", "--dir", "{tmp}"],
     ["python benchmarks/compare.py --contenders nope --dir {tmp}", "source checkout"]),
    ("overhead-moved", ["overhead", "--steps", "4"], ["python benchmarks/overhead.py --steps 4", "source checkout"]),
    ("unknown-command", ["frobnicate"], ["frobnicate", "choose from"]),
    ("no-command", [], ["COMMAND", "usage:"]),
]

PROBLEMS = [
    ("verify-damaged", ["verify", "{damaged}"], ["{damaged}", "FAILED", "checksum"]),
    ("verify-no-manifest", ["verify", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("inspect-no-manifest", ["inspect", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("diff-no-manifest", ["diff", "{ck}", "{emptydir}"], ["{emptydir}", "flashwrite ls"]),
    ("convert-damaged", ["convert", "{damaged}", "{tmp}/x.safetensors"], ["{damaged}", "checksum"]),
    ("info-nfs-host-unknown", ["info", "nfs://nonexistent.invalid/export/x"], ["nonexistent.invalid", "does not resolve"]),
    ("convert-refused-pickle", ["convert", "{unsafe}", "{out}"], ["{unsafe}", "--allow-pickle", "Linear"]),
]


# One child process runs every row, as ``python -m flashwrite`` runs one: the command's
# main() with stdout/stderr of its own, its exit code from its return or SystemExit, and
# anything that escapes it printed as the interpreter would (a traceback). One process
# instead of 43 that each import torch: seconds, not minutes.
_RUNNER = """
import contextlib, io, json, sys, traceback
from flashwrite.ops.main import main
out = []
for argv in json.loads(sys.stdin.read()):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            rc = main(argv)
        except SystemExit as x:
            rc = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
    out.append({"rc": rc, "stdout": o.getvalue(), "stderr": e.getvalue()})
print(json.dumps(out))
"""


def _argv(inputs: dict[str, str], argv: list[str]) -> list[str]:
    args = [a.format(**inputs) for a in argv]
    return args + (["-q"] if args[:1] == ["convert"] else [])


@pytest.fixture(scope="module")
def results(inputs) -> dict[str, dict]:
    rows = BAD_INPUT + PROBLEMS
    r = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([_argv(inputs, row[1]) for row in rows]),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {row[0]: res for row, res in zip(rows, json.loads(r.stdout.strip().splitlines()[-1]))}


def _check(inputs: dict[str, str], r: dict, needles: list[str], rc: int) -> None:
    err = r["stderr"]
    assert "Traceback" not in err + r["stdout"], err
    assert r["rc"] == rc, (r["rc"], err)
    for n in needles:
        assert n.format(**inputs) in err, (n.format(**inputs), err)
    assert not os.path.exists(inputs["out"]), "a refused command wrote its output"


@pytest.mark.parametrize("row", [c[0] for c in BAD_INPUT])
def test_bad_input_is_a_usage_error_that_says_what_to_do(inputs, results, row):
    needles = next(c[2] for c in BAD_INPUT if c[0] == row)
    _check(inputs, results[row], needles, 2)


@pytest.mark.parametrize("row", [c[0] for c in PROBLEMS])
def test_a_problem_with_the_input_is_reported_not_dumped(inputs, results, row):
    needles = next(c[2] for c in PROBLEMS if c[0] == row)
    _check(inputs, results[row], needles, 1)


def test_the_command_as_users_run_it_exits_2_without_a_traceback(inputs):
    """The runner above calls main() in one process; once, the real thing: ``python -m flashwrite``."""
    r = subprocess.run([sys.executable, "-m", "flashwrite", "verify", inputs["missing"]], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr and inputs["missing"] in r.stderr, r.stderr
