#!/usr/bin/env python3
"""One script for a short slot on a GPU machine: measure the GPU data path phase by phase,
run the GPU tests last (capped), print a table. One call of at most 5 minutes on one H200
(16 cores, 128 GiB RAM, 64 GiB disk); on the lent machine run it through
benchmarks/gpu_device_run.sh (see benchmarks/README.md for the exact call).

    python benchmarks/gpu_check.py                  # build + measurements + GPU tests
    python benchmarks/gpu_check.py --gib 2 --dir /nvme/scratch
    python benchmarks/gpu_check.py --no-build       # use the flashwrite already importable

The state is sized from free disk (a quarter), available memory (a third) and free GPU
memory (a half), at most 8 GiB (--gib overrides). Every measurement is a phase (PHASES)
with a cap of its own; its record in the JSON's "phases" says "measured" (with its
numbers), "skipped" (with the reason: no GPU, or too little of --budget left), "error"
or "timed_out". The JSON is replaced whole after every phase, so a kill leaves the
phases so far. A phase past its cap is interrupted and the run goes on; one stuck in
native code past cap + 10 s ends the run (exit 3), and so does the --budget watchdog.
Without a GPU the GPU-only phases are skipped and the others run on CPU tensors.

The phases, for a state of bf16 matrices, fp32 optimizer state and small tensors:

- env: flashwrite/torch versions, backend_info (the CUDA runtime must be PyTorch's).
- d2h_limit: ``copy_`` into pinned memory and ``.to("cpu", non_blocking=True)``, best of 3.
- first_save_unprepared: a fresh Writer's first save (no reserve()): every SaveStats
  field present (pin_s, and the staging-wait fields where this version has them), and
  fault_s_estimate = stall - pin_s - the D2H-limit time; byte-exact round trip.
- reserve, prepared_save (--rounds saves after reserve(); stall_x_d2h = best stall over
  the D2H-limit time of the state), noblock_save (block=False: return, wait_staged()).
- small_tensors: --small tensors of 1-16 KiB saved with the GPU gather (coalescing) on
  and off, against a ``.to("cpu", non_blocking=True)`` loop.
- torch_save; loads: ``torch.load(map_location="cuda")`` and safetensors'
  ``load_file(device="cuda:0")`` against ``fw.load(map_location="cuda")`` and ``into=``,
  files evicted from the page cache first.
- odirect_raw: raw O_DIRECT write (+ fsync) and read, 8 threads, 16 MiB buffers.
- matmul_during_save: the step time of a matmul loop alone, during a block=False save and
  during a background reserve().
- incremental (gpu_incremental_check.py), fork beside the pinned pool, capture (a save
  inside torch.cuda.graph is refused; one beside a global capture leaves it valid).
- exit_in_flight: a child process starts a block=False save and exits; it must end by
  itself and leave a checkpoint that loads, or none.
- gpu_tests: tests/system/test_cuda*.py with the real runtime, last, capped.

Results go to --json and --md (default $OUT/gpu_check.json and $OUT/gpu_check.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from gpu_incremental_check import incremental_check  # noqa: E402  (beside this script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(REPO, "build", "gpu-check", "site")
T_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - T_START:6.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T_START


# ------------------------------------------------------------------------- build


def build() -> dict:
    os.makedirs(SITE, exist_ok=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4), PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps", "--upgrade",
           "--target", SITE, REPO]
    log("building: " + " ".join(cmd))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        print(r.stdout[-6000:], r.stderr[-6000:], sep="\n")
        raise SystemExit(f"build failed ({r.returncode}) after {took:.0f} s")
    log(f"built in {took:.1f} s")
    return {"build_s": took}


def use_site() -> None:
    sys.path.insert(0, SITE)
    os.environ["PYTHONPATH"] = SITE + os.pathsep + os.environ.get("PYTHONPATH", "")


# ------------------------------------------------------------------------- tests


def run_tests(timeout: float, all_tests: bool) -> dict:
    import glob
    files = sorted(os.path.relpath(f, REPO) for f in glob.glob(os.path.join(REPO, "tests", "system", "test_cuda*.py")))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    if not all_tests:  # the stand-in-runtime tests cover the same code without a GPU: not needed here
        cmd += ["-k", "not fake_runtime"]
    log("tests: " + " ".join(cmd))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        out, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), -1
        out += f"\n(timed out after {timeout:.0f} s)"
    print(out[-8000:], flush=True)
    summary = next((line for line in reversed(out.strip().splitlines()) if " in " in line and
                    any(w in line for w in ("passed", "failed", "error", "skipped"))), out.strip()[-200:])
    return {"tests_rc": code, "tests_summary": summary.strip("= "), "tests_s": time.perf_counter() - t0}


# -------------------------------------------------------------------- measuring


def fs_of(path: str) -> str:
    """File system type and source of the mount holding ``path`` (from /proc/self/mountinfo)."""
    best, desc = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, right = line.split(" - ", 1)
                mnt = left.split()[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    fstype, src = right.split()[:2]
                    best, desc = mnt, f"{fstype} ({src} on {mnt})"
    except OSError:
        pass
    return desc


def make_state(gib: float, device, small: int = 256):
    import torch
    total = int(gib * (1 << 30))
    g = torch.Generator(device=device).manual_seed(0)
    state = {"model": {}, "optim": {"step": 1000, "lr": 3e-4, "exp_avg": {}}}
    small_bytes = 0
    for i in range(small):  # biases / norms / scales: 1 .. 16 KiB
        n = 256 * (1 + (i * 37) % 16)
        state["model"][f"norm{i}.weight"] = torch.randn(n, device=device, generator=g)
        small_bytes += 4 * n
    big = max(0, total - small_bytes)
    n_mat = 24
    mat_bytes = big // 2 // n_mat  # half the state: bf16 weights
    cols = 4096
    rows = max(1, mat_bytes // 2 // cols)
    for i in range(n_mat):
        state["model"][f"layers.{i}.weight"] = torch.randn(rows, cols, device=device, generator=g).bfloat16()
    rest = total - small_bytes - n_mat * rows * cols * 2
    per = max(1, rest // 4 // n_mat)  # the other half: fp32 optimizer state
    for i in range(n_mat):
        state["optim"]["exp_avg"][i] = torch.randn(per, device=device, generator=g)
    sync(device)
    return state


def tensors_of(state):
    import torch
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(state)
    return out


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _capped(ts, limit_bytes: int):
    out, total = [], 0
    for t in sorted(ts, key=lambda x: -x.numel() * x.element_size()):
        n = t.numel() * t.element_size()
        if total + n > limit_bytes and out:
            continue
        out.append(t)
        total += n
    return out


def d2h_limits(ts, device, limit_bytes: int, rounds: int = 3) -> dict:
    """GB/s of D2H copies into pinned memory (copy_) and of .to('cpu', non_blocking),
    on the largest tensors up to limit_bytes; H2D back from the same pinned memory."""
    import torch
    ts = _capped(ts, limit_bytes)
    nb = nbytes(ts)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in ts]
    best_copy = best_to = best_h2d = float("inf")
    for _ in range(rounds + 1):  # the first round warms up (and fills the caching host allocator)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for d, s in zip(pinned, ts):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for d, s in zip(pinned, ts):
            s.copy_(d, non_blocking=True)
        torch.cuda.synchronize(device)
        best_h2d = min(best_h2d, time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = [s.to("cpu", non_blocking=True) for s in ts]
        torch.cuda.synchronize(device)
        best_to = min(best_to, time.perf_counter() - t0)
        del outs
    del pinned
    empty = getattr(torch._C, "_host_emptyCache", None)  # give PyTorch's cached pinned blocks back
    if empty:
        empty()
    return {"limit_bytes": nb, "d2h_copy_pinned_gbps": nb / best_copy / 1e9, "d2h_to_cpu_gbps": nb / best_to / 1e9,
            "h2d_copy_pinned_gbps": nb / best_h2d / 1e9}


def check_equal(a_state, b_state) -> bool:
    import torch
    a, b = tensors_of(a_state), tensors_of(b_state)
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and
                                    torch.equal(x, y) for x, y in zip(a, b))


def _vmas() -> list[tuple[int, int, set]]:
    """(start, end, VmFlags) of this process's mappings."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = [lo, hi, set()]
                out.append(cur)
            elif head[0] == "VmFlags:" and cur is not None:
                cur[2] = set(head[1:])
    return [tuple(v) for v in out]


