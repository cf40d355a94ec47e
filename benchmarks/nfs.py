"""nfs:// against a real NFS server on this machine (issue 22), in one run.

nfs-ganesha (tests/nfs_server.py) exports a directory of --dir's disk on 127.0.0.1.
For each size, medians of --rounds:

1. flashwrite through ``nfs://`` (connections=--connections): time to durable and a
   cold load (page cache dropped first, root);
2. ``nfs-cp`` (libnfs's own copy tool, one connection) of the same bytes from /dev/shm;
3. fio on the export's local directory: the disk under the server (sequential 1 MiB
   O_DIRECT writes, fsync at the end; reads after dropping the cache);
4. flashwrite to the export's local path: time to durable and cold load.

Then ``connections`` is swept (1, 2, 4, 8, 16) at the first size. Server and client
share this machine's cores, so CPU seconds are reported too: the client process's
(user+system) and the server's (ganesha.nfsd's, from /proc).

    python benchmarks/nfs.py --gib 1 2 --rounds 3 --dir /work/nfs-bench [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import torch

import flashwrite as fw
from flashwrite.ops.devicelimit import drop_caches

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from nfs_server import Export, NfsServer  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def make_state(gib: float) -> dict:
    n = int(gib * (1 << 30)) // 4
    per = 1 << 24  # 64 MiB tensors, like large layers
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(min(per, n - i * per), generator=g) for i in range(-(-n // per))}}


def proc_cpu(pid: int | None) -> float:
    """User+system CPU seconds of process ``pid`` (its threads included)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK


