"""The GPU path's second pass (issue 37) on the stand-in CUDA runtime (tests/fake_cudart.cpp):
a block=False snapshot the caller's next GPU step cannot tear, sticky CUDA errors, fork.
Scenarios run in tests/fake_cuda_child2.py, in a child process whose runtime is the stand-in."""

import json
import os
import subprocess
import sys

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))


def _fake(fake_cudart, scenario, tmp_path, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full_env.update({"FLASHWRITE_CUDA_RUNTIME": fake_cudart, **{k: str(v) for k, v in env.items()}})
    r = subprocess.run([sys.executable, os.path.join(HERE, "fake_cuda_child2.py"), scenario, str(tmp_path)],
                       env=full_env, capture_output=True, text=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, f"{scenario} failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_block_false_snapshot_is_not_torn_by_the_next_step(fake_cudart, tmp_path):
    # Each 1 MiB copy takes 60 ms on the stand-in's copy stream; the caller's fill is queued
    # right after save returns, with no delay of its own. Only a wait of the caller's
    # stream on the copies keeps it out of the file.
    out = _fake(fake_cudart, "next_step_waits", tmp_path, FAKE_CUDART_COPY_DELAY_US=60_000)
    assert out["untorn"] is True, out
    # The CPU did not wait for the copies (8 x 60 ms).
    assert out["staged_at_return"] is False and out["returned_s"] < 0.4, out


def test_after_a_sticky_fault_gpu_saves_and_loads_fail_at_once_and_say_why(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "sticky_fault", tmp_path)
    assert out["last_error"] == 700  # the stand-in keeps the error, as CUDA does
    for what in ("save", "load"):
        r = out[what]
        assert r["error"] and "cudaErrorIllegalAddress" in r["error"], out
        assert "sticky" in r["error"] and "an earlier kernel" in r["error"] and "Restart the process" in r["error"], out
        assert r["took_s"] < 5, out  # promptly: nothing waits for copies that never land
    assert out["cpu_save_ok"] is True, out


def test_forked_child_makes_no_cuda_call_on_a_cpu_save(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "fork_cpu_save", tmp_path)
    assert out["parent_pinned"] is True and "hung" not in out and "error" not in out, out
    # Neither the pool's pin hooks nor the engine's pinning state survived the fork.
    assert out["calls_after_fork"] == 0 and out["pin_error"] in (None, ""), out


def test_relaxed_capture_mode_is_set_after_the_device(fake_cudart, tmp_path):
    # A save from cuda:1: no runtime call on a flashwrite thread before its cudaSetDevice.
    out = _fake(fake_cudart, "capture_mode_after_device", tmp_path, FAKE_CUDART_DEVICES=2)
    assert out["exchange_without_device"] == 0, out
