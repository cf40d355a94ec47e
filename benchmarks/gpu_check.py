#!/usr/bin/env python3
"""One script for a short slot on a GPU machine: build flashwrite, run its CUDA tests,
measure the GPU data path, run the GPU tests last (capped), print a table. One call of
at most 5 minutes on one H200 (16 cores, 128 GiB RAM, 64 GiB disk): the state is sized
from free disk, memory and GPU memory (at most 16 GiB), the JSON is rewritten after
every result, and a watchdog ends the run at --budget (exit 3) with what it has.
With no GPU it runs its CPU-only checks (fork beside the pool), says what it skipped
and exits 0.

    python benchmarks/gpu_check.py                  # build + tests + measurements
    python benchmarks/gpu_check.py --gib 8 --dir /nvme/scratch
    python benchmarks/gpu_check.py --no-build       # use the flashwrite already importable

Needs: Python with PyTorch (CUDA build), pybind11, scikit-build-core and CMake; no
network (the build uses --no-build-isolation --no-index --no-deps, falls back to the
thread-pool I/O backend without liburing and to third_party/xxhash without
libxxhash-dev). The build goes to build/gpu-check/site (PYTHONPATH for the children),
so nothing is installed into the system's site-packages.

What it measures, for a state of --gib GiB on cuda:0 (bf16 matrices, fp32 optimizer
state, --small small tensors of 1-16 KiB):

- reserve(): the pool allocated, faulted in and pinned ahead of the first save, timed;
  asserts the pool is pinned and that the CUDA runtime flashwrite uses is PyTorch's
  ("already loaded"); the NUMA nodes of the pool's pages against the GPU's node.
- H2D limit: pinned host memory ``copy_``'d to the GPU (the baseline for loads).
- fork: fork() beside the pinned pool (timed), a child that saves on the CPU, and the
  parent's next save byte-exact; the pool's slabs carry the ``dc`` (MADV_DONTFORK) flag.
- graph capture: a save inside ``torch.cuda.graph`` is refused with a clear error and
  the capture still replays; a save on another thread while a global-mode capture is
  open leaves the capture valid.
- D2H limit: every tensor ``copy_``'d into preallocated pinned host memory with
  non_blocking=True, and PyTorch's ``tensor.to("cpu", non_blocking=True)`` (which uses
  its pinned caching host allocator), each followed by one synchronize; best of 3, on
  at most --limit-gib GiB of the state (host memory: the pool holds a whole copy too).
- save_async stall (block=True): how long the training loop is blocked; best and median
  of --rounds saves after one warm-up save (the warm-up allocates and pins the pool,
  reported as "first save").
- save_async(block=False): time to return, then wait_staged().
- time to durable (every stripe fsync'd) and to committed, with GB/s.
- incremental: a LoRA-shaped GPU state saved four times with incremental=True; the
  last save links the frozen base's stripes (held files, gpu_incremental_check.py),
  loads back byte-exact and verifies.
- load to the GPU: ``load(map_location="cuda:0")`` and ``load(into=<gpu state>)``;
  O_DIRECT reads do not go through the page cache, so they are cold reads whenever
  the file system honours O_DIRECT (the table says whether it did).

Every checkpoint is checked byte for byte against the GPU state once. A JSON copy of
the results goes to --json, or to $OUT/gpu_check.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/system/test_cuda.py"]
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
    torch.cuda.synchronize(device)
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


def cpu_checks(base: str) -> dict:
    """What runs without a GPU: fork() beside a reserved (unpinned) pool."""
    import flashwrite as fw
    w = fw.Writer()
    w.reserve(256 << 20, block=True)
    res = fork_check(w, None, base, None)
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
    torch.load another), half of the GPU's free memory; at most 16 GiB, at least 0.25."""
    os.makedirs(base, exist_ok=True)
    disk = shutil.disk_usage(base).free / 4
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) * 1024 / 3
    limits = [disk, mem or disk] + ([gpu_free / 2] if gpu_free else [])
    return max(0.25, min(16.0, min(limits) / 2**30))


