"""Scenarios for test_never_hangs.py, run in a child process with a timeout so that a
hang fails the suite instead of stalling it. Each prints one JSON line.

The saves talk to _core directly with hand-made files (no header, segments packed
back to back), so they depend on nothing but the engine's own interface. "Device"
memory comes from the stand-in CUDA runtime (tests/fake_cudart.cpp) when
FLASHWRITE_CUDA_RUNTIME names it.

Usage: python hang_child.py SCENARIO DIR [SEED]
"""

import ctypes
import json
import os
import random
import sys
import time

from flashwrite import _core

MiB = 1 << 20
fake = None
if os.environ.get("FLASHWRITE_CUDA_RUNTIME"):
    fake = ctypes.CDLL(os.environ["FLASHWRITE_CUDA_RUNTIME"])  # the same handle the engine uses
    fake.fake_cudart_enqueue_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                              ctypes.c_int]
    fake.fake_cudart_stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    if hasattr(fake, "fake_cudart_malloc"):
        fake.fake_cudart_malloc.restype = ctypes.c_void_p
        fake.fake_cudart_malloc.argtypes = [ctypes.c_size_t]
        fake.fake_cudart_poke.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Source:
    """n bytes of pattern `seed`, in host memory or (device=0) in stand-in device memory."""

    def __init__(self, n: int, seed: int, device: int = -1):
        self.data = bytes(random.Random(seed).getrandbits(8) for _ in range(min(n, 4096))) * (n // 4096 + 1)
        self.data = self.data[:n]
        self.device = device
        self.host = ctypes.create_string_buffer(self.data, n) if n else ctypes.create_string_buffer(1)
        self.addr = ctypes.addressof(self.host)
        if device >= 0 and fake is not None and hasattr(fake, "fake_cudart_malloc"):
            self.addr = fake.fake_cudart_malloc(max(n, 1))
            fake.fake_cudart_poke(self.addr, self.host, n)


def save(eng, path, sources, wait_streams=(), **kw):
    """One stripe file holding the sources back to back; returns (job, expected bytes)."""
    segs, off = [], 0
    for s in sources:
        segs.append((s.addr, len(s.data), 0, off, s.device))
        off += len(s.data)
    job = eng.start_save([(path, b"", off)], segs, sources, streams=list(wait_streams), **kw)
    return job, b"".join(s.data for s in sources)


def scenario_mixed_bounded(d):
    """Issue 12 bug 1: a bounded pool and a state mixing GPU and CPU chunks."""
    results = []
    for pool in (2 * MiB, 6 * MiB):
        for rep in range(6):
            eng = _core.Engine(MiB, pool)
            srcs = [Source(8 * MiB, 1, 0), Source(8 * MiB, 2, -1)]
            path = os.path.join(d, f"mixed-{pool}-{rep}")
            job, want = save(eng, path, srcs, [(0, 0)])
            done = job.wait(30)
            if not done:
                print(json.dumps({"hung": True, "pool": pool, "rep": rep}), flush=True)
                os._exit(3)
            job.rethrow()
            results.append(open(path, "rb").read() == want)
    return {"hung": False, "all_equal": all(results), "saves": len(results)}


def scenario_trim_race(d):
    """Issue 12 bug 2: trim() right after start_save must not free the job's slots. While
    the job stages it holds a reservation, and trim() frees nothing; once staging is over
    the job gives its written slots back and trim() may free them while the job still
    fsyncs, so only a trim that started and ended while the job was staging counts (a
    trim that merely overlapped the job's end, on a loaded machine, does not)."""
    srcs = [Source(4 * MiB, 3)]
    freed_while_staging = 0
    for i in range(60):
        eng = _core.Engine(MiB)
        job, want = save(eng, os.path.join(d, f"t{i}"), srcs, backend="threads")
        staging = not job.staged
        freed = eng.trim()
        if staging and freed and not job.staged:
            freed_while_staging += 1
        if not job.wait(20):
            print(json.dumps({"hung": True, "iteration": i}), flush=True)
            os._exit(3)
        job.rethrow()
        assert open(os.path.join(d, f"t{i}"), "rb").read() == want
    return {"hung": False, "freed_while_staging": freed_while_staging}


def scenario_held_slots(d, reps):
    """A save that holds its slots (a local snapshot) has exactly one slot per chunk. A
    copy thread that waited for a slot before it claimed a chunk waited for good when
    another thread held the last slot and was about to claim the last chunk. Runs
    while CPU hogs preempt the copy threads inside that window."""
    import multiprocessing

    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for h in hogs:
        h.start()
    try:
        for rep in range(reps):
            path = os.path.join(d, f"held-{rep % 2}")
            if os.path.exists(path):
                os.unlink(path)
            eng = _core.Engine(MiB, 0)
            job, want = save(eng, path, [Source((1 + rep % 3) * MiB, rep)], hold_slots=True,
                             copy_threads=2 + rep % 3)
            if not job.wait(10):
                return {"hung": True, "rep": rep}
            job.rethrow()
            job.release_slots()
            if open(path, "rb").read() != want:
                return {"hung": False, "equal": False, "rep": rep}
    finally:
        for h in hogs:
            h.kill()
    return {"hung": False, "equal": True, "saves": reps}


def _spin():
    while True:
        pass


def scenario_huge_timeouts(d):
    """Issue 12 bug 3: wait(timeout=inf / 1e300 / 1e10) on a running job waits for it."""
    out = {}
    for name, timeout in (("inf", float("inf")), ("1e300", 1e300), ("1e10", 1e10)):
        stream = ctypes.c_void_p()
        fake.fake_cudart_stream_create(ctypes.byref(stream))
        src = Source(2 * MiB, 4, 0)
        # The caller's queued work keeps the snapshot from landing for 300 ms.
        t_fence = time.perf_counter()
        fake.fake_cudart_enqueue_fill(stream, src.addr, 7, 0, 300_000)
        eng = _core.Engine(MiB)
        job, _ = save(eng, os.path.join(d, "w-" + name), [src], [(0, stream.value)])
        t0 = time.perf_counter()
        staged = job.wait_staged(timeout)
        t1 = time.perf_counter()
        done = job.wait(timeout)
        # From the fence, not from the wait: on a loaded machine start_save itself may
        # take a good part of the 300 ms.
        out[name] = {"staged": staged, "staged_flag": job.staged, "done": done, "done_flag": job.done,
                     "waited_s": t1 - t0, "since_fence_s": t1 - t_fence}
        job.rethrow()
    return out


def scenario_pool_property(d, seed):
    """Random mixes of host and stand-in device chunks, pool sizes from one slot up,
    random cancel and trim: every save finishes (or fails) within a bound."""
    rng = random.Random(seed)
    bound = 20.0
    outcomes = {"ok": 0, "failed": 0}
    engines = {}
    for i in range(int(os.environ.get("POOL_PROPERTY_SAVES", "30"))):
        chunk = rng.choice([4096, 64 << 10, MiB])
        slots = rng.choice([0, 1, 2, 3, 5, 8])  # 0: unbounded
        key = (chunk, slots)
        eng = engines.get(key) if rng.random() < 0.5 else None
        if eng is None:
            eng = engines[key] = _core.Engine(chunk, slots * chunk)
        srcs = []
        for j in range(rng.randint(1, 6)):
            n = rng.choice([0, 1, 4095, 4096, chunk - 1, chunk + 1, 3 * chunk + 17, rng.randint(1, 5 * chunk)])
            dev = 0 if (fake is not None and rng.random() < 0.5) else -1
            srcs.append(Source(n, rng.randint(0, 1 << 30), dev))
        if all(len(s.data) == 0 for s in srcs):
            srcs.append(Source(100, 5))
        path = os.path.join(d, f"p{i}")
        job, want = save(eng, path, srcs, [(0, 0)] if any(s.device >= 0 for s in srcs) else [],
                         backend=rng.choice(["auto", "threads"]), queue_depth=rng.choice([1, 2, 32]),
                         copy_threads=rng.choice([1, 2, 3]))
        action = rng.choice(["none", "none", "cancel", "trim", "cancel+trim"])
        time.sleep(rng.choice([0, 0, 0.0005, 0.005]))
        if "cancel" in action:
            job.cancel()
        if "trim" in action:
            eng.trim()
        t0 = time.perf_counter()
        if not job.wait(bound):
            print(json.dumps({"hung": True, "seed": seed, "iteration": i, "chunk": chunk, "slots": slots,
                              "sizes": [(len(s.data), s.device) for s in srcs], "action": action}), flush=True)
            os._exit(3)
        assert time.perf_counter() - t0 < bound
        try:
            job.rethrow()
        except Exception:
            assert "cancel" in action, f"seed {seed} iteration {i}: failed without a cancel"
            outcomes["failed"] += 1
            continue
        assert open(path, "rb").read() == want, f"seed {seed} iteration {i}: wrong bytes"
        outcomes["ok"] += 1
        if rng.random() < 0.3:
            eng.trim()
    return {"hung": False, **outcomes}


def scenario_record_fails(d):
    """A batch whose cudaEventRecord failed carries no event: the landing thread
    synchronizes the stream instead. The save fails with the CUDA error, every slot
    comes back, the next save on the engine works."""
    eng = _core.Engine(MiB, 4 * MiB)
    job, _ = save(eng, os.path.join(d, "bad"), [Source(8 * MiB, 6, 0), Source(MiB, 7)], [(0, 0)])
    finished = job.wait(30)
    try:
        job.rethrow()
        error = None
    except RuntimeError as e:
        error = str(e)
    os.environ.pop("FAKE_CUDART_FAIL_RECORD")  # read per call by the stand-in
    job2, want = save(eng, os.path.join(d, "good"), [Source(8 * MiB, 6, 0), Source(MiB, 7)], [(0, 0)])
    ok = job2.wait(30)
    job2.rethrow()
    return {"finished": finished, "error": error, "second_ok": ok and open(os.path.join(d, "good"), "rb").read() == want,
            "pool_bytes": eng.pool_bytes}


def scenario_threads_fail(d):
    """Under tests/fault_pthread_create.c: thread creation fails at every point of a
    save's start and run in turn. Each attempt raises or fails its job, never crashes
    or hangs, and leaves no file descriptor behind."""
    src = Source(2 * MiB, 8)
    eng = _core.Engine(MiB)

    def attempt(name, backend):
        return eng.start_save([(os.path.join(d, name), b"", len(src.data))], [(src.addr, len(src.data), 0, 0)],
                              [src], backend=backend, queue_depth=4, copy_threads=2)

    job = attempt("warm", "auto")
    assert job.wait(30)
    job.rethrow()
    del job
    nfds = len(os.listdir("/proc/self/fd"))
    results = []
    for backend in ("threads", "auto"):
        for k in range(10):
            name = f"{backend}-{k}"
            os.environ["FAULT_PTHREAD_CREATE_OK"] = str(k)
            try:
                job = attempt(name, backend)
                finished = job.wait(30)
                try:
                    job.rethrow()
                    outcome = "ok"
                except Exception as e:
                    outcome = "failed: " + type(e).__name__
                del job
            except Exception as e:
                finished, outcome = True, "refused: " + type(e).__name__
            finally:
                del os.environ["FAULT_PTHREAD_CREATE_OK"]
            results.append([backend, k, finished, outcome])
            if not finished:
                print(json.dumps({"hung": results}), flush=True)
                os._exit(3)
            if os.path.exists(os.path.join(d, name)):
                os.unlink(os.path.join(d, name))
    job = attempt("after", "auto")
    assert job.wait(30)
    job.rethrow()
    del job
    return {"results": results, "fds_before": nfds, "fds_after": len(os.listdir("/proc/self/fd"))}


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    args = [int(a) for a in sys.argv[3:]]
    print(json.dumps(globals()["scenario_" + name](d, *args)))
