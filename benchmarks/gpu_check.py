#!/usr/bin/env python3
"""One script for a short slot on a GPU machine: build flashwrite, run its CUDA tests,
measure the GPU data path, print a table last. Meant to finish in well under 5 minutes
on one H200 with the defaults (a 4 GiB state).

    python benchmarks/gpu_check.py                  # build + tests + measurements
    python benchmarks/gpu_check.py --gib 8 --dir /nvme/scratch
    python benchmarks/gpu_check.py --no-build       # use the flashwrite already importable

Needs: Python with PyTorch (CUDA build), pybind11, scikit-build-core and CMake; no
network (the build uses --no-build-isolation --no-index --no-deps, falls back to the
thread-pool I/O backend without liburing and to third_party/xxhash without
libxxhash-dev). The build goes to build/gpu-check/site (PYTHONPATH for the children),
so nothing is installed into the system's site-packages.

What it measures, for a state of --gib GiB on cuda:0 (bf16 matrices, fp32 optimizer
state, a few hundred small tensors):

- D2H limit: every tensor ``copy_``'d into preallocated pinned host memory with
  non_blocking=True, and PyTorch's ``tensor.to("cpu", non_blocking=True)`` (which uses
  its pinned caching host allocator), each followed by one synchronize; best of 3.
- save_async stall (block=True): how long the training loop is blocked; best and median
  of --rounds saves after one warm-up save (the warm-up allocates and pins the pool,
  reported as "first save").
- save_async(block=False): time to return, then wait_staged().
- time to durable (every stripe fsync'd) and to committed, with GB/s.
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
import time

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
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"]
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


def make_state(gib: float, device):
    import torch
    total = int(gib * (1 << 30))
    g = torch.Generator(device=device).manual_seed(0)
    state = {"model": {}, "optim": {"step": 1000, "lr": 3e-4, "exp_avg": {}}}
    small = 256
    small_bytes = 0
    for i in range(small):  # biases / norms: 4 KiB .. 1 MiB
        n = 1024 * (1 + (i * 37) % 256)
        state["model"][f"norm{i}.weight"] = torch.randn(n, device=device, generator=g)
        small_bytes += 4 * n
    big = total - small_bytes
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


def d2h_limits(ts, device, rounds: int = 3) -> dict:
    import torch
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in ts]
    best_copy = best_to = float("inf")
    for _ in range(rounds + 1):  # the first round warms up (and fills the caching host allocator)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for d, s in zip(pinned, ts):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = [s.to("cpu", non_blocking=True) for s in ts]
        torch.cuda.synchronize(device)
        best_to = min(best_to, time.perf_counter() - t0)
        del outs
    del pinned
    return {"d2h_copy_pinned_s": best_copy, "d2h_to_cpu_s": best_to}


def check_equal(a_state, b_state) -> bool:
    import torch
    a, b = tensors_of(a_state), tensors_of(b_state)
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and
                                    torch.equal(x, y) for x, y in zip(a, b))


def measure(args) -> dict:
    import torch

    import flashwrite as fw
    res: dict = {}
    if not torch.cuda.is_available():
        raise SystemExit(f"no CUDA GPU visible to PyTorch {torch.__version__} (CUDA {torch.version.cuda}): "
                         "nothing to measure")
    dev = torch.device("cuda", 0)
    res["flashwrite_file"] = fw.__file__
    if args.built and not os.path.realpath(fw.__file__).startswith(os.path.realpath(SITE)):
        log(f"WARNING: an installed flashwrite ({fw.__file__}) shadows the fresh build in {SITE}")
    res["gpu"] = torch.cuda.get_device_name(dev)
    res["torch"] = torch.__version__
    res["torch_cuda"] = torch.version.cuda
    base = os.path.abspath(args.dir or os.path.join(REPO, "build", "gpu-check", "ckpt"))
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    info = fw.backend_info(base)
    res["backend_info"] = info
    res["fs"] = fs_of(base)
    log(f"flashwrite {fw.__version__} from {fw.__file__}; cuda={json.dumps(info['cuda'])}")
    log(f"io backend={info['backend']} direct_io={info['direct_io']} dir={base} fs={res['fs']}")
    if not info["cuda"]["available"]:
        raise SystemExit(f"flashwrite cannot use CUDA here: {info['cuda']['reason']}")

    state = make_state(args.gib, dev)
    ts = tensors_of(state)
    size = nbytes(ts)
    res["state_bytes"], res["state_tensors"] = size, len(ts)
    log(f"state: {size / 2**30:.2f} GiB in {len(ts)} tensors on {res['gpu']}")
    res.update(d2h_limits(ts, dev))
    log(f"D2H limit: copy_ into pinned {res['d2h_copy_pinned_s']:.3f} s, .to(cpu, non_blocking) "
        f"{res['d2h_to_cpu_s']:.3f} s")

    writer = fw.Writer(**json.loads(args.writer_options))
    res["writer"] = repr(writer)
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
                "pinned": st.pinned, "pool_bytes": st.pool_bytes}

    first = one_save("first")
    res["first_save"] = first
    log(f"first save (allocates + pins the pool): stall {first['stall_s']:.3f} s, committed {first['total_s']:.2f} s, "
        f"pinned={first['pinned']}")
    back = fw.load(first["path"], map_location=None)
    res["roundtrip_ok"] = check_equal(state, back)
    del back
    log(f"round trip byte-exact on the GPU: {res['roundtrip_ok']}")
    shutil.rmtree(first["path"])

    for i in range(args.rounds):
        if elapsed() > args.budget - 60:
            log("time budget: fewer save rounds")
            break
        r = one_save(f"r{i}")
        rounds.append(r)
        log(f"save {i}: stall {r['stall_s']:.3f} s, durable {r['durable_s']:.2f} s, committed {r['total_s']:.2f} s")
        if i < args.rounds - 1:
            shutil.rmtree(r["path"])
    res["rounds"] = rounds
    keep = rounds[-1]["path"] if rounds else None

    nb = one_save("noblock", block=False)
    res["noblock"] = nb
    log(f"block=False: returned in {nb['return_s'] * 1e3:.1f} ms, wait_staged after {nb['staged_wait_s']:.3f} s")
    if keep:
        shutil.rmtree(nb["path"])
    else:
        keep = nb["path"]

    loads, intos, hosts = [], [], []
    for i in range(2):
        if elapsed() > args.budget - 20 and loads:
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
    shutil.rmtree(base, ignore_errors=True)
    writer.close()
    return res


# ------------------------------------------------------------------------ table


def table(res: dict) -> str:
    gb = res["state_bytes"] / 1e9
    lim = min(res["d2h_copy_pinned_s"], res["d2h_to_cpu_s"])
    rows = [("state", f"{res['state_bytes'] / 2**30:.2f} GiB, {res['state_tensors']} tensors", res["gpu"])]

    def speed(s):
        return f"{gb / s:.1f} GB/s" if s else ""

    rows.append(("D2H limit: copy_ into pinned", f"{res['d2h_copy_pinned_s']:.3f} s", speed(res["d2h_copy_pinned_s"])))
    rows.append(("D2H: .to('cpu', non_blocking)", f"{res['d2h_to_cpu_s']:.3f} s", speed(res["d2h_to_cpu_s"])))
    stalls = [r["stall_s"] for r in res["rounds"]] or [res["first_save"]["stall_s"]]
    rows.append(("save_async stall (block=True)", f"{min(stalls):.3f} s best, {statistics.median(stalls):.3f} med",
                 f"{min(stalls) / lim:.2f}x D2H limit (goal <= 1.5x)"))
    nb = res["noblock"]
    rows.append(("save_async(block=False) return", f"{nb['return_s'] * 1e3:.1f} ms",
                 f"wait_staged() after {nb['staged_wait_s']:.3f} s"))
    rows.append(("first save stall (alloc + pin)", f"{res['first_save']['stall_s']:.3f} s",
                 f"pool {res['first_save']['pool_bytes'] / 2**30:.2f} GiB, pinned={res['first_save']['pinned']}"))
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
    if "tests_summary" in res:
        rows.append(("tests/test_cuda.py", res["tests_summary"], f"rc={res['tests_rc']}"))
    rows.append(("storage", res["fs"], f"io={res['backend_info']['backend']}"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'what'.ljust(w0)} | {'value'.ljust(w1)} | note", f"{'-' * w0}-|-{'-' * w1}-|-----"]
    lines += [f"{a.ljust(w0)} | {b.ljust(w1)} | {c}" for a, b, c in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="size of the GPU state (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="timed saves after the warm-up (default 3)")
    ap.add_argument("--dir", help="where checkpoints go (default build/gpu-check/ckpt in the repo; not tmpfs)")
    ap.add_argument("--writer-options", default="{}", help='JSON for fw.Writer, e.g. \'{"stripes": 8}\'')
    ap.add_argument("--no-build", action="store_true", help="use the flashwrite already importable")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--all-tests", action="store_true", help="also the stand-in CUDA runtime tests of test_cuda.py")
    ap.add_argument("--test-timeout", type=float, default=150)
    ap.add_argument("--budget", type=float, default=270, help="seconds the whole run should fit in (default 270)")
    ap.add_argument("--json", help="write the results here (default $OUT/gpu_check.json when $OUT is set)")
    args = ap.parse_args()

    res: dict = {}
    args.built = not args.no_build
    if args.built:
        res.update(build())
        use_site()
    if not args.skip_tests:
        res.update(run_tests(min(args.test_timeout, max(30.0, args.budget - elapsed() - 90)), args.all_tests))
    res.update(measure(args))
    res["wall_s"] = elapsed()
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print()
    print(table(res), flush=True)
    ok = res["roundtrip_ok"] and res.get("tests_rc", 0) == 0
    print(f"\ngpu_check: {'OK' if ok else 'FAILED'} in {res['wall_s']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