def measure(args, res: dict | None = None) -> dict:
    import torch

    import flashwrite as fw
    res = {} if res is None else res
    base = os.path.abspath(args.dir or os.path.join(REPO, "build", "gpu-check", "ckpt"))
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    if not torch.cuda.is_available():
        res["skipped"] = (f"no CUDA GPU visible to PyTorch {torch.__version__} (CUDA {torch.version.cuda}): "
                          "GPU measurements skipped")
        log(res["skipped"])
        res["cpu_fork"] = cpu_checks(base)
        log(f"CPU-only: fork beside a 256 MiB pool {res['cpu_fork']['fork_s'] * 1e3:.2f} ms, "
            f"child save exit {res['cpu_fork']['child_exit']}, dont-fork bytes {res['cpu_fork']['dont_fork_bytes']}")
        shutil.rmtree(base, ignore_errors=True)
        return res
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    res["flashwrite_file"] = fw.__file__
    if args.built and not os.path.realpath(fw.__file__).startswith(os.path.realpath(SITE)):
        log(f"WARNING: an installed flashwrite ({fw.__file__}) shadows the fresh build in {SITE}")
    res["gpu"] = torch.cuda.get_device_name(dev)
    res["torch"] = torch.__version__
    res["torch_cuda"] = torch.version.cuda
    info = fw.backend_info(base, initialize_cuda=True)
    res["backend_info"] = info
    res["fs"] = fs_of(base)
    log(f"flashwrite {fw.__version__} from {fw.__file__}; cuda={json.dumps(info['cuda'])}")
    log(f"io backend={info['backend']} direct_io={info['direct_io']} dir={base} fs={res['fs']}")
    if not info["cuda"]["available"]:
        raise SystemExit(f"flashwrite cannot use CUDA here: {info['cuda']['reason']}")
    res["runtime_already_loaded"] = info["cuda"]["via"] == "already loaded"
    log(f"runtime found already loaded (PyTorch's): {res['runtime_already_loaded']}")

    if args.gib is None:
        args.gib = auto_gib(base, torch.cuda.mem_get_info(dev)[0])
    res["gib"] = args.gib
    state = make_state(args.gib, dev, args.small)
    ts = tensors_of(state)
    size = nbytes(ts)
    res["state_bytes"], res["state_tensors"] = size, len(ts)
    log(f"state: {size / 2**30:.2f} GiB in {len(ts)} tensors on {res['gpu']}")
    res.update(d2h_limits(ts, dev, int(args.limit_gib * (1 << 30))))
    log(f"D2H limit: copy_ into pinned {res['d2h_copy_pinned_gbps']:.1f} GB/s, .to(cpu, non_blocking) "
        f"{res['d2h_to_cpu_gbps']:.1f} GB/s; H2D from pinned {res['h2d_copy_pinned_gbps']:.1f} GB/s "
        f"(on {res['limit_bytes'] / 2**30:.1f} GiB)")

    writer = fw.Writer(**json.loads(args.writer_options))
    res["writer"] = repr(writer)
    before = {lo for lo, _, _ in _vmas()}
    t0 = time.perf_counter()
    writer.reserve(state, block=True)
    res["reserve_s"] = time.perf_counter() - t0
    res["pool_pinned"] = writer._engine.pool_pinned
    res["pin_error"] = writer._engine.pin_error
    new = [(lo, hi) for lo, hi, _ in _vmas() if lo not in before and hi - lo >= 64 << 20]
    res["pool_numa_pages"] = _numa_nodes(new)
    res["gpu_numa_node"] = _gpu_numa_node(dev)
    res["pool_numa_node"] = writer._engine.pool_numa_node      # the node flashwrite asked for (mbind)
    res["pool_numa_error"] = writer._engine.pool_numa_error
    log(f"reserve(): {res['reserve_s']:.2f} s for {writer.pool_bytes / 2**30:.2f} GiB, pinned={res['pool_pinned']} "
        f"{res['pin_error'] or ''}; pool pages per NUMA node {res['pool_numa_pages']}, GPU on node "
        f"{res['gpu_numa_node']} (pool asked for node {res['pool_numa_node']}: {res['pool_numa_error'] or 'placed'})")
    rounds = []

    def one_save(name: str, block: bool = True) -> dict:
        path = os.path.join(base, name)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fut = writer.save_async(state, path, block=block)
        ret = time.perf_counter() - t0
        wait = None
        if not block:
            fut.wait_staged()
            wait = time.perf_counter() - t0
        st = fut.result()
        return {"path": path, "return_s": ret, "staged_wait_s": wait, "stall_s": st.stall_s, "staged_s": st.staged_s,
                "durable_s": st.durable_s, "total_s": st.total_s, "backend": st.backend, "direct": st.direct,
                "pinned": st.pinned, "pool_bytes": st.pool_bytes, "pin_s": st.pin_s}

    first = one_save("first")
    res["first_save"] = first
    log(f"first save (after reserve): stall {first['stall_s']:.3f} s, committed {first['total_s']:.2f} s, "
        f"pinned={first['pinned']}")
    back = fw.load(first["path"], map_location=None)
    res["roundtrip_ok"] = check_equal(state, back)
    del back
    log(f"round trip byte-exact on the GPU: {res['roundtrip_ok']}")
    shutil.rmtree(first["path"])

    res["fork"] = fork_check(writer, state, base, "yes")
    log(f"fork beside the pinned pool: {res['fork']['fork_s'] * 1e3:.2f} ms; child save exit "
        f"{res['fork']['child_exit']}; parent byte-exact after: {res['fork'].get('parent_roundtrip_ok')}; "
        f"dont-fork bytes {res['fork']['dont_fork_bytes'] / 2**30:.2f} GiB")

    for i in range(args.rounds):
        if elapsed() > args.budget - 150:
            log("time budget: fewer save rounds")
            break
        r = one_save(f"r{i}")
        rounds.append(r)
        log(f"save {i}: stall {r['stall_s']:.3f} s, durable {r['durable_s']:.2f} s, committed {r['total_s']:.2f} s")
        shutil.rmtree(r["path"])  # one checkpoint on disk at a time: 32 GiB twice may not fit
    res["rounds"] = rounds

    nb = one_save("noblock", block=False)
    res["noblock"] = nb
    log(f"block=False: returned in {nb['return_s'] * 1e3:.1f} ms, wait_staged after {nb['staged_wait_s']:.3f} s")
    keep = nb["path"]

    loads, intos, hosts = [], [], []
    for i in range(2):
        if elapsed() > args.budget - 90 and loads:
            break
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fw.load(keep, map_location="cuda:0")
        torch.cuda.synchronize(dev)
        loads.append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        fw.load(keep, into=state)
        torch.cuda.synchronize(dev)
        intos.append(time.perf_counter() - t0)
        # The host load beside them: the same reader, the same bounce path (issue 23).
        t0 = time.perf_counter()
        out = fw.load(keep)
        hosts.append(time.perf_counter() - t0)
        del out
    res["load_map_location_s"], res["load_into_s"], res["load_host_s"] = loads, intos, hosts
    log(f"load to cuda:0: {min(loads):.2f} s; into= the GPU state: {min(intos):.2f} s; "
        f"to the host: {min(hosts):.2f} s")
    shutil.rmtree(keep, ignore_errors=True)
    writer.close()
    state = ts = None  # freed before the capture check; one_save still closes over the name
    torch.cuda.empty_cache()
    try:
        res["incremental"] = incremental_check(dev, base)
    except Exception as e:  # reported in the table, the other checks still run
        res["incremental"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    log(f"incremental: {res['incremental']}")
    torch.cuda.empty_cache()
    res["capture"] = capture_check(dev, base)
    log(f"capture: save inside torch.cuda.graph refused={res['capture']['refusal_ok']}; save beside a global "
        f"capture ok={res['capture']['beside_ok']} {res['capture'].get('beside_capture_error', '')}")
    shutil.rmtree(base, ignore_errors=True)
    return res


# ------------------------------------------------------------------------ table


def table(res: dict) -> str:
    rows = []
    if "skipped" in res:
        f = res["cpu_fork"]
        rows.append(("GPU measurements", "skipped", res["skipped"]))
        rows.append(("fork beside a 256 MiB pool", f"{f['fork_s'] * 1e3:.2f} ms",
                     f"child save exit {f['child_exit']}, dont-fork {f['dont_fork_bytes'] >> 20} MiB"))
    else:
        gb = res["state_bytes"] / 1e9
        rows.append(("state", f"{res['state_bytes'] / 2**30:.2f} GiB, {res['state_tensors']} tensors", res["gpu"]))

        def speed(s):
            return f"{gb / s:.1f} GB/s" if s else ""

        lim = gb / max(res["d2h_copy_pinned_gbps"], res["d2h_to_cpu_gbps"])  # seconds at the D2H limit
        rows.append(("D2H limit: copy_ into pinned", f"{res['d2h_copy_pinned_gbps']:.1f} GB/s",
                     f".to('cpu', non_blocking) {res['d2h_to_cpu_gbps']:.1f} GB/s"))
        rows.append(("H2D limit: copy_ from pinned", f"{res['h2d_copy_pinned_gbps']:.1f} GB/s", "the loads' baseline"))
        rows.append(("reserve()", f"{res['reserve_s']:.2f} s", f"pinned={res['pool_pinned']} {res['pin_error'] or ''}"))
        rows.append(("runtime", "already loaded" if res["runtime_already_loaded"] else "NOT PyTorch's",
                     str(res["backend_info"]["cuda"]["library"])))
        rows.append(("NUMA", f"pool pages {res['pool_numa_pages']}", f"GPU node {res['gpu_numa_node']}"))
        stalls = [r["stall_s"] for r in res["rounds"]] or [res["first_save"]["stall_s"]]
        rows.append(("save_async stall (block=True)", f"{min(stalls):.3f} s best, {statistics.median(stalls):.3f} med",
                     f"{min(stalls) / lim:.2f}x D2H limit (goal <= 1.5x)"))
        nb = res["noblock"]
        rows.append(("save_async(block=False) return", f"{nb['return_s'] * 1e3:.1f} ms",
                     f"wait_staged() after {nb['staged_wait_s']:.3f} s"))
        rows.append(("first save stall (after reserve)", f"{res['first_save']['stall_s']:.3f} s",
                     f"pool {res['first_save']['pool_bytes'] / 2**30:.2f} GiB, pin_s={res['first_save']['pin_s']}"))
        durable = [r["durable_s"] for r in res["rounds"]] or [res["first_save"]["durable_s"]]
        total = [r["total_s"] for r in res["rounds"]] or [res["first_save"]["total_s"]]
        last = (res["rounds"] or [res["first_save"]])[-1]
        rows.append(("time to durable", f"{min(durable):.2f} s best", speed(min(durable))))
        rows.append(("time to committed", f"{min(total):.2f} s best", f"{speed(min(total))}, {last['backend']}, "
                     f"direct={last['direct']}"))
        rows.append(("load map_location='cuda:0'", f"{min(res['load_map_location_s']):.2f} s",
                     speed(min(res["load_map_location_s"]))))
        rows.append(("load into= GPU state", f"{min(res['load_into_s']):.2f} s", speed(min(res["load_into_s"]))))
        if res.get("load_host_s"):
            rows.append(("load to the host (owned)", f"{min(res['load_host_s']):.2f} s", speed(min(res["load_host_s"]))))
        rows.append(("round trip byte-exact", str(res["roundtrip_ok"]), ""))
        f = res["fork"]
        rows.append(("fork beside the pinned pool", f"{f['fork_s'] * 1e3:.2f} ms",
                     f"child save exit {f['child_exit']}, parent exact after {f.get('parent_roundtrip_ok')}, "
                     f"dont-fork {f['dont_fork_bytes'] / 2**30:.1f} GiB"))
        c = res["capture"]
        rows.append(("save inside torch.cuda.graph", "refused" if c["refusal_ok"] else "NOT REFUSED",
                     (c.get("refused") or c.get("capture_error") or "")[:60]))
        rows.append(("save beside a global capture", "capture valid" if c["beside_ok"] else "FAILED",
                     str(c.get("beside_capture_error") or c.get("beside_capture_save"))[:60]))
        inc = res.get("incremental", {})
        last = (inc.get("saves") or [{}])[-1]
        rows.append(("incremental GPU save (4th)", "linked" if inc.get("ok") else "FAILED",
                     inc.get("error") or f"{last.get('bytes_linked', 0) >> 20} MiB linked, "
                     f"{last.get('bytes_written', 0) >> 20} MiB written, exact={inc.get('roundtrip_ok')}"))
        rows.append(("storage", res["fs"], f"io={res['backend_info']['backend']}"))
    if "tests_summary" in res:
        rows.append(("tests/system/test_cuda.py", res["tests_summary"], f"rc={res['tests_rc']}"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'what'.ljust(w0)} | {'value'.ljust(w1)} | note", f"{'-' * w0}-|-{'-' * w1}-|-----"]
    lines += [f"{a.ljust(w0)} | {b.ljust(w1)} | {c}" for a, b, c in rows]
    return "\n".join(lines)


def verdict(res: dict) -> bool:
    if res.get("tests_rc", 0) != 0:
        return False
    if "skipped" in res:
        return res["cpu_fork"]["ok"]
    return bool(res["roundtrip_ok"] and res["pool_pinned"] and res["runtime_already_loaded"] and res["fork"]["ok"]
                and res["capture"]["refusal_ok"] and res["capture"]["beside_ok"]
                and res.get("incremental", {}).get("ok", False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=None,
                    help="size of the GPU state (default: what free disk, memory and GPU memory allow, <= 16)")
    ap.add_argument("--small", type=int, default=50_000, help="small tensors (1-16 KiB) in it (default 50000)")
    ap.add_argument("--limit-gib", type=float, default=4.0, help="GiB of the state the D2H/H2D limits copy")
    ap.add_argument("--rounds", type=int, default=3, help="timed saves after the warm-up (default 3)")
    ap.add_argument("--dir", help="where checkpoints go (default build/gpu-check/ckpt in the repo; not tmpfs)")
    ap.add_argument("--writer-options", default="{}", help='JSON for fw.Writer, e.g. \'{"stripes": 8}\'')
    ap.add_argument("--no-build", action="store_true", help="use the flashwrite already importable")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--all-tests", action="store_true", help="also the stand-in CUDA runtime tests of test_cuda.py")
    ap.add_argument("--test-timeout", type=float, default=90, help="cap on the GPU tests, run last (default 90)")
    ap.add_argument("--budget", type=float, default=290,
                    help="seconds the whole run may take (default 290); then it writes what it has and exits 3")
    ap.add_argument("--json", help="write the results here (default $OUT/gpu_check.json when $OUT is set)")
    args = ap.parse_args()

    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    res = Results(out)
    res["budget_s"] = args.budget

    def over_budget():  # never hangs: whatever is stuck, the results so far are kept
        res["killed_by_budget"] = f"still running after {args.budget:.0f} s"
        log(res["killed_by_budget"] + "; results so far in " + str(out))
        os._exit(3)

    watchdog = threading.Timer(args.budget, over_budget)
    watchdog.daemon = True
    watchdog.start()
    args.built = not args.no_build
    if args.built:
        res.update(build())
        use_site()
    measure(args, res)
    if not args.skip_tests:  # last, capped by what is left of the budget
        left = args.budget - elapsed() - 15
        if left > 20:
            res.update(run_tests(min(args.test_timeout, left), args.all_tests))
        else:
            res["tests_skipped"] = f"no time left ({left:.0f} s)"
    watchdog.cancel()
    res["wall_s"] = elapsed()
    print()
    print(table(res), flush=True)
    ok = verdict(res)
    print(f"\ngpu_check: {'OK' if ok else 'FAILED'} in {res['wall_s']:.0f} s"
          + (" (CPU-only checks: no GPU)" if "skipped" in res else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
