#!/usr/bin/env python3
"""How long a Ctrl-C takes to land in each blocking flashwrite call (issue 34).

One process; a timer thread sends SIGINT to the main thread at a random moment in
the call, and the time from the signal to the ``except KeyboardInterrupt`` is taken.
Cases (each --trials times, the page cache dropped before each load-like trial):

  - load:          fw.load(path) of a --mib MiB checkpoint;
  - load_into:     fw.load(path, into=state);
  - verify:        fw.verify(path);
  - first_save:    a fresh Writer's first save_async(...).result(), its pool faulting in;
  - save_wait:     a save in flight (pool already faulted in), waited on with .result();
  - snapshot:      restoring a node-local snapshot (copy_verify out of shared memory).

A trial whose call was over before the signal is retried (at most 3 times). Prints a
table of median/p90/max ms per case and writes JSON under benchmarks/results/.

    python benchmarks/interrupt_latency.py --dir /tmp/ilat --mib 1024 --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

import torch

import flashwrite as fw


def state(mib: int) -> dict[str, torch.Tensor]:
    n = mib * 2**20 // 4 // 8
    return {f"t{i}": torch.arange(n, dtype=torch.float32).mul_(1e-3).add_(i) for i in range(8)}


def drop_caches(path: str | None = None) -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3")
        return
    except OSError:
        pass
    for root, _, files in os.walk(path or "."):  # not root: at least this checkpoint's pages
        for f in files:
            try:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass


def interrupted_ms(call, lo: float, hi: float) -> float | None:
    """Runs call() with SIGINT sent to this thread after a random delay in [lo, hi] s;
    ms from the signal to the KeyboardInterrupt, or None if call() finished first."""
    sent: list[float] = []
    main = threading.main_thread().ident

    def fire():
        sent.append(time.perf_counter())
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(random.uniform(lo, hi), fire)
    timer.start()
    try:
        call()
    except KeyboardInterrupt:
        return (time.perf_counter() - sent[0]) * 1000
    finally:
        timer.join()
    time.sleep(0.01)  # a signal sent just after the call lands here, not in the next trial
    return None


def interrupted_ms_safe(call, lo, hi):
    try:
        return interrupted_ms(call, lo, hi)
    except KeyboardInterrupt:  # landed between the call's end and the except
        return None


def run_case(name, trials, setup, call, lo, hi, teardown=None):
    got: list[float] = []
    misses = 0
    while len(got) < trials and misses < 3 * trials:
        ctx = setup()
        ms = interrupted_ms_safe(lambda: call(ctx), lo, hi)
        if teardown:
            teardown(ctx)
        if ms is None:
            misses += 1
        else:
            got.append(ms)
        print(f"  {name}: {'done first' if ms is None else f'{ms:.1f} ms'}", file=sys.stderr, flush=True)
    return got


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--cases", default="load,load_into,verify,first_save,save_wait,snapshot")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/interrupt-latency-<date>.json")
    ap.add_argument("--label", default="", help="a note stored in the JSON (e.g. 'quiet machine')")
    a = ap.parse_args()
    random.seed(1)
    base = a.dir or tempfile.mkdtemp(prefix="fw-ilat-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(dir=base)
    shm = tempfile.mkdtemp(prefix="fw-ilat-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    cases = a.cases.split(",")
    results: dict[str, list[float]] = {}
    durations: dict[str, float] = {}
    try:
        st = state(a.mib)
        ck = os.path.join(work, "ck")
        fw.save(st, ck, stripes=4)
        # The uninterrupted time of each call, to spread the signals over all of it.
        drop_caches(ck)
        durations["load"] = timed(lambda: fw.load(ck))
        dst = state(a.mib)
        drop_caches(ck)
        durations["load_into"] = timed(lambda: fw.load(ck, into=dst))
        drop_caches(ck)
        durations["verify"] = timed(lambda: fw.verify(ck))

        def cold(_=None):
            drop_caches(ck)

        for case, f in (("load", lambda _: fw.load(ck)), ("load_into", lambda _: fw.load(ck, into=dst)),
                        ("verify", lambda _: fw.verify(ck))):
            if case in cases:
                d = durations[case]
                results[case] = run_case(case, a.trials, cold, f, 0.02, max(0.03, 0.9 * d))

        if "first_save" in cases:
            out = os.path.join(work, "fs")

            def fresh():
                shutil.rmtree(out, ignore_errors=True)
                return fw.Writer(stripes=4)

            w = fresh()
            durations["first_save"] = timed(lambda: w.save_async(st, out, overwrite=True).result())
            w.close()
            results["first_save"] = run_case("first_save", a.trials, fresh, lambda w: w.save_async(st, out, overwrite=True).result(),
                                             0.02, max(0.03, 0.6 * durations["first_save"]), lambda w: w.close())

        if "save_wait" in cases:
            out = os.path.join(work, "sw")
            w = fw.Writer(stripes=4)
            w.save(st, out)  # the pool is faulted in
            durations["save_wait"] = timed(lambda: w.save_async(st, out, overwrite=True).result())

            def save_and_wait(ctx):
                ctx["fut"] = w.save_async(st, out, overwrite=True)
                ctx["fut"].result()

            def settle(ctx):  # a save interrupted in result() goes on in the background: stop it
                if "fut" in ctx:
                    ctx["fut"].cancel()
                    ctx["fut"].wait()

            results["save_wait"] = run_case("save_wait", a.trials, dict, save_and_wait, 0.01,
                                            max(0.02, 0.9 * durations["save_wait"]), settle)
            w.close()

        if "snapshot" in cases:
            from flashwrite.tier import snapshot as local
            w = fw.Writer(local_snapshots=True, local_dir=shm)
            w.save(st, os.path.join(work, "snap"))
            w.close(keep_local=True)
            snap = local.scan(shm)[0]
            dst = state(a.mib)
            durations["snapshot"] = timed(lambda: local.read_snapshot(snap, targets=dst))
            results["snapshot"] = run_case("snapshot", a.trials, lambda: None,
                                           lambda _: local.read_snapshot(snap, targets=dst), 0.005,
                                           max(0.01, 0.9 * durations["snapshot"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)

    def p90(xs):
        return sorted(xs)[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]

    rows = {k: dict(n=len(v), median_ms=statistics.median(v), p90_ms=p90(v), max_ms=max(v),
                    call_s=durations.get(k), all_ms=[round(x, 1) for x in v]) for k, v in results.items() if v}
    print(f"\nsignal -> KeyboardInterrupt, {a.mib} MiB, {a.trials} trials per case {a.label}")
    print(f"{'case':<12} {'n':>3} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'call s':>7}")
    for k, r in rows.items():
        print(f"{k:<12} {r['n']:>3} {r['median_ms']:>10.1f} {r['p90_ms']:>8.1f} {r['max_ms']:>8.1f} "
              f"{(r['call_s'] or 0):>7.2f}")
    path = a.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  f"interrupt-latency-{a.mib}MiB-{time.strftime('%Y-%m-%d-%H%M')}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(dict(mib=a.mib, trials=a.trials, label=a.label, cpus=os.cpu_count(),
                       loadavg=os.getloadavg(), cases=rows), fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
