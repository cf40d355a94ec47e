"""benchmarks/gpu_check.py, the script for the day a GPU is lent (issues 27 and 37), and
benchmarks/gpu_device_run.sh, the one command that runs it there. Here (no GPU) every
phase runs on CPU tensors or is skipped with its reason, with the stand-in CUDA runtime
loaded as flashwrite's runtime; the JSON is whole after a kill, a hung phase is ended by
its cap and the run goes on, and the device script fails clearly without a GPU."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from cuda_fixtures import fake_cudart  # noqa: F401  (the stand-in CUDA runtime)

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(_TESTS_FILE)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")
SMALL = ["--no-build", "--skip-tests", "--gib", "0.02", "--small", "300", "--rounds", "1"]

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
try:
    import gpu_check
finally:
    sys.path.pop(0)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: gpu_check.py would measure it")


def _env(fake=None):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "FLASHWRITE_CUDA_RUNTIME")}
    if fake:
        env["FLASHWRITE_CUDA_RUNTIME"] = fake
    return env


def _check(tmp_path, *extra, fake=None, timeout=240):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, SCRIPT, *SMALL, "--dir", str(tmp_path / "ck"), "--json", str(out),
                        "--md", str(tmp_path / "gpu_check.md"), *extra], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO, env=_env(fake))
    return r, json.loads(out.read_text())


@pytest.mark.slow  # a whole small run: 15-40 s on 2 shared cores
@no_gpu
def test_every_phase_is_measured_or_skipped_with_its_reason(tmp_path, fake_cudart):  # noqa: F811
    r, res = _check(tmp_path, fake=fake_cudart)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gpu_check: OK" in r.stdout
    phases = res["phases"]
    assert list(phases) == gpu_check.PHASES, list(phases)
    for name, rec in phases.items():
        assert rec["status"] in ("measured", "skipped"), (name, rec)
        if rec["status"] == "skipped":
            assert rec["reason"], name
    for name in gpu_check.GPU_ONLY:  # torch has no CUDA here: those are skipped, saying why
        assert phases[name]["status"] == "skipped" and "no CUDA GPU" in phases[name]["reason"], name
    assert phases["gpu_tests"]["reason"] == "--skip-tests"
    measured = {n for n, rec in phases.items() if rec["status"] == "measured"}
    assert measured == set(gpu_check.PHASES) - gpu_check.GPU_ONLY - {"gpu_tests"}
    # The stand-in is the runtime flashwrite found; the phases still ran on CPU tensors.
    assert phases["env"]["backend_info"]["cuda"]["via"] == "FLASHWRITE_CUDA_RUNTIME"
    assert res["device"] == "cpu"
    first = phases["first_save_unprepared"]
    assert first["roundtrip_ok"] is True and "pin_s" in first and first["stall_s"] > 0
    assert phases["prepared_save"]["stall_x_d2h"] is None and phases["prepared_save"]["stall_x_d2h_note"]
    small = phases["small_tensors"]
    assert small["tensors"] == 300 and small["coalesce_on"]["total_s"] > 0 and small["coalesce_off"]["total_s"] > 0
    loads = phases["loads"]
    assert loads["fw_load_exact"] is True and loads["torch_load_s"] > 0 and loads["safetensors_load_s"] > 0
    raw = phases["odirect_raw"]
    assert raw["write_gbps"] > 0 and raw["read_gbps"] > 0 and "errors" not in raw, raw
    mm = phases["matmul_during_save"]
    assert mm["during_save_steps"] >= 1 and mm["during_reserve_steps"] >= 1
    exit_ = phases["exit_in_flight"]
    assert exit_["ok"] is True and exit_["child_rc"] == 0 and exit_["checkpoint"] in ("committed", "absent"), exit_
    assert phases["fork"]["ok"] is True
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {n} |" in md for n in gpu_check.PHASES)
    assert not os.path.exists(tmp_path / "ck")  # cleaned up


@no_gpu
def test_json_is_whole_after_a_kill_mid_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    # reserve never ends here: the run is surely still going when it is killed
    p = subprocess.Popen([sys.executable, SCRIPT, *SMALL, "--hang", "reserve", "--dir", str(tmp_path / "ck"),
                          "--json", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                         env=_env())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(out.read_text())["phases"].get("env", {}).get("status") == "measured":
                    break
            except (OSError, ValueError, KeyError):
                pass  # not written yet (it is replaced whole, never written in place)
            time.sleep(0.05)
        else:
            pytest.fail("the first phase never finished")
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    res = json.loads(out.read_text())
    assert res["phases"]["env"]["status"] == "measured"
    assert "gpu_tests" not in res["phases"]  # killed before the end


@pytest.mark.slow  # a whole small run: 15-40 s on 2 shared cores
@no_gpu
def test_a_hung_phase_is_ended_by_its_cap_and_the_run_goes_on(tmp_path):
    r, res = _check(tmp_path, "--hang", "torch_save", "--caps", '{"torch_save": 2}')
    assert r.returncode == 1, r.stdout + r.stderr  # a timed-out phase fails the verdict
    ts = res["phases"]["torch_save"]
    assert ts["status"] == "timed_out" and "cap of 2 s" in ts["reason"] and ts["s"] < 10, ts
    assert res["phases"]["odirect_raw"]["status"] == "measured"  # the phases after it still ran
    assert res["phases"]["loads"]["torch_load_s"] is None and res["phases"]["loads"]["torch_load_note"]
    assert res["failed"] == ["torch_save"]


def test_gpu_check_keeps_its_results_and_exits_when_over_budget(tmp_path):
    # A budget far too short: the watchdog ends the run (exit 3) and the JSON written
    # after each phase is there, saying so, instead of a hang or nothing.
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, SCRIPT, "--no-build", "--skip-tests", "--budget", "0.5",
                        "--dir", str(tmp_path / "ck"), "--json", str(out)], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env=_env())
    assert r.returncode == 3, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["budget_s"] == 0.5 and "still running after" in res["killed_by_budget"], res


@pytest.mark.slow  # a whole small run: 15-40 s on 2 shared cores
@no_gpu
def test_device_script_fails_clearly_without_a_gpu_and_writes_its_json(tmp_path):
    out = tmp_path / "out"
    env = dict(_env(), OUT=str(out), PYTHON=sys.executable, GPU_RUN_NO_BUILD="1",
               GPU_CHECK_ARGS="--gib 0.02 --small 300 --rounds 1 --skip-tests")
    r = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_device_run.sh")], capture_output=True,
                       text=True, timeout=240, cwd=REPO, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    said = r.stdout + r.stderr  # the script tees both into $OUT/device_run.log
    assert "NO GPU visible" in said and "== machine" in said and "torch " in said and "== gpu_check.py" in said
    res = json.loads((out / "gpu_check.json").read_text())
    assert list(res["phases"]) == gpu_check.PHASES
    assert (out / "gpu_check.md").exists() and (out / "device_run.log").exists()
    assert not os.path.exists(os.path.join(REPO, "build", "gpu-check", "ckpt"))


def test_gpu_check_sizes_its_state_from_free_disk_and_memory(tmp_path):
    free_disk = shutil.disk_usage(tmp_path).free
    gib = gpu_check.auto_gib(str(tmp_path), gpu_free=2 << 30)
    assert 0.25 <= gib <= 1.0  # half of the GPU's 2 GiB free, at most
    assert gib * 2**30 <= max(free_disk / 4, 0.25 * 2**30)
