"""A/B of two flashwrite builds through nfs://, interleaved round by round against one
nfs-ganesha server (tests/nfs_server.py), so that both see the same noise of a shared
machine: each round runs build A, then build B, in fresh processes (save, then a cold
load), and prints the time to durable, the cold load and the CPU seconds of the client
and of the server.

    python benchmarks/nfs_ab.py --gib 1 --rounds 5 --a 'python3' --a-path /tmp/fw-before \
        --b .venv/bin/python --dir /work/nfs-ab
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nfs import proc_cpu  # noqa: E402
from nfs_server import Export, NfsServer  # noqa: E402

CHILD = r"""
import json, os, resource, sys, time, torch
import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches
gib, url = float(sys.argv[1]), sys.argv[2]
n = int(gib * (1 << 30)) // 4
per = 1 << 24
g = torch.Generator().manual_seed(0)
state = {"model": {f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))}}
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
fw.save(state, url)
save_s, save_cpu = time.perf_counter() - t0, cpu() - c0
print(json.dumps({"phase": "saved", "save_s": save_s, "save_cpu_s": save_cpu}), flush=True)
sys.stdin.readline()  # the parent reads the server's CPU, then lets the load go
drop_caches()
c0, t0 = cpu(), time.perf_counter()
fw.load(url)
print(json.dumps({"phase": "loaded", "load_s": time.perf_counter() - t0, "load_cpu_s": cpu() - c0,
                  "flashwrite": os.path.dirname(fw.__file__)}), flush=True)
"""


def one(server: NfsServer, python: str, path: str | None, gib: float, name: str) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path
    url = server.url_ports(name)
    s0 = proc_cpu(server.pid)
    p = subprocess.Popen([python, "-c", CHILD, str(gib), url], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    out = json.loads(p.stdout.readline())
    out["save_server_cpu_s"] = proc_cpu(server.pid) - s0
    s0 = proc_cpu(server.pid)
    p.stdin.write("\n")
    p.stdin.flush()
    out.update(json.loads(p.stdout.readline()))
    out["load_server_cpu_s"] = proc_cpu(server.pid) - s0
    p.wait()
    shutil.rmtree(os.path.join(server.export, name), ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--a", default="python3")
    ap.add_argument("--a-path")
    ap.add_argument("--b", default=sys.executable)
    ap.add_argument("--b-path")
    ap.add_argument("--dir", default="/work/nfs-ab")
    ap.add_argument("--json")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(os.path.join(a.dir, "export"))
    server = NfsServer(exports=[Export(os.path.join(a.dir, "export"))], workdir=os.path.join(a.dir, "server")).start()
    rows: dict[str, list] = {"A": [], "B": []}
    try:
        for i in range(a.rounds):
            for label, py, path in (("A", a.a, a.a_path), ("B", a.b, a.b_path)):
                r = one(server, py, path, a.gib, f"ck-{label}-{i}")
                rows[label].append(r)
                print(f"round {i} {label}: durable {r['save_s']:6.2f} s  load {r['load_s']:6.2f} s  cpu save "
                      f"{r['save_cpu_s']:.2f}+{r['save_server_cpu_s']:.2f}  load {r['load_cpu_s']:.2f}+"
                      f"{r['load_server_cpu_s']:.2f}  ({r['flashwrite']})", flush=True)
    finally:
        server.stop()
        shutil.rmtree(a.dir, ignore_errors=True)
    for label, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("phase", "flashwrite")}
        print(f"median {label}: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"gib": a.gib, "a": [a.a, a.a_path], "b": [a.b, a.b_path], "rounds": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