class Timed:
    """Wall time, this process's CPU time (child=True: its finished children's, for a tool
    run as a subprocess) and the server's CPU time of a block."""

    def __init__(self, server: NfsServer, child: bool = False):
        self.server, self.child = server, child

    def _cpu(self) -> float:
        return children_cpu() if self.child else time.process_time()

    def __enter__(self) -> Timed:
        self.t0, self.c0, self.s0 = time.perf_counter(), self._cpu(), proc_cpu(self.server.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = self._cpu() - self.c0
        self.server_cpu = proc_cpu(self.server.pid) - self.s0


def children_cpu() -> float:
    r = os.times()
    return r.children_user + r.children_system


def rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (os.path.exists(path) and os.unlink(path))


def nfs_round(server: NfsServer, state: dict, connections: int) -> dict:
    name = f"ck-{uuid.uuid4().hex[:8]}"  # fresh names: the server caches what it saw (gone locally or not)
    url = server.url_ports(name) + f"&connections={connections}"
    with Timed(server) as w:
        fw.save(state, url)
    drop_caches()
    with Timed(server) as r:
        fw.load(url)
    rm(os.path.join(server.export, name))
    return {"save_s": w.wall, "save_cpu_s": w.cpu, "save_server_cpu_s": w.server_cpu,
            "load_s": r.wall, "load_cpu_s": r.cpu, "load_server_cpu_s": r.server_cpu}


def nfs_cp_round(server: NfsServer, src: str) -> dict:
    name = f"cp-{uuid.uuid4().hex[:8]}.bin"
    c0 = children_cpu()
    with Timed(server) as w:
        subprocess.run(["nfs-cp", src, server.libnfs_url(name)], check=True, capture_output=True)
    out = {"save_s": w.wall, "save_cpu_s": children_cpu() - c0, "save_server_cpu_s": w.server_cpu}
    drop_caches()
    dst = "/dev/shm/fw-nfs-bench-back.bin"
    c0 = children_cpu()
    with Timed(server) as r:
        subprocess.run(["nfs-cp", server.libnfs_url(name), dst], check=True, capture_output=True)
    out.update(load_s=r.wall, load_cpu_s=children_cpu() - c0, load_server_cpu_s=r.server_cpu)
    rm(dst)
    rm(os.path.join(server.export, name))
    return out


def fio_round(directory: str, nbytes: int) -> dict:
    out = {}
    for rw in ("write", "read"):
        if rw == "read":
            drop_caches()
        r = subprocess.run(["fio", "--name=seq", f"--directory={directory}", f"--rw={rw}", "--bs=1M",
                            f"--size={nbytes}", "--direct=1", "--ioengine=libaio", "--iodepth=32",
                            "--end_fsync=1", "--output-format=json"], check=True, capture_output=True, text=True)
        job = json.loads(r.stdout)["jobs"][0]
        out[f"{'save' if rw == 'write' else 'load'}_s"] = job["job_runtime"] / 1000.0
        out[f"{'save' if rw == 'write' else 'load'}_cpu_s"] = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * \
            job["job_runtime"] / 1000.0
    for f in os.listdir(directory):
        if f.startswith("seq."):
            os.unlink(os.path.join(directory, f))
    return out


def local_round(server: NfsServer, state: dict) -> dict:
    path = os.path.join(server.export, "local-ck")
    with Timed(server) as w:
        fw.save(state, path)
    drop_caches()
    with Timed(server) as r:
        fw.load(path)
    rm(path)
    return {"save_s": w.wall, "save_cpu_s": w.cpu, "load_s": r.wall, "load_cpu_s": r.cpu}


def median(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--dir", default="/work/nfs-bench", help="a directory on the disk to export")
    ap.add_argument("--modes", nargs="+", default=["nfs://", "nfs-cp", "fio local disk", "flashwrite local"],
                    help="which rows to measure (e.g. --modes nfs:// nfs-cp for an A/B of two builds)")
    ap.add_argument("--json")
    a = ap.parse_args()
    export = os.path.join(a.dir, "export")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(export)
    results: dict = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "flashwrite": os.path.dirname(fw.__file__),
                     "cpus": os.cpu_count(), "connections": a.connections, "rounds": a.rounds, "sizes": {},
                     "cold": drop_caches() is None}
    server = NfsServer(exports=[Export(export)], workdir=os.path.join(a.dir, "server")).start()
    try:
        for gib in a.gib:
            state = make_state(gib)
            nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
            src = "/dev/shm/fw-nfs-bench-src.bin"
            with open(src, "wb") as fh:
                for t in state["model"].values():
                    fh.write(t.numpy().tobytes())
            row = {}
            for name, fn in (("nfs://", lambda: nfs_round(server, state, a.connections)),
                             ("nfs-cp", lambda: nfs_cp_round(server, src)),
                             ("fio local disk", lambda: fio_round(export, nbytes)),
                             ("flashwrite local", lambda: local_round(server, state))):
                if name not in a.modes:
                    continue
                rounds = [fn() for _ in range(a.rounds)]
                row[name] = median(rounds)
                row[name]["rounds"] = rounds
                m = row[name]
                print(f"{gib:g} GiB {name:18s} durable {m['save_s']:6.2f} s ({nbytes / m['save_s'] / 2**20:6.0f} MiB/s)"
                      f"  load {m['load_s']:6.2f} s ({nbytes / m['load_s'] / 2**20:6.0f} MiB/s)"
                      f"  cpu save {m['save_cpu_s']:5.2f}+{m.get('save_server_cpu_s', 0):5.2f} s"
                      f"  load {m['load_cpu_s']:5.2f}+{m.get('load_server_cpu_s', 0):5.2f} s", flush=True)
            os.unlink(src)
            results["sizes"][f"{gib:g}"] = {"bytes": nbytes, "results": row}
            del state
        state = make_state(a.gib[0]) if a.sweep else {"model": {}}
        nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
        sweep = {}
        for c in a.sweep:
            m = median([nfs_round(server, state, c) for _ in range(a.rounds)])
            sweep[c] = m
            print(f"{a.gib[0]:g} GiB connections={c:2d} durable {m['save_s']:6.2f} s "
                  f"({nbytes / m['save_s'] / 2**20:6.0f} MiB/s)  load {m['load_s']:6.2f} s "
                  f"({nbytes / m['load_s'] / 2**20:6.0f} MiB/s)  cpu save {m['save_cpu_s']:.2f}+"
                  f"{m['save_server_cpu_s']:.2f} s", flush=True)
        results["sweep"] = {"gib": a.gib[0], "bytes": nbytes, "results": sweep}
    finally:
        server.stop()
        shutil.rmtree(a.dir, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
