"""nfs:// over a shaped link (issue 38): how much of the link a save and a load fill.

nfs-ganesha and its rpcbind run in a network namespace of their own, joined to this host
by a veth pair shaped with tbf both ways (tests/nfs_netns.py), so the server is on the
far side of a link of known rate. For each --rates (Mbit/s), in one run:

1. the link's own ceiling: one raw TCP stream each way (Python sockets), --ceiling-mib;
2. nfs:// saves (time to durable) and loads with each --connections, through one warm
   Writer per setting (a first, unmeasured save fills its staging pool);
3. nfs-cp (libnfs's copy tool, one connection) of the same bytes from /dev/shm, each way.

Each figure is the median of --rounds, with its ratio to the ceiling of its direction
and the CPU seconds of each side: the client process (all its threads; nfs-cp's from
its rusage) and ganesha.nfsd (/proc/PID/stat), also per GiB. Loads are served from the
server's page cache (the link is measured, not the server's disk).

    python benchmarks/nfs_link.py --rates 1000 2000 4000 --gib 1 --rounds 3 --dir /work/nfs-link \
        [--json benchmarks/results/nfs-link.json]
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

import flashwrite as fw
from nfs import Timed, make_state, rm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from nfs_netns import LinkedNfsServer, ShapedLink, tcp_ceiling  # noqa: E402
from nfs_server import Export  # noqa: E402

GIB = 1 << 30


def _fig(save: Timed, load: Timed) -> dict:
    return {"save_s": save.wall, "save_cpu_s": save.cpu, "save_server_cpu_s": save.server_cpu,
            "load_s": load.wall, "load_cpu_s": load.cpu, "load_server_cpu_s": load.server_cpu}


def nfs_round(server: LinkedNfsServer, writer: fw.Writer, state: dict, query: str) -> dict:
    name = f"ck-{uuid.uuid4().hex[:8]}"  # fresh names: the server caches what it saw
    url = server.url_ports(name) + query
    with Timed(server) as w:
        writer.save(state, url)
    with Timed(server) as r:
        fw.load(url)
    rm(os.path.join(server.export, name))
    return _fig(w, r)


def nfs_cp_round(server: LinkedNfsServer, src: str) -> dict:
    name = f"cp-{uuid.uuid4().hex[:8]}.bin"
    with Timed(server, child=True) as w:
        subprocess.run(["nfs-cp", src, server.libnfs_url(name)], check=True, capture_output=True)
    dst = "/dev/shm/fw-nfs-link-back.bin"
    with Timed(server, child=True) as r:
        subprocess.run(["nfs-cp", server.libnfs_url(name), dst], check=True, capture_output=True)
    rm(dst)
    rm(os.path.join(server.export, name))
    return _fig(w, r)


def median(rounds: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out["rounds"] = rounds
    return out


def show(rate: int, name: str, m: dict, ceiling: dict, nbytes: int) -> None:
    gib = nbytes / GIB
    print(f"{rate:5d} Mbit/s {name:16s} save {m['save_s']:6.2f} s {nbytes / m['save_s'] / 1e6:6.1f} MB/s "
          f"{nbytes / m['save_s'] / ceiling['save']:5.2f}x  load {m['load_s']:6.2f} s "
          f"{nbytes / m['load_s'] / 1e6:6.1f} MB/s {nbytes / m['load_s'] / ceiling['load']:5.2f}x  "
          f"client CPU s/GiB {m['save_cpu_s'] / gib:4.2f} / {m['load_cpu_s'] / gib:4.2f}  "
          f"server {m['save_server_cpu_s'] / gib:4.2f} / {m['load_server_cpu_s'] / gib:4.2f}", flush=True)


def one_rate(link: ShapedLink, server: LinkedNfsServer, rate: int, state: dict, src: str, a) -> dict:
    link.set_rate(rate)
    nbytes = os.path.getsize(src)
    ceiling = {d: statistics.median(tcp_ceiling(link, a.ceiling_mib << 20, d) for _ in range(a.rounds))
               for d in ("save", "load")}
    print(f"{rate:5d} Mbit/s raw TCP          save {ceiling['save'] / 1e6:6.1f} MB/s  "
          f"load {ceiling['load'] / 1e6:6.1f} MB/s", flush=True)
    row: dict = {"ceiling_Bps": ceiling, "results": {}}
    for c in a.connections:
        query = f"&connections={c}" + (f"&depth={a.depth}" if a.depth else "")
        with fw.Writer() as writer:
            nfs_round(server, writer, state, query)  # warm the staging pool; not counted
            m = median([nfs_round(server, writer, state, query) for _ in range(a.rounds)])
        row["results"][f"nfs:// c={c}"] = m
        show(rate, f"nfs:// c={c}", m, ceiling, nbytes)
    if shutil.which("nfs-cp"):
        m = median([nfs_cp_round(server, src) for _ in range(a.rounds)])
        row["results"]["nfs-cp"] = m
        show(rate, "nfs-cp", m, ceiling, nbytes)
    return row


def table(results: dict) -> str:
    """The docs/nfs.md table of a --json file."""
    n, gib = results["bytes"], results["bytes"] / GIB
    out = ["| link | path | save MB/s | × ceiling | load MB/s | × ceiling | client CPU s/GiB (save / load) | "
           "server CPU s/GiB (save / load) |", "|---|---|---|---|---|---|---|---|"]
    for rate, row in results["rates"].items():
        c = row["ceiling_Bps"]
        out.append(f"| {int(rate) / 1000:g} Gbit/s | raw TCP | {c['save'] / 1e6:.0f} | 1.00 | {c['load'] / 1e6:.0f} | 1.00 "
                   "| | |")
        for name, m in row["results"].items():
            s, ld = n / m["save_s"], n / m["load_s"]
            out.append(f"| | {name} | {s / 1e6:.0f} | {s / c['save']:.2f} | {ld / 1e6:.0f} | {ld / c['load']:.2f} | "
                       f"{m['save_cpu_s'] / gib:.2f} / {m['load_cpu_s'] / gib:.2f} | "
                       f"{m['save_server_cpu_s'] / gib:.2f} / {m['load_server_cpu_s'] / gib:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=int, nargs="+", default=[1000, 2000, 4000], help="Mbit/s")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--depth", type=int, default=0, help="depth= in every URL (0: the default)")
    ap.add_argument("--ceiling-mib", type=int, default=512)
    ap.add_argument("--dir", default="/work/nfs-link-bench", help="a directory on the disk to export")
    ap.add_argument("--export-dir", help="export this directory instead (e.g. one on /dev/shm: then a COMMIT's "
                    "fsync costs the server nothing, and the link and protocol are measured without its disk)")
    ap.add_argument("--json")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of an earlier --json and exit")
    a = ap.parse_args()
    if a.table:
        with open(a.table) as fh:
            print(table(json.load(fh)))
        return 0
    export = a.export_dir or os.path.join(a.dir, "export")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    made_export = not os.path.isdir(export)
    os.makedirs(export, exist_ok=True)
    state = make_state(a.gib)
    src = "/dev/shm/fw-nfs-link-src.bin"
    with open(src, "wb") as fh:
        for t in state["model"].values():
            fh.write(t.numpy().tobytes())
    results: dict = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "flashwrite": os.path.dirname(fw.__file__), "cpus": os.cpu_count(),
                     "loadavg_start": os.getloadavg(), "bytes": os.path.getsize(src), "rounds": a.rounds,
                     "depth": a.depth or "default", "export": export, "rates": {}}
    try:
        with ShapedLink(rate_mbit=a.rates[0]) as link, \
                LinkedNfsServer(link=link, exports=[Export(export)], workdir=os.path.join(a.dir, "server")) as srv:
            for rate in a.rates:
                results["rates"][str(rate)] = one_rate(link, srv, rate, state, src, a)
    finally:
        rm(src)
        shutil.rmtree(a.dir, ignore_errors=True)
        if a.export_dir and made_export:  # a directory given that existed is left (its checkpoints are gone)
            shutil.rmtree(a.export_dir, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    print(f"load average at start {results['loadavg_start'][0]:.1f}, at end {results['loadavg_end'][0]:.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