def _numa_nodes(ranges) -> dict:
    """Pages per NUMA node in the mappings starting at the given addresses (/proc/self/numa_maps)."""
    starts = {lo for lo, _ in ranges}
    nodes: dict[str, int] = {}
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                parts = line.split()
                if int(parts[0], 16) in starts:
                    for p in parts[1:]:
                        if p.startswith("N") and "=" in p:
                            k, v = p.split("=")
                            nodes[k[1:]] = nodes.get(k[1:], 0) + int(v)
    except OSError:
        pass
    return nodes


def _gpu_numa_node(device) -> int | None:
    import torch
    p = torch.cuda.get_device_properties(device)
    try:
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read())
    except (AttributeError, OSError, ValueError):
        return None


def fork_check(writer, state, base: str, saved_path: str | None) -> dict:
    """fork() beside the reserved pool: the time of a fork whose child exits at once, a
    child that saves a CPU state through the inherited Writer, the parent's pool still
    whole, and how much of the process is MADV_DONTFORK (the pool's slabs)."""
    import torch

    import flashwrite as fw
    res: dict = {"dont_fork_bytes": sum(hi - lo for lo, hi, fl in _vmas() if "dc" in fl),
                 "pool_bytes": writer.pool_bytes}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - t0)
    res["fork_s"] = statistics.median(times)
    cpu_state = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.arange(1000, dtype=torch.int64)}
    child_dir = os.path.join(base, "fork-child")
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(120, exit=True)  # a hung child never outlives the run
        code = 1
        try:
            writer.save(cpu_state, child_dir)
            back = fw.load(child_dir)
            # numpy, not torch: PyTorch's OpenMP pool hangs in a forked child once used
            code = 0 if all(back[k].numpy().tobytes() == v.numpy().tobytes() for k, v in cpu_state.items()) else 2
        except BaseException as e:  # noqa: BLE001 - the exit code reports it
            print(f"fork child: {e!r}", flush=True)
        finally:
            os._exit(code)
    res["child_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    shutil.rmtree(child_dir, ignore_errors=True)
    if saved_path is not None and state is not None:
        path = os.path.join(base, "after-fork")
        writer.save(state, path)
        back = fw.load(path, map_location=None)
        res["parent_roundtrip_ok"] = check_equal(state, back)
        del back
        shutil.rmtree(path, ignore_errors=True)
    res["ok"] = res["child_exit"] == 0 and res.get("parent_roundtrip_ok", True) and \
        res["dont_fork_bytes"] >= res["pool_bytes"]
    return res


def capture_check(dev, base: str) -> dict:
    """A save inside torch.cuda.graph is refused (and the graph still replays); a save
    on another thread while this one captures in global mode leaves the capture valid."""
    import threading

    import torch

    import flashwrite as fw
    res: dict = {}
    x = torch.ones(1 << 20, device=dev)
    small = {f"t{i}": torch.randn(256 * (1 + i % 16), device=dev) for i in range(2000)}
    small["big"] = torch.randn(256 << 20, device=dev)  # 1 GiB: copies still in flight during the capture
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            y = x * 2
            try:
                fw.save(small, os.path.join(base, "in-capture"))
                res["refused"] = None
            except RuntimeError as e:
                res["refused"] = str(e)
        g.replay()
        torch.cuda.synchronize(dev)
        res["replay_ok"] = bool(torch.equal(y, x * 2))
    except Exception as e:  # noqa: BLE001 - what went wrong is the result
        res["capture_error"] = repr(e)
    res["refusal_ok"] = bool(res.get("refused") and "captured into a CUDA graph" in res["refused"]) and \
        res.get("replay_ok", False)
    # Beside a capture on this thread, a save from another thread on a stream of its own.
    w = fw.Writer()
    side = torch.cuda.Stream(dev)
    path = os.path.join(base, "beside-capture")
    with torch.cuda.stream(side):
        w.save(small, path + "-warm")  # pool pinned, gather buffers cached: no cudaMalloc below
    shutil.rmtree(path + "-warm", ignore_errors=True)
    torch.cuda.synchronize(dev)
    out: dict = {}
    started = threading.Event()

    def saver():
        try:
            with torch.cuda.stream(side):
                started.set()
                w.save(small, path)
            out["ok"] = True
        except BaseException as e:  # noqa: BLE001
            out["error"] = repr(e)
            started.set()

    cap_stream = torch.cuda.Stream(dev)
    g2 = torch.cuda.CUDAGraph()
    t = None  # capture_begin() may raise before the thread exists

    def join():
        if t is not None:
            t.join(60)
            if t.is_alive():
                res["beside_capture_hung"] = True
    try:
        with torch.cuda.stream(cap_stream):
            g2.capture_begin()  # global mode, without torch.cuda.graph's device synchronize
            t = threading.Thread(target=saver)
            t.start()
            started.wait(60)
            time.sleep(0.5)  # the save's copies land (and our threads synchronise) during the capture
            y2 = x * 3
            g2.capture_end()
        join()
        g2.replay()
        torch.cuda.synchronize(dev)
        res["beside_capture_replay_ok"] = bool(torch.equal(y2, x * 3))
    except Exception as e:  # noqa: BLE001
        res["beside_capture_error"] = repr(e)
        join()
    res["beside_capture_save"] = out
    if out.get("ok"):
        back = fw.load(path, map_location=None)
        res["beside_capture_roundtrip_ok"] = check_equal(small, back)
    res["beside_ok"] = bool(out.get("ok") and res.get("beside_capture_replay_ok") and
                            res.get("beside_capture_roundtrip_ok"))
    shutil.rmtree(path, ignore_errors=True)
    w.close()
    return res


class Results(dict):
    """The results, written to the JSON file at every change: a kill loses nothing."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def flush(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(self, wall_s=elapsed()), f, indent=1, default=str)
        os.replace(tmp, self.path)

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self.flush()

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self.flush()


def auto_gib(base: str, gpu_free: int | None = None) -> float:
    """The state size that fits: a quarter of the free disk (a checkpoint, the next one being
    written, the load's copy), a third of the available memory (the pool holds a whole copy,
    torch.load another), half of the GPU's free memory; at most 8 GiB (the 5-minute slot), at least 0.25."""
    os.makedirs(base, exist_ok=True)
    disk = shutil.disk_usage(base).free / 4
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) * 1024 / 3
    limits = [disk, mem or disk] + ([gpu_free / 2] if gpu_free else [])
    return max(0.25, min(8.0, min(limits) / 2**30))


