"""The flashwrite command, at toy sizes (a few seconds each). The benchmark harness it
once carried is tested in tests/benchmarks/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import flashwrite as fw
from flashwrite.ops import devicelimit
from flashwrite.ops.main import MOVED, main
from flashwrite.ops.synthetic import make_state, planned_bytes, state_bytes
from flashwrite.system.sizes import fmt_bytes, parse_size

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


COLUMNS = ["stall_s", "durable_s", "gbps", "vs_device", "cpu_s_per_gib", "rss_growth", "load_s", "load_vs_device"]


def cli(*args: str, cwd: str | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashwrite", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=None if env is None else {**os.environ, **env})


def test_parse_size():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_fmt_bytes_is_parse_size_backwards():
    assert [fmt_bytes(n) for n in (None, 0, 1023, 1024, 3 << 29, 2 << 30, 5 << 40)] == \
        ["-", "0 B", "1023 B", "1 KiB", "1.50 GiB", "2 GiB", "5 TiB"]
    for text in ("64 MiB", "1.50 GiB", "3 KiB"):
        assert fmt_bytes(parse_size(text.replace(" ", ""))) == text


def test_synthetic_state_is_a_training_state():
    st = make_state(8 << 20)
    assert state_bytes(st) == planned_bytes(8 << 20)
    assert abs(state_bytes(st) - (8 << 20)) < (1 << 20)
    params = st["model"]
    assert len(st["optim"]["state"]) == len(params)
    assert st["optim"]["state"][0]["exp_avg"].shape == next(iter(params.values())).shape
    assert st["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert isinstance(st["step"], int)
    assert all(t.abs().sum() > 0 for t in params.values())  # no zero pages to shortcut


def test_probe_device_limit_without_fio(tmp_path):
    d = devicelimit.probe_write_read(str(tmp_path), 4 << 20, block=1 << 20, depth=2)
    assert d["write_s"] > 0 and d["read_s"] > 0 and "probe" in d["tool"]
    assert os.listdir(tmp_path) == []


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backend"] in ("io_uring", "threads")
    assert "direct_io" in info


def test_demo_prints_the_side_by_side_table(tmp_path):
    p = cli("demo", "--size", "16MiB", "--dir", str(tmp_path), "--plain", "-q")
    assert p.returncode == 0, p.stdout + p.stderr
    for text in ("torch.save + fsync", "flashwrite", "device limit", "stall s", "durable s", "cold load s"):
        assert text in p.stdout
    assert os.listdir(tmp_path) == []  # its temporary folder is gone


def test_demo_writes_json_and_exits_1_when_a_load_comes_back_wrong(tmp_path, capsys, monkeypatch):
    from flashwrite.ops import demo
    out = tmp_path / "demo.json"
    assert main(["demo", "--size", "4MiB", "--dir", str(tmp_path), "--plain", "-q", "--device-tool", "probe",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {r["key"]: r["load_check"] for r in res["rows"]} == {"torch_save": "ok", "flashwrite": "ok"}
    assert res["device"]["write_s"] > 0 and res["memcpy"]["stall_s"] > 0
    assert "In short: with flashwrite" in capsys.readouterr().out
    # A load that returns other bytes is an error of the command, not a row that looks fine.
    name, label, save, _, warm = demo.CONTENDERS["flashwrite"]
    monkeypatch.setitem(demo.CONTENDERS, "flashwrite", (name, label, save, lambda p: {"x": torch.zeros(3)}, warm))
    assert main(["demo", "--size", "4MiB", "--dir", str(tmp_path), "--plain", "-q", "--device-tool", "probe"]) == 1
    cap = capsys.readouterr()
    assert "LOAD CHECK FAILED" in cap.out and "error: flashwrite: load check failed: loaded 12 tensor bytes" in cap.err


def test_demo_imports_no_peer_and_no_harness():
    """The demo, in the wheel, runs torch.save and flashwrite only: none of the peers
    benchmarks/compare.py measures is imported (nor the harness: it is not in the wheel)."""
    code = ("import sys, flashwrite.ops.main, flashwrite.ops.demo\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('safetensors', 'deepspeed', 'torch_checkpointing', 'harness', 'matplotlib')"
            " or m.startswith('torch.distributed.checkpoint'))\n"
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("command", ["bench", "overhead"])
def test_bench_and_overhead_name_the_checkout_script_that_replaced_them(command, tmp_path, capsys):
    args = ["--size", "2GiB", "--rounds", "3", "--contenders", "torch_save,flashwrite", "--dir", str(tmp_path / "d x"),
            "--plain", "-q", "--json", "OUT"] if command == "bench" else ["--steps", "4", "--plain"]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    script = MOVED[command]
    assert f"python {script} {' '.join(args[:4])}" in err, err  # the same arguments, ready to paste
    if command == "bench":
        assert f"--dir '{tmp_path / 'd x'}' --plain -q --json OUT" in err, err
    assert os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(_TESTS_FILE))), script))
    assert not os.listdir(tmp_path)  # nothing was made, nothing was run


def test_verify_ok_and_corrupt(tmp_path, capsys):
    good = tmp_path / "good"
    fw.save({"w": torch.arange(100_000, dtype=torch.float32)}, good)
    assert main(["verify", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    stripe = next(f for f in os.listdir(good) if f.endswith(".safetensors") and "index" not in f)
    with open(good / stripe, "r+b") as f:
        f.seek(os.path.getsize(good / stripe) - 100)
        f.write(b"\xff" * 8)
    assert main(["verify", str(good)]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and stripe in err


class _Progress:
    def __init__(self):
        self.calls = []

    def start(self, total, what):
        self.calls.append(("start", total, what))

    def advance(self, n):
        self.calls.append(("advance", n))

    def finish(self):
        self.calls.append(("finish",))


def test_verify_checks_stripe_by_stripe_and_names_the_damaged_one(tmp_path):
    path = tmp_path / "ck"
    with fw.Writer(stripes=3) as w:
        w.save({f"t{i}": torch.arange(50_000, dtype=torch.float32) + i for i in range(6)}, path)
    stripes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    sizes = [os.path.getsize(path / f) for f in stripes]
    assert len(stripes) == 3
    p = _Progress()
    summary = fw.verify(path, progress=p)
    assert summary["files"] == 3 and summary["bytes"] == sum(sizes) and summary["tensors"] == 6
    assert p.calls[0] == ("start", sum(sizes), "verify ck") and p.calls[-1] == ("finish",)
    assert sorted(c[1] for c in p.calls[1:-1]) == sorted(sizes)  # one advance per stripe
    with open(path / stripes[2], "r+b") as f:  # the last stripe damaged: the first two pass, then it fails
        f.seek(sizes[2] - 100)
        f.write(b"\xff" * 8)
    p = _Progress()
    with pytest.raises(fw.ChecksumMismatchError) as e:
        fw.verify(path, progress=p)
    assert e.value.file == stripes[2]
    assert [c[0] for c in p.calls] == ["start", "advance", "advance", "finish"]


def test_one_version_readable_everywhere():
    """pyproject's version is the one: the installed metadata, the module, the native core
    and the command all say it (``flashwrite --version`` and ``python -m flashwrite --version``)."""
    from importlib.metadata import version

    import flashwrite._core as core
    assert fw.__version__ == version("flashwrite") == core.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", fw.__version__)
    for mod in ("flashwrite", "flashwrite.ops.main"):
        r = subprocess.run([sys.executable, "-m", mod, "--version"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"flashwrite {fw.__version__}"


def test_python_dash_m_flashwrite_is_the_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashwrite", "info", "--json", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["backend"] in ("io_uring", "threads")
    r = subprocess.run([sys.executable, "-m", "flashwrite", "no-such-command"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr
