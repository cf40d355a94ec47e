"""The staging pool's pinning (issue 37 item 2) on the stand-in CUDA runtime
(tests/fake_cudart.cpp): a GPU save grows and pins the pool in bounded slabs on a thread
of its own, copies start into the slabs already pinned, one failed registration leaves
only its slab pageable, and SaveStats says how long the save waited for staging memory.
Scenarios run in tests/fake_cuda_child3.py, in a child process whose runtime is the stand-in."""

import json
import os
import subprocess
import sys

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))
SLAB = 4 << 20  # FLASHWRITE_PIN_SLAB_BYTES for these scenarios: a 22 MiB pool is 6 slabs


def _fake(fake_cudart, scenario, tmp_path, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full_env.update({"FLASHWRITE_CUDA_RUNTIME": fake_cudart, "FLASHWRITE_PIN_SLAB_BYTES": str(SLAB),
                     **{k: str(v) for k, v in env.items()}})
    r = subprocess.run([sys.executable, os.path.join(HERE, "fake_cuda_child3.py"), scenario, str(tmp_path)],
                       env=full_env, capture_output=True, text=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, f"{scenario} failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_first_gpu_save_pins_in_slabs_off_the_callers_thread(fake_cudart, tmp_path):
    # Each registration takes 200 ms: 6 slabs, 1.2 s of pinning in all.
    out = _fake(fake_cudart, "background_pin", tmp_path, FAKE_CUDART_REGISTER_DELAY_MS=200)
    assert out["same_files"] is True and out["pinned"] is True, out
    # Bounded slabs, each registered on its own, none by the caller's thread.
    assert out["registers"] == 6 and max(out["register_sizes"]) == SLAB, out
    assert out["caller_registered"] is False, out
    # The copies started into the first slab while later ones were still being pinned,
    # and save(block=False) returned before the pool was pinned (the call log at return).
    assert out["first_copy_before_last_register"] is True, out
    assert out["registers_at_return"] < out["registers"], out
    # SaveStats says the save waited for pinning, and how long the pinning took.
    assert out["staging_wait_s"] > 0.1 and out["staging_wait_reason"] == "pin", out
    assert out["pin_s"] >= 1.0 and out["unpinned_bytes"] == 0, out


def test_slabs_a_cpu_save_made_are_pinned_by_the_gpu_save_not_its_caller(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "existing_slabs", tmp_path, FAKE_CUDART_REGISTER_DELAY_MS=200)
    assert out["same_files"] is True and out["pinned"] is True, out
    assert out["registers"] == 1 and out["caller_registered"] is False, out
    assert 0.15 < out["pin_s"] < 0.38, out  # counted once (0.4 if counted twice)


def test_one_failed_registration_leaves_only_its_slab_pageable(fake_cudart, tmp_path):
    # The 2nd cudaHostRegister fails; copies to that slab are pageable (synchronous, as on CUDA).
    out = _fake(fake_cudart, "one_register_fails", tmp_path, FAKE_CUDART_FAIL_REGISTER_NTH=2,
                FAKE_CUDART_ALLOW_PAGEABLE=1)
    assert out["same_files"] is True, out
    assert out["registers"].count(0) == len(out["registers"]) - 1 and out["live"] == len(out["registers"]) - 1, out
    assert out["pinned"] is False and out["unpinned_bytes"] == SLAB == out["stats_unpinned_bytes"], out
    assert "cudaHostRegister of 4194304 bytes" in out["pin_error"], out


def test_load_bounce_pool_is_not_repinned_when_loads_alternate_gpus(fake_cudart, tmp_path):
    # Issue 37 item 6: the pool was keyed on the first device, so each change re-pinned it.
    out = _fake(fake_cudart, "bounce_alternating", tmp_path, FAKE_CUDART_DEVICES=2, FLASHWRITE_PIN_SLAB_BYTES=1 << 30)
    assert out["placed_ok"] is True and out["registers"] == 1, out
