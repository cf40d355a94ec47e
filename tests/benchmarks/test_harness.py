"""The benchmark harness of benchmarks/ (once `flashwrite bench` / `flashwrite overhead`,
moved out of the wheel by issue 36), at toy sizes (a few seconds each)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

import flashwrite as fw
from harness_paths import BENCHMARKS, COMPARE
from harness import overhead, peers, report, runner  # noqa: E402  (benchmarks/, put on the path above)

COLUMNS = ["stall_s", "durable_s", "gbps", "vs_device", "cpu_s_per_gib", "rss_growth", "load_s", "load_vs_device",
           "restart_s", "restart_vs_device"]


@pytest.mark.slow  # README suite budget (issue 36): the slow job in CI runs it
def test_compare_writes_json_with_every_column(tmp_path):
    """The standing command's shape: {"comparison": {meta, bytes, device, memcpy, rows, targets}}."""
    out, png = tmp_path / "res.json", tmp_path / "res.png"
    p = subprocess.run([sys.executable, COMPARE, "--size", "16MiB", "--rounds", "1",
                        "--contenders", "torch_save,deepspeed,flashwrite", "--dir", str(tmp_path), "--json", str(out),
                        "--plot", str(png), "--device-tool", "probe", "--plain", "-q"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())["comparison"]
    assert set(res) == {"meta", "bytes", "device", "memcpy", "rows", "targets"}
    assert res["device"]["write_s"] > 0 and res["device"]["read_s"] > 0 and "probe" in res["device"]["tool"]
    assert res["memcpy"]["stall_s"] > 0 and res["meta"]["flashwrite"] == fw.__version__
    rows = {r["key"]: r for r in res["rows"]}
    for key in ("torch_save", "flashwrite"):
        assert rows[key]["status"] == "ok", rows[key]
        for c in COLUMNS:
            assert rows[key][c] is not None, (key, c)
        assert rows[key]["load_check"] == "ok"
    assert rows["flashwrite"]["backend"] in ("io_uring", "threads")
    assert "first" in rows["flashwrite"]  # warm-up save kept apart
    if rows["deepspeed"]["status"] != "ok":  # from benchmarks/peers.py, beside the harness
        assert rows["deepspeed"]["status"].startswith("skipped: ")
    assert {t["target"] for t in res["targets"]} >= {"durable >= 0.9 x device limit"}
    for text in ("torch.save + fsync", "flashwrite", "device limit", "CPU s/GiB", "RSS +GiB", "target met"):
        assert text in p.stdout
    try:
        import matplotlib  # noqa: F401
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    except ImportError:
        assert not png.exists()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".flashwrite-bench")] == []


def test_compare_takes_every_flag_flashwrite_bench_took():
    import compare
    a = compare.parser().parse_args(
        ["--size", "2GiB", "--rounds", "3", "--contenders", "torch_save,flashwrite", "--dir", "D", "--plain", "-q",
         "--json", "OUT", "--plot", "P", "--no-load", "--inprocess", "--dcp-threads", "2", "--device-tool", "probe",
         "--flashwrite-options", "{}", "--markdown", "--overhead", "--peers", "F", "--steps", "4", "--every", "2",
         "--overhead-rounds", "1", "--no-drop-caches"])
    assert (a.size, a.rounds, a.contenders, a.json) == (2 << 30, 3, "torch_save,flashwrite", "OUT")


def test_compare_rejects_unknown_contender(tmp_path, capsys):
    import compare
    assert compare.main(["--size", "1MiB", "--contenders", "nope", "--dir", str(tmp_path)]) == 2
    assert "unknown contender" in capsys.readouterr().err


