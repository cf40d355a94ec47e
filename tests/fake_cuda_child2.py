"""More scenarios for the stand-in CUDA runtime (issue 37): the order of a block=False
snapshot against the caller's next GPU work, sticky errors, fork. Run like
fake_cuda_child.py (python fake_cuda_child2.py SCENARIO DIR); each prints one JSON line."""

import ctypes
import json
import os
import sys
import time

import torch

from fake_cuda_child import _load, fake, file_bytes, save, state


def scenario_next_step_waits(d):
    """save(block=False), then the caller's next "kernel" (a fill of the saved tensor)
    queued at once on its stream: the file must hold the bytes from before the fill."""
    x = torch.full((8 << 20,), 3, dtype=torch.uint8)  # 8 chunks of 1 MiB
    stream = ctypes.c_void_p()
    fake.fake_cudart_stream_create(ctypes.byref(stream))
    xdev = []
    t0 = time.perf_counter()
    _, job, files = save({"x": x}, d, lambda k: 0, [(0, stream.value)], wait=False, on_device=xdev.append)
    returned_s = time.perf_counter() - t0
    staged_at_return = job.staged
    assert fake.fake_cudart_enqueue_fill(stream, xdev[0], 9, x.numel(), 0) == 0  # optimizer.step()
    job.wait()
    job.rethrow()
    data = file_bytes(d, files)[0][len(files[0].header):]
    return {"returned_s": returned_s, "staged_at_return": staged_at_return,
            "untorn": data == bytes([3]) * x.numel(), "nines": data.count(9)}


def _attempt(fn):
    t0 = time.perf_counter()
    try:
        fn()
        error = None
    except RuntimeError as e:
        error = str(e)
    return {"error": error, "took_s": time.perf_counter() - t0}


def scenario_sticky_fault(d):
    """A kernel of the program's faults (a sticky cudaErrorIllegalAddress) after a good
    GPU save: the next GPU save and GPU load fail at once with an error that says so;
    a CPU save on the same engine still works."""
    sd = state()
    on_gpu = lambda k: 0 if k in ("a", "b") else -1
    eng, job, _ = save(sd, d + "/good", on_gpu, [(0, 0)])
    job.rethrow()
    fake.fake_cudart_fault(700)

    def gpu_save():
        _, j, _ = save(sd, d + "/after", on_gpu, [(0, 0)], engine=eng)
        j.rethrow()

    def gpu_load():
        j = _load(d + "/ld", ["a"])[3]
        j.rethrow()

    out = {"save": _attempt(gpu_save), "load": _attempt(gpu_load)}
    _, cpu, files = save(sd, d + "/cpu", lambda k: -1, engine=eng)
    cpu.rethrow()
    out["cpu_save_ok"] = file_bytes(d + "/cpu", files) == file_bytes(d + "/good", files)
    out["last_error"] = fake.cudaGetLastError()
    return out


def _in_child(fn, timeout=20):
    """fn() in a forked child; its JSON answer, or {"hung": True} when it did not end in time."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            out = {"error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            data = os.read(r, 1 << 16)
            os.close(r)
            return json.loads(data)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(r)
    return {"hung": True}


def scenario_fork_cpu_save(d):
    """A parent's GPU save pinned the engine's pool; a forked child (a DataLoader worker)
    saves CPU tensors through the same engine: no CUDA call may be made there."""
    sd = state()
    eng, job, _ = save(sd, d + "/parent", lambda k: 0 if k == "a" else -1, [(0, 0)])
    job.rethrow()
    pinned = bool(fake.fake_cudart_registered()) and eng.pool_pinned

    def child():
        _, j, files = save(sd, d + "/child", lambda k: -1, engine=eng)
        j.rethrow()
        return {"calls_after_fork": fake.fake_cudart_calls_after_fork(), "pin_error": eng.pin_error,
                "pinned": eng.pool_pinned}

    return {"parent_pinned": pinned, **_in_child(child)}


def scenario_capture_mode_after_device(d):
    """flashwrite's threads set relaxed capture mode only once their device is current."""
    eng, job, _ = save(state(), d, lambda k: 1 if k == "a" else -1, [(1, 0)])
    job.rethrow()
    return {"exchange_without_device": fake.fake_cudart_exchange_without_device()}


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    print(json.dumps(globals()["scenario_" + name](d)))
