"""Failure paths of the native core that used to terminate, hang or fail a load
(issue 12, "reasoned, not reproduced"): thread creation failing anywhere in a save,
a copy batch without an event, and O_DIRECT reads the file system refuses. LD_PRELOAD
shims are appended to any LD_PRELOAD already set (the sanitizer job preloads ASan)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import flashwrite as fw
from flashwrite import _core

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))


def preload(*libs):
    """LD_PRELOAD with libs appended to what is already preloaded."""
    return ":".join(p for p in [os.environ.get("LD_PRELOAD", ""), *libs] if p)


def _shim(name, tmp_path):
    lib = tmp_path / (name + ".so")
    cc = subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), os.path.join(HERE, name + ".c"), "-ldl",
                         "-lpthread"], capture_output=True, text=True)
    if cc.returncode:
        pytest.skip(f"no C compiler for the shim: {cc.stderr[:200]}")
    return str(lib)


def _child(scenario, tmp_path, env, timeout=180):
    full = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full.update(env)
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "hang_child.py"), scenario, str(tmp_path)], env=full,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario} hung:\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"{scenario} failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_thread_creation_failing_anywhere_never_crashes_hangs_or_leaks(tmp_path):
    # Before: ThreadBackend's constructor terminated the process when a later thread
    # failed to start, UringBackend leaked its eventfd and ring, and a copy thread
    # that could not start escaped the control thread (terminate).
    lib = _shim("fault_pthread_create", tmp_path)
    out = _child("threads_fail", tmp_path, {"LD_PRELOAD": preload(lib)})
    outcomes = {o for _, _, _, o in out["results"]}
    assert any(o.startswith(("refused", "failed")) for o in outcomes), out  # the faults did hit
    assert "ok" in outcomes, out  # and enough threads let a save through
    assert all(finished for _, _, finished, _ in out["results"]), out
    assert out["fds_after"] == out["fds_before"], out


def test_copy_batch_without_an_event_fails_the_save_cleanly(fake_cudart, tmp_path):
    # issue() records no event when cudaEventRecord fails; land() then synchronizes the
    # stream, outside any try before this change (a throw there terminated the process).
    out = _child("record_fails", tmp_path, {"FLASHWRITE_CUDA_RUNTIME": fake_cudart, "FAKE_CUDART_FAIL_RECORD": "2",
                                             "FAKE_CUDART_FAIL_CODE": "1"})  # not sticky: the engine goes on
    assert out["finished"] is True and out["error"] and "cudaEventRecord" in out["error"], out
    assert out["second_ok"] is True and out["pool_bytes"] <= 4 << 20, out


def _direct_dir(tmp_path):
    for d in (str(tmp_path), "/dev/shm"):
        if os.path.isdir(d) and _core.probe_direct(d):
            return d
    pytest.skip("no directory here takes O_DIRECT")


@pytest.mark.parametrize("mode", ["einval", "short"])
def test_direct_reads_the_file_system_refuses_fall_back_to_buffered(tmp_path, mode):
    # Before: a read refused with EINVAL, or a short read resumed at an unaligned
    # offset (EINVAL under O_DIRECT), failed the load; saves already fell back.
    import tempfile
    lib = _shim("fault_pread_direct", tmp_path)
    with tempfile.TemporaryDirectory(dir=_direct_dir(tmp_path)) as d:
        sd = {f"p{i}": torch.randn(300_000 + i, generator=torch.Generator().manual_seed(i)) for i in range(4)}
        fw.save(sd, os.path.join(d, "ck"))
        code = f"""
import os, json, torch, flashwrite as fw
from flashwrite import _core

os.environ["FAULT_PREAD_MODE"] = {mode!r}
out = fw.load({os.path.join(d, "ck")!r}, backend="threads")
torch.save(out, {str(tmp_path / "out.pt")!r})
files = sorted(os.path.join({os.path.join(d, "ck")!r}, f) for f in os.listdir({os.path.join(d, "ck")!r})
               if f.endswith(".safetensors"))
job = _core.start_load([(f, os.path.getsize(f)) for f in files], [], "threads", 4)
job.wait()
job.rethrow()
print(json.dumps({{"files": len(files), "files_direct": job.files_direct}}))
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, LD_PRELOAD=preload(lib)))
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["files"] >= 1 and res["files_direct"] == 0, res  # every file went buffered
        out = torch.load(str(tmp_path / "out.pt"))
        assert all(torch.equal(out[k], v) for k, v in sd.items())


def _open_fds() -> set:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def test_probe_direct_leaves_nothing_behind(tmp_path):
    # Earlier tests' clean-up threads (an interrupted save's removal, a cancelled load's
    # join) may still close descriptors of their own: let them end, and then compare the
    # descriptors that are new, not a count another thread can lower.
    from flashwrite.future import join_cleanups
    join_cleanups()
    before = _open_fds()
    for _ in range(20):
        _core.probe_direct(str(tmp_path))
    assert _open_fds() - before == set()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".flashwrite-probe")] == []