# ------------------------------------------------------------------------ phases


class Phases:
    """Every measurement is a phase: skipped with a reason (no GPU, not enough budget
    left), measured, failed with its error, or ended by its own cap. Its record goes into
    res["phases"][name] and the JSON is rewritten as it ends. A phase over its cap gets a
    KeyboardInterrupt in the main thread; one stuck in native code past cap + grace ends
    the run (exit 3) with the JSON saying which phase hung."""

    GRACE_S = 10.0

    def __init__(self, res: "Results", budget: float, reserve_s: float, hang: str | None = None,
                 caps: dict | None = None):
        self.res, self.budget, self.reserve_s = res, budget, reserve_s
        self.hang, self.caps = hang, caps or {}
        res["phases"] = {}
        self.current: str | None = None

    def _record(self, name: str, rec: dict) -> None:
        self.res["phases"][name] = rec
        self.res.flush()

    def run(self, name: str, cap: float, fn, skip: str | None = None) -> dict:
        import _thread
        cap = float(self.caps.get(name, cap))
        left = self.budget - elapsed() - self.reserve_s
        if skip is None and left < min(cap, 10.0):
            skip = f"budget: {left:.0f} s left before the tests' share, the phase may take {cap:.0f} s"
        if skip is not None:
            log(f"{name}: skipped ({skip})")
            self._record(name, {"status": "skipped", "reason": skip})
            return self.res["phases"][name]
        cap = min(cap, max(left, 5.0))
        self._record(name, {"status": "running", "cap_s": cap, "started_s": elapsed()})
        fired = threading.Event()

        def over():
            fired.set()
            self._record(name, {"status": "timed_out", "cap_s": cap,
                                "reason": f"still running after its cap of {cap:.0f} s"})
            # a real SIGINT to the main thread: it also wakes a blocking wait (a bare
            # interrupt_main() is seen only when the next bytecode runs)
            try:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            except (OSError, ValueError):
                _thread.interrupt_main()

        def stuck():
            self.res["killed_by_budget"] = f"phase {name} still running {self.GRACE_S:.0f} s after its cap"
            log(self.res["killed_by_budget"])
            os._exit(3)

        timers = [threading.Timer(cap, over), threading.Timer(cap + self.GRACE_S, stuck)]
        for t in timers:
            t.daemon = True
            t.start()
        t0 = time.perf_counter()
        try:
            if self.hang == name:  # the tests' hook: a phase blocked for good
                threading.Event().wait()
            out = fn() or {}
            rec = {"status": "measured", **out}
        except KeyboardInterrupt:
            if not fired.is_set():
                raise
            rec = {"status": "timed_out", "reason": f"ended at its cap of {cap:.0f} s"}
        except Exception as e:  # noqa: BLE001 - the error is the result; the next phases still run
            rec = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            for t in timers:
                t.cancel()
        rec["s"] = time.perf_counter() - t0
        rec["cap_s"] = cap
        self._record(name, rec)
        log(f"{name}: {rec['status']} in {rec['s']:.1f} s " + json.dumps(
            {k: v for k, v in rec.items() if k not in ("status", "s", "cap_s")}, default=str)[:400])
        return rec