def test_report_plain_table_and_markdown():
    res = runner.summarize(
        {"rounds": 1, "filesystem": "ext4", "cpus": 2, "cold_cache": "dropped"}, 1 << 30,
        [{"tool": "fio", "write_s": 1.0, "read_s": 0.8}],
        {"memcpy": [{"status": "ok", "name": "memcpy", "label": "memcpy", "stall_s": 0.1}],
         "flashwrite": [{"status": "ok", "name": "flashwrite", "label": "fw", "stall_s": 0.12, "durable_s": 1.05,
                         "cpu_s": 0.2, "rss_growth": 1 << 30, "load_s": 0.85, "load_check": "ok",
                         "restart_s": 0.75, "restart_check": "ok"}],
         "torch_save": [{"status": "ok", "name": "torch.save + fsync", "label": "ts", "stall_s": 2.0,
                         "durable_s": 2.0, "cpu_s": 1.0, "rss_growth": 0, "load_s": 1.5, "load_check": "ok"}],
         "deepspeed": [{"status": "skipped: deepspeed not installed", "name": "DeepSpeed FastPersist"}]})
    rows = {r["key"]: r for r in res["rows"]}
    assert rows["flashwrite"]["vs_device"] == pytest.approx(1 / 1.05)
    assert rows["flashwrite"]["load_vs_device"] == pytest.approx(0.8 / 0.85)
    assert rows["flashwrite"]["restart_vs_device"] == pytest.approx(0.8 / 0.75)
    assert rows["torch_save"]["restart_vs_device"] is None  # not measured: no column made up
    met = {t["target"]: t["met"] for t in res["targets"]}
    assert met["durable >= 0.9 x device limit"] and met["faster to durable than every peer"]
    assert met["restart load >= 0.9 x device read"] and "faster restart load than every peer" not in met
    buf = io.StringIO()
    report.print_table(res, file=buf, plain=True)
    text = buf.getvalue()
    assert "skipped: deepspeed not installed" in text and "x device read" in text and "restart load s" in text
    assert report.markdown(res).count("\n") == len(report.table_rows(res)) + 1


def test_overhead_train_and_summary(tmp_path):
    spec = {"mode": "flashwrite", "steps": 4, "every": 2, "width": 32, "depth": 2, "batch": 4, "dir": str(tmp_path)}
    r = overhead.train(spec)
    assert r["checkpoints"] == 2 and len(r["stalls"]) == 2 and r["checkpoint_bytes"] > 0
    assert fw.load(tmp_path / "step-000004")["step"] == 4
    base = overhead.train({**spec, "mode": "none"})
    res = overhead.summarize({"none": [{**base, "status": "ok"}], "flashwrite": [{**r, "status": "ok"}]},
                             {"steps": 4, "every": 2, "rounds": 1, "model": "tiny", "checkpoint_bytes": 1 << 20})
    rows = {x["key"]: x for x in res["rows"]}
    assert rows["flashwrite"]["slowdown_pct"] is not None and rows["none"]["slowdown_pct"] == 0
    buf = io.StringIO()
    report.print_overhead(res, file=buf, plain=True)
    assert "slowdown %" in buf.getvalue() and "flashwrite" in buf.getvalue()


def test_the_harness_finds_the_peer_adapters_beside_it():
    assert peers.PEERS_FILE == os.path.join(BENCHMARKS, "peers.py")
    found = peers.contenders()
    assert {"dcp_async_staged", "torch_checkpointing", "deepspeed"} <= set(found)
    assert list(found)[-1] == "flashwrite" and peers.default_contenders() == list(found)


def test_the_harness_never_runs_a_peers_file_from_the_current_directory(tmp_path, monkeypatch):
    """A peers.py in the caller's working directory is not the harness's to run: with none
    beside it, it runs none."""
    (tmp_path / "benchmarks").mkdir()
    marker = tmp_path / "ran"
    for p in (tmp_path / "peers.py", tmp_path / "benchmarks" / "peers.py"):
        p.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLASHWRITE_PEERS_FILE", raising=False)
    monkeypatch.setattr(peers, "PEERS_FILE", str(tmp_path / "elsewhere" / "peers.py"))  # a harness copied alone
    peers.external.cache_clear()
    try:
        assert peers.external() is None
        assert list(peers.contenders())[-1] == "flashwrite"
    finally:
        peers.external.cache_clear()
    assert not marker.exists()
