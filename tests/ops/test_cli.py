"""The flashwrite command and the benchmark runner, at toy sizes (a few seconds each)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import flashwrite as fw
from flashwrite.bench import devicelimit, overhead, report, runner
from flashwrite.ops.main import main
from flashwrite.bench.state import make_state, planned_bytes, state_bytes
from flashwrite.system.sizes import fmt_bytes, parse_size

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


COLUMNS = ["stall_s", "durable_s", "gbps", "vs_device", "cpu_s_per_gib", "rss_growth", "load_s", "load_vs_device"]


def cli(*args: str, cwd: str | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashwrite", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=None if env is None else {**os.environ, **env})


# The peer adapters of this checkout, named as a user of an installed flashwrite would (a
# library never runs a peers.py it finds in the current directory).
PEERS = {"FLASHWRITE_PEERS_FILE": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(_TESTS_FILE))),
                                               "benchmarks", "peers.py")}


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


def test_bench_writes_json_with_every_column(tmp_path):
    out, png = tmp_path / "res.json", tmp_path / "res.png"
    p = cli("bench", "--size", "16MiB", "--contenders", "torch_save,deepspeed,flashwrite", "--dir", str(tmp_path),
            "--json", str(out), "--plot", str(png), "--device-tool", "probe", "--plain", "-q", env=PEERS)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())["comparison"]
    assert res["device"]["write_s"] > 0 and res["device"]["read_s"] > 0 and "probe" in res["device"]["tool"]
    assert res["memcpy"]["stall_s"] > 0
    rows = {r["key"]: r for r in res["rows"]}
    for key in ("torch_save", "flashwrite"):
        assert rows[key]["status"] == "ok", rows[key]
        for c in COLUMNS:
            assert rows[key][c] is not None, (key, c)
        assert rows[key]["load_check"] == "ok"
    assert rows["flashwrite"]["backend"] in ("io_uring", "threads")
    assert "first" in rows["flashwrite"]  # warm-up save kept apart
    if rows["deepspeed"]["status"] != "ok":
        assert rows["deepspeed"]["status"].startswith("skipped: ")
    assert {t["target"] for t in res["targets"]} >= {"durable >= 0.9 x device limit"}
    try:
        import matplotlib  # noqa: F401
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    except ImportError:
        assert not png.exists()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".flashwrite-bench")] == []


def test_bench_rejects_unknown_contender(tmp_path, capsys):
    assert main(["bench", "--size", "1MiB", "--contenders", "nope", "--dir", str(tmp_path)]) == 2
    assert "unknown contender" in capsys.readouterr().err


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


def test_report_plain_table_and_markdown():
    res = runner.summarize(
        {"rounds": 1, "filesystem": "ext4", "cpus": 2, "cold_cache": "dropped"}, 1 << 30,
        [{"tool": "fio", "write_s": 1.0, "read_s": 0.8}],
        {"memcpy": [{"status": "ok", "name": "memcpy", "label": "memcpy", "stall_s": 0.1}],
         "flashwrite": [{"status": "ok", "name": "flashwrite", "label": "fw", "stall_s": 0.12, "durable_s": 1.05,
                         "cpu_s": 0.2, "rss_growth": 1 << 30, "load_s": 0.85, "load_check": "ok"}],
         "torch_save": [{"status": "ok", "name": "torch.save + fsync", "label": "ts", "stall_s": 2.0,
                         "durable_s": 2.0, "cpu_s": 1.0, "rss_growth": 0, "load_s": 1.5, "load_check": "ok"}],
         "deepspeed": [{"status": "skipped: deepspeed not installed", "name": "DeepSpeed FastPersist"}]})
    rows = {r["key"]: r for r in res["rows"]}
    assert rows["flashwrite"]["vs_device"] == pytest.approx(1 / 1.05)
    assert rows["flashwrite"]["load_vs_device"] == pytest.approx(0.8 / 0.85)
    met = {t["target"]: t["met"] for t in res["targets"]}
    assert met["durable >= 0.9 x device limit"] and met["faster to durable than every peer"]
    import io
    buf = io.StringIO()
    report.print_table(res, file=buf, plain=True)
    text = buf.getvalue()
    assert "skipped: deepspeed not installed" in text and "x device read" in text
    assert report.markdown(res).count("\n") == len(report.table_rows(res)) + 1


def test_overhead_train_and_summary(tmp_path):
    spec = {"mode": "flashwrite", "steps": 4, "every": 2, "width": 32, "depth": 2, "batch": 4, "dir": str(tmp_path)}
    r = overhead.train(spec)
    assert r["checkpoints"] == 2 and len(r["stalls"]) == 2 and r["checkpoint_bytes"] > 0
    assert fw.load(tmp_path / "step-000004")["step"] == 4
    base = overhead.train({**spec, "mode": "none"})
    res = overhead.summarize({"none": [{**base, "status": "ok"}], "flashwrite": [{**r, "status": "ok"}]},
                             {"steps": 4, "every": 2, "rounds": 1, "model": "tiny"})
    rows = {x["key"]: x for x in res["rows"]}
    assert rows["flashwrite"]["slowdown_pct"] is not None and rows["none"]["slowdown_pct"] == 0


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