# Every phase, in the order run (the tests check each appears in the JSON).
PHASES = ["env", "state", "d2h_limit", "first_save_unprepared", "reserve", "prepared_save", "noblock_save",
          "small_tensors", "torch_save", "loads", "odirect_raw", "matmul_during_save", "incremental", "fork",
          "capture", "exit_in_flight", "gpu_tests"]
GPU_ONLY = {"d2h_limit", "incremental", "capture"}


def stats_dict(st) -> dict:
    """Every field SaveStats has (the first save's wait fields are being added: pin_s,
    a staging wait and its reason; whatever this version has is recorded)."""
    import dataclasses
    if dataclasses.is_dataclass(st):
        out = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    else:
        out = {k: v for k, v in vars(st).items() if not k.startswith("_")}
    for k in ("pin_s", "fault_s", "staging_wait_s", "staging_wait_reason", "pool_wait_s", "first_save_wait_s",
              "first_save_wait_reason"):
        if hasattr(st, k):
            out[k] = getattr(st, k)
    out.pop("settings", None)
    return {k: v for k, v in out.items() if isinstance(v, (int, float, str, bool, type(None), dict))}


def sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_save(writer, state, path: str, dev, block: bool = True) -> dict:
    sync(dev)
    t0 = time.perf_counter()
    fut = writer.save_async(state, path, block=block)
    ret = time.perf_counter() - t0
    wait = None
    if not block:
        fut.wait_staged(timeout=600)
        wait = time.perf_counter() - t0
    st = fut.result(timeout=600)
    return {"return_s": ret, "staged_wait_s": wait, **stats_dict(st)}


def small_state(n: int, dev):
    import torch
    g = torch.Generator(device=dev).manual_seed(2)
    return {f"s{i}": torch.randn(256 * (1 + (i * 37) % 16), device=dev, generator=g) for i in range(n)}


def phase_small_tensors(n: int, dev, base: str) -> dict:
    """n small tensors (1-16 KiB): fw.save with the GPU gather (coalescing) on and off,
    against a ``.to("cpu", non_blocking=True)`` loop and one synchronize."""
    import flashwrite as fw
    import flashwrite.defaults as fwd
    sd = small_state(n, dev)
    ts = list(sd.values())
    out: dict = {"tensors": n, "bytes": nbytes(ts), "device": str(dev)}
    if dev.type == "cuda":
        best = float("inf")
        for _ in range(3):
            sync(dev)
            t0 = time.perf_counter()
            outs = [t.to("cpu", non_blocking=True) for t in ts]
            sync(dev)
            best = min(best, time.perf_counter() - t0)
            del outs
        out["to_cpu_loop_s"] = best
    else:
        out["to_cpu_loop_s"] = None
        out["to_cpu_loop_note"] = "no GPU: .to('cpu') of a CPU tensor is no copy"
    keep = fwd.GATHER_TENSOR_BYTES
    with fw.Writer() as w:
        w.save(sd, os.path.join(base, "small-warm"))
        shutil.rmtree(os.path.join(base, "small-warm"), ignore_errors=True)
        for label, gather in (("coalesce_on", keep), ("coalesce_off", 0)):
            fwd.GATHER_TENSOR_BYTES = gather
            try:
                p = os.path.join(base, "small-" + label)
                r = timed_save(w, sd, p, dev)
                out[label] = {k: r.get(k) for k in ("stall_s", "staged_s", "total_s", "pin_s")}
                shutil.rmtree(p, ignore_errors=True)
            finally:
                fwd.GATHER_TENSOR_BYTES = keep
    return out


def phase_torch_save(state, base: str) -> dict:
    import torch
    path = os.path.join(base, "torch_save.pt")
    t0 = time.perf_counter()
    torch.save(state, path)
    saved = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    size = os.path.getsize(path)
    return {"path": path, "bytes": size, "save_s": saved, "durable_s": time.perf_counter() - t0,
            "gbps": size / (time.perf_counter() - t0) / 1e9}


def _flat(state, prefix: str = "") -> dict:
    import torch
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[prefix + str(k)] = v
        elif isinstance(v, dict):
            out.update(_flat(v, prefix + str(k) + "."))
    return out


def drop_page_cache(path: str) -> bool:
    """Evict path's pages (posix_fadvise DONTNEED after fsync): the buffered loads read cold too."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def phase_loads(state, dev, base: str, fw_path: str, pt_path: str | None) -> dict:
    """torch.load(map_location=dev) and safetensors' load_file(device=dev) against
    fw.load(map_location=dev) and fw.load(into=state), each file evicted from the page cache first."""
    import torch

    import flashwrite as fw
    target = "cuda:0" if dev.type == "cuda" else "cpu"
    out: dict = {"device": target}
    if pt_path and os.path.exists(pt_path):
        out["torch_load_cold"] = drop_page_cache(pt_path)
        sync(dev)
        t0 = time.perf_counter()
        back = torch.load(pt_path, map_location="cuda" if dev.type == "cuda" else "cpu", weights_only=True)
        sync(dev)
        out["torch_load_s"] = time.perf_counter() - t0
        del back
    else:
        out["torch_load_s"] = None
        out["torch_load_note"] = "no torch.save file (its phase did not run)"
    try:
        import safetensors.torch as st
        flat = {k: v.contiguous() for k, v in _flat(state).items()}
        sf = os.path.join(base, "state.safetensors")
        st.save_file(flat, sf)
        del flat
        out["safetensors_load_cold"] = drop_page_cache(sf)
        sync(dev)
        t0 = time.perf_counter()
        back = st.load_file(sf, device=target)
        sync(dev)
        out["safetensors_load_s"] = time.perf_counter() - t0
        del back
        os.unlink(sf)
    except ImportError as e:
        out["safetensors_load_s"] = None
        out["safetensors_note"] = f"safetensors not importable: {e}"
    sync(dev)
    t0 = time.perf_counter()
    back = fw.load(fw_path, map_location="cuda" if dev.type == "cuda" else "cpu")
    sync(dev)
    out["fw_load_s"] = time.perf_counter() - t0
    out["fw_load_exact"] = check_equal(state, back)
    del back
    t0 = time.perf_counter()
    fw.load(fw_path, into=state)
    sync(dev)
    out["fw_load_into_s"] = time.perf_counter() - t0
    size = nbytes(tensors_of(state))
    for k in ("torch_load_s", "safetensors_load_s", "fw_load_s", "fw_load_into_s"):
        if out.get(k):
            out[k.replace("_s", "_gbps")] = size / out[k] / 1e9
    return out


def phase_odirect_raw(base: str, nbytes_total: int, threads: int = 8, chunk: int = 16 << 20) -> dict:
    """Raw O_DIRECT write (+ fsync) and read of nbytes_total, threads files, one aligned
    buffer each: what the disk gives without flashwrite."""
    import mmap
    nbytes_total = max(chunk * threads, nbytes_total // (chunk * threads) * chunk * threads)
    per = nbytes_total // threads
    paths = [os.path.join(base, f"raw{i}") for i in range(threads)]
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(4096) * (chunk // 4096))
    errors: list[str] = []

    def work(i: int, write: bool):
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        try:
            fd = os.open(paths[i], flags | os.O_DIRECT, 0o644)
        except OSError as e:
            errors.append(f"open O_DIRECT {paths[i]}: {e}")
            return
        try:
            view = memoryview(bufs[i])
            for off in range(0, per, chunk):
                n = os.pwritev(fd, [view], off) if write else os.preadv(fd, [bufs[i]], off)
                if n != chunk:
                    errors.append(f"short {'write' if write else 'read'} {n} at {off} of {paths[i]}")
                    return
            if write:
                os.fsync(fd)
        except OSError as e:
            errors.append(f"{'write' if write else 'read'} {paths[i]}: {e}")
        finally:
            os.close(fd)

    out: dict = {"bytes": per * threads, "threads": threads, "chunk": chunk}
    for write in (True, False):
        t0 = time.perf_counter()
        ths = [threading.Thread(target=work, args=(i, write), daemon=True) for i in range(threads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(120)
        took = time.perf_counter() - t0
        out["write_s" if write else "read_s"] = took
        out["write_gbps" if write else "read_gbps"] = per * threads / took / 1e9
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
    if errors:
        out["errors"] = errors[:4]
    return out


def phase_matmul(writer_opts: dict, state, dev, base: str, steps: int = 20) -> dict:
    """Median step time of a matmul loop alone, during a block=False save (from return
    to committed) and during a background reserve() of a new Writer."""
    import torch

    import flashwrite as fw
    n = 8192 if dev.type == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)

    def step():
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(4):
            (a @ a).sum()
        sync(dev)
        return time.perf_counter() - t0

    def loop(done=lambda: False, most=steps):
        times = []
        while len(times) < most and not (times and done()):
            times.append(step())
        return times

    for _ in range(3):
        step()  # warm up (cuBLAS handles, clocks)
    alone = loop()
    out: dict = {"device": str(dev), "matmul_n": n, "alone_step_s": statistics.median(alone)}
    with fw.Writer(**writer_opts) as w:
        w.reserve(state, block=True)
        path = os.path.join(base, "matmul-save")
        fut = w.save_async(state, path, block=False)
        during = loop(fut.done, most=100_000)
        fut.result(timeout=600)
        out["during_save_steps"] = len(during)
        out["during_save_step_s"] = statistics.median(during)
        shutil.rmtree(path, ignore_errors=True)
    with fw.Writer(**writer_opts) as w:
        fut = w.reserve(state, block=False)
        during = loop(fut.done, most=100_000)
        fut.result(timeout=600)
        out["during_reserve_steps"] = len(during)
        out["during_reserve_step_s"] = statistics.median(during)
    out["save_slowdown"] = out["during_save_step_s"] / out["alone_step_s"]
    out["reserve_slowdown"] = out["during_reserve_step_s"] / out["alone_step_s"]
    return out


EXIT_CHILD = r"""
import json, os, sys, time, torch, flashwrite as fw
dev, mib, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sd = {f"t{i}": torch.randn(mib << 16, device=dev) for i in range(4)}  # 4 x mib MiB of fp32
w = fw.Writer()
fut = w.save_async(sd, path, block=False)
print(json.dumps({"started": time.time()}), flush=True)
sys.exit(0)  # the save is in flight: interpreter exit must finish or abandon it cleanly, not hang
"""


def phase_exit_in_flight(dev, base: str, mib: int, cap: float) -> dict:
    """A child process starts a block=False save and exits at once; it must end (by
    itself) within the cap, and its checkpoint either load or not exist (never half)."""
    import flashwrite as fw
    path = os.path.join(base, "exit-in-flight")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", EXIT_CHILD, str(dev), str(mib), path], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        so, se = p.communicate(timeout=max(5.0, cap - 10))
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        so, se = p.communicate(timeout=10)
        hung = True
    out: dict = {"child_rc": p.returncode, "child_hung": hung, "exit_s": time.perf_counter() - t0,
                 "bytes": 4 * (mib << 20), "stderr_tail": se[-600:]}
    if os.path.exists(path):
        try:
            back = fw.load(path)
            out["checkpoint"] = "committed"
            out["checkpoint_tensors"] = len(back)
        except Exception as e:  # noqa: BLE001
            out["checkpoint"] = f"present but does not load: {type(e).__name__}: {e}"[:300]
    else:
        out["checkpoint"] = "absent"
    leftovers = [n for n in os.listdir(base) if n.startswith("exit-in-flight") and n != "exit-in-flight"]
    out["leftovers"] = leftovers
    out["ok"] = (not hung and p.returncode == 0 and out["checkpoint"] in ("committed", "absent"))
    shutil.rmtree(path, ignore_errors=True)
    return out


def measure(args, res: "Results", ph: Phases) -> None:
    import torch

    import flashwrite as fw
    base = os.path.abspath(args.dir or os.path.join(REPO, "build", "gpu-check", "ckpt"))
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    gpu = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    no_gpu = None if gpu else (f"no CUDA GPU visible to PyTorch {torch.__version__} (CUDA {torch.version.cuda})"
                               if not args.cpu else "--cpu given")
    res["device"] = str(dev)
    if no_gpu:
        res["skipped"] = no_gpu + ": GPU-only phases skipped, the others run on CPU tensors"
        log(res["skipped"])
    ctx: dict = {}
    wopts = json.loads(args.writer_options)

    def env():
        out = {"flashwrite_file": fw.__file__, "flashwrite_version": fw.__version__, "torch": torch.__version__,
               "torch_cuda": torch.version.cuda, "fs": fs_of(base), "dir": base}
        if gpu:
            torch.cuda.init()
            out["gpu"] = torch.cuda.get_device_name(dev)
        if args.built and not os.path.realpath(fw.__file__).startswith(os.path.realpath(SITE)):
            out["warning"] = f"an installed flashwrite ({fw.__file__}) shadows the fresh build in {SITE}"
        info = fw.backend_info(base, initialize_cuda=gpu)
        out["backend_info"] = info
        out["runtime_already_loaded"] = info["cuda"].get("via") == "already loaded"
        if gpu and not info["cuda"]["available"]:
            raise RuntimeError(f"flashwrite cannot use CUDA here: {info['cuda']['reason']}")
        return out

    ph.run("env", 30, env)

    def state():
        gib = args.gib if args.gib is not None else auto_gib(base, torch.cuda.mem_get_info(dev)[0] if gpu else None)
        ctx["state"] = make_state(gib, dev, min(args.small, 256))
        ts = tensors_of(ctx["state"])
        ctx["bytes"] = nbytes(ts)
        return {"gib": gib, "bytes": ctx["bytes"], "tensors": len(ts), "device": str(dev)}

    if ph.run("state", 60, state)["status"] != "measured":
        for name in PHASES[2:-1]:
            ph.run(name, 1, None, skip="no state (the state phase did not finish)")
        return
    st = ctx["state"]

    def d2h():
        return d2h_limits(tensors_of(st), dev, int(args.limit_gib * (1 << 30)))

    r = ph.run("d2h_limit", 40, d2h, skip=no_gpu)
    d2h_gbps = max(r.get("d2h_copy_pinned_gbps", 0), r.get("d2h_to_cpu_gbps", 0)) or None

    def first():
        w = fw.Writer(**wopts)  # unprepared: no reserve(), the pool is allocated, faulted and pinned in the save
        try:
            p = os.path.join(base, "first")
            out = timed_save(w, st, p, dev)
            out["roundtrip_ok"] = check_equal(st, fw.load(p, map_location=None))
            stall, pin = out.get("stall_s") or 0.0, out.get("pin_s") or 0.0
            out["fault_s_estimate"] = stall - pin - (ctx["bytes"] / d2h_gbps / 1e9 if d2h_gbps else 0.0)
            shutil.rmtree(p, ignore_errors=True)
            return out
        finally:
            w.close()

    ph.run("first_save_unprepared", 60, first)
    ctx["writer"] = fw.Writer(**wopts)
    w = ctx["writer"]

    def reserve():
        before = {lo for lo, _, _ in _vmas()}
        t0 = time.perf_counter()
        w.reserve(st, block=True)
        out = {"reserve_s": time.perf_counter() - t0, "pool_bytes": w.pool_bytes,
               "pool_pinned": w._engine.pool_pinned, "pin_error": w._engine.pin_error}
        new = [(lo, hi) for lo, hi, _ in _vmas() if lo not in before and hi - lo >= 64 << 20]
        out["pool_numa_pages"] = _numa_nodes(new)
        if gpu:
            out["gpu_numa_node"] = _gpu_numa_node(dev)
        out["pool_numa_node"] = w._engine.pool_numa_node
        out["pool_numa_error"] = w._engine.pool_numa_error
        return out

    ph.run("reserve", 60, reserve)

    def prepared():
        rounds = []
        for i in range(args.rounds):
            p = os.path.join(base, f"r{i}")
            rounds.append(timed_save(w, st, p, dev))
            shutil.rmtree(p, ignore_errors=True)  # one checkpoint on disk at a time
        stalls = [x["stall_s"] for x in rounds]
        out = {"rounds": rounds, "stall_best_s": min(stalls), "stall_median_s": statistics.median(stalls),
               "durable_best_s": min(x["durable_s"] for x in rounds),
               "total_best_s": min(x["total_s"] for x in rounds)}
        if d2h_gbps:
            limit_s = ctx["bytes"] / d2h_gbps / 1e9
            out["d2h_limit_s"] = limit_s
            out["stall_x_d2h"] = out["stall_best_s"] / limit_s
        else:
            out["stall_x_d2h"] = None
            out["stall_x_d2h_note"] = "no D2H limit measured"
        out["write_gbps"] = ctx["bytes"] / out["total_best_s"] / 1e9
        return out

    ph.run("prepared_save", 60, prepared)

    def noblock():
        p = os.path.join(base, "keep")
        out = timed_save(w, st, p, dev, block=False)
        ctx["fw_path"] = p
        return out

    ph.run("noblock_save", 40, noblock)
    ph.run("small_tensors", 40, lambda: phase_small_tensors(args.small, dev, base))
    ph.run("torch_save", 40, lambda: phase_torch_save(st, base))
    pt = os.path.join(base, "torch_save.pt")
    ph.run("loads", 60, lambda: phase_loads(st, dev, base, ctx["fw_path"], pt),
           skip=None if "fw_path" in ctx else "no flashwrite checkpoint (noblock_save did not finish)")
    for p in (pt, ctx.get("fw_path")):
        if p:
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else (os.path.exists(p) and os.unlink(p))
    ph.run("odirect_raw", 30, lambda: phase_odirect_raw(base, min(ctx["bytes"], 4 << 30)))
    ph.run("matmul_during_save", 60, lambda: phase_matmul(wopts, st, dev, base))

    def incremental():
        torch.cuda.empty_cache()
        out = incremental_check(dev, base)
        if not out.get("ok"):
            raise RuntimeError(f"incremental check failed: {json.dumps(out, default=str)[:300]}")
        return out

    ph.run("incremental", 40, incremental, skip=no_gpu)
    ph.run("fork", 40, lambda: fork_check(w, st, base, "yes"))
    w.close()
    ctx.pop("state", None)
    st = None
    if gpu:
        torch.cuda.empty_cache()
    ph.run("capture", 40, lambda: capture_check(dev, base), skip=no_gpu)
    ph.run("exit_in_flight", 40, lambda: phase_exit_in_flight(dev, base, 256 if gpu else 4, 40))
    shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------ table


def _summary(name: str, r: dict) -> str:
    keys = {"env": ("gpu", "runtime_already_loaded", "fs"), "state": ("gib", "tensors", "device"),
            "d2h_limit": ("d2h_copy_pinned_gbps", "d2h_to_cpu_gbps", "h2d_copy_pinned_gbps"),
            "first_save_unprepared": ("stall_s", "pin_s", "fault_s_estimate", "staging_wait_s",
                                      "staging_wait_reason", "pinned", "roundtrip_ok"),
            "reserve": ("reserve_s", "pool_pinned", "pool_numa_pages"),
            "prepared_save": ("stall_best_s", "stall_x_d2h", "total_best_s", "write_gbps"),
            "noblock_save": ("return_s", "staged_wait_s", "total_s"),
            "small_tensors": ("tensors", "to_cpu_loop_s", "coalesce_on", "coalesce_off"),
            "torch_save": ("durable_s", "gbps"),
            "loads": ("torch_load_s", "safetensors_load_s", "fw_load_s", "fw_load_into_s", "fw_load_exact"),
            "odirect_raw": ("write_gbps", "read_gbps", "errors"),
            "matmul_during_save": ("alone_step_s", "save_slowdown", "reserve_slowdown"),
            "incremental": ("ok", "roundtrip_ok"), "fork": ("fork_s", "child_exit", "ok"),
            "capture": ("refusal_ok", "beside_ok"), "exit_in_flight": ("child_rc", "exit_s", "checkpoint", "ok"),
            "gpu_tests": ("tests_summary", "tests_rc")}.get(name, ())

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}={fmt(x)}" for k, x in v.items() if x is not None) + "}"
        return str(v)
    if r.get("status") != "measured":
        return (r.get("reason") or r.get("error") or "")[:160]
    return ", ".join(f"{k}={fmt(r[k])}" for k in keys if r.get(k) is not None)[:300]


def table(res: dict) -> str:
    rows = [(name, r.get("status", "?"), f"{r.get('s', 0):.1f}", _summary(name, r))
            for name, r in res.get("phases", {}).items()]
    lines = ["| phase | status | s | result |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d.replace('|', '/')} |" for a, b, c, d in rows]
    return "\n".join(lines)


def verdict(res: dict) -> bool:
    ph = res.get("phases", {})
    bad = [n for n, r in ph.items() if r.get("status") in ("error", "timed_out", "running")]
    if ph.get("gpu_tests", {}).get("tests_rc", 0) not in (0, None):
        bad.append("gpu_tests")
    for n, key in (("first_save_unprepared", "roundtrip_ok"), ("fork", "ok"), ("capture", "refusal_ok"),
                   ("capture", "beside_ok"), ("exit_in_flight", "ok"), ("loads", "fw_load_exact")):
        if ph.get(n, {}).get("status") == "measured" and not ph[n].get(key):
            bad.append(f"{n}.{key}")
    res["failed"] = bad
    return not bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=None,
                    help="size of the state (default: what free disk, memory and GPU memory allow, <= 8)")
    ap.add_argument("--small", type=int, default=50_000, help="small tensors (1-16 KiB) of the small_tensors phase")
    ap.add_argument("--limit-gib", type=float, default=4.0, help="GiB of the state the D2H/H2D limits copy")
    ap.add_argument("--rounds", type=int, default=3, help="timed prepared saves (default 3)")
    ap.add_argument("--dir", help="where checkpoints go (default build/gpu-check/ckpt in the repo; not tmpfs)")
    ap.add_argument("--writer-options", default="{}", help='JSON for fw.Writer, e.g. \'{"stripes": 8}\'')
    ap.add_argument("--no-build", action="store_true", help="use the flashwrite already importable")
    ap.add_argument("--cpu", action="store_true", help="run the phases on CPU tensors even with a GPU")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--all-tests", action="store_true", help="also the stand-in CUDA runtime tests")
    ap.add_argument("--test-timeout", type=float, default=90, help="cap on the GPU tests, run last (default 90)")
    ap.add_argument("--budget", type=float, default=290,
                    help="seconds the whole run may take (default 290); then it writes what it has and exits 3")
    ap.add_argument("--caps", default="{}", help='JSON {phase: seconds} overriding phase caps')
    ap.add_argument("--hang", help=argparse.SUPPRESS)  # tests: this phase never ends (its cap must end it)
    ap.add_argument("--json", help="write the results here (default $OUT/gpu_check.json when $OUT is set)")
    ap.add_argument("--md", help="write the table here (default $OUT/gpu_check.md when $OUT is set)")
    args = ap.parse_args()
    # A phase's cap ends it with SIGINT -> KeyboardInterrupt. A process started with SIGINT
    # ignored (a background job of a non-interactive shell, as CI and remote runners start
    # scripts) gets no KeyboardInterrupt from Python: every capped phase then ran into the
    # 10 s grace and exit 3. Install Python's handler whatever was inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    outdir = os.environ.get("OUT")
    out = args.json or (os.path.join(outdir, "gpu_check.json") if outdir else None)
    md = args.md or (os.path.join(outdir, "gpu_check.md") if outdir else None)
    res = Results(out)
    res["budget_s"] = args.budget
    res["phase_names"] = PHASES

    def over_budget():  # never hangs: whatever is stuck, the results so far are kept
        res["killed_by_budget"] = f"still running after {args.budget:.0f} s"
        log(res["killed_by_budget"] + "; results so far in " + str(out))
        if md:
            with open(md, "w") as f:
                f.write(table(res) + f"\n\nkilled: {res['killed_by_budget']}\n")
        os._exit(3)

    watchdog = threading.Timer(args.budget, over_budget)
    watchdog.daemon = True
    watchdog.start()
    args.built = not args.no_build
    if args.built:
        res.update(build())
        use_site()
    tests_share = 0 if args.skip_tests else min(args.test_timeout, 60)
    ph = Phases(res, args.budget, tests_share + 5, hang=args.hang, caps=json.loads(args.caps))
    measure(args, res, ph)
    ph.reserve_s = 5
    if args.skip_tests:
        ph.run("gpu_tests", 1, None, skip="--skip-tests")
    else:  # last, capped by what is left of the budget
        left = args.budget - elapsed() - 10
        ph.run("gpu_tests", min(args.test_timeout, max(left, 1)) + 5,
               lambda: run_tests(min(args.test_timeout, left), args.all_tests),
               skip=None if left > 20 else f"no time left ({left:.0f} s)")
    watchdog.cancel()
    res["wall_s"] = elapsed()
    ok = verdict(res)
    res.flush()
    text = table(res)
    print()
    print(text, flush=True)
    if md:
        with open(md, "w") as f:
            f.write(f"# gpu_check ({res.get('device')}, {res['wall_s']:.0f} s)\n\n{text}\n\n"
                    f"failed: {res['failed'] or 'none'}\n")
    print(f"\ngpu_check: {'OK' if ok else 'FAILED ' + str(res['failed'])} in {res['wall_s']:.0f} s"
          + (" (no GPU: GPU-only phases skipped)" if "skipped" in res else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
