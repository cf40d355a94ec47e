"""CPU per byte of a load and of an nfs:// save (issue 46's table): user and kernel
CPU-seconds per GiB (getrusage of the child, all its threads) and wall time of one memcpy
of the state (torch ``copy_`` into fresh tensors: the reference), an owned ``fw.load`` and a
``zero_copy`` one from the local disk, and with ``--nfs`` an owned load through ``nfs://``
from nfs-ganesha on loopback (tests/nfs_server.py) beside ``nfs-cp`` reading the same
bytes, and ``fw.save`` to ``nfs://`` (the state made before the clock starts; the call
returns once the checkpoint is durable and committed), and ``fw.save_async(...).result()``
(which checksums after staging, to return sooner), beside ``nfs-cp`` writing one
stripe's bytes. ``--what save`` (or ``load``) runs only those rows.
Each measurement is a fresh child process; the page cache is dropped before each load
(run as root). Rows are interleaved round by round and reported as medians, so builds
given with ``--build`` (e.g. an earlier one's interpreter) compare within one run.

    python benchmarks/cpu_per_byte.py --gib 1 --rounds 5 --dir /var/tmp/cpb \\
        --build after=.venv/bin/python --build before=/tmp/base/.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import resource
import sys
import time
import uuid

CHILD_LOAD = """
import json, resource, sys, time
import flashwrite as fw
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
out = fw.load(sys.argv[1], zero_copy=sys.argv[2] == "1")
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "bytes": sum(t.nbytes for t in out.values())}))
"""

CHILD_COPY = """
import json, resource, sys, time
import torch
n, parts = int(sys.argv[1]), 64
src = [torch.full((n // 4 // parts,), float(i)) for i in range(parts)]  # faulted in before the clock
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
dst = [torch.empty_like(s).copy_(s) for s in src]
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "bytes": sum(d.nbytes for d in dst)}))
"""

CHILD_SAVE = """
import json, resource, sys, time
import torch
import flashwrite as fw
n, parts = int(sys.argv[2]), 64
g = torch.Generator().manual_seed(0)
state = {f"layer{i}.weight": torch.randn(n // 4 // parts, generator=g) for i in range(parts)}
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
if sys.argv[3] == "async":  # returns once staged; checksums after staging, to shorten the stall
    fw.save_async(state, sys.argv[1]).result()
else:  # blocking: each chunk checksummed as it is copied
    fw.save(state, sys.argv[1])
t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
                  "bytes": sum(t.nbytes for t in state.values())}))
"""

SAVE = """
import sys, torch, flashwrite as fw
n, parts = int(sys.argv[2]), 64
g = torch.Generator().manual_seed(0)
fw.save({f"layer{i}.weight": torch.randn(n // 4 // parts, generator=g) for i in range(parts)}, sys.argv[1])
"""


def _drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        sys.exit(f"cannot drop the page cache ({e.strerror}): run as root")


def _child(python: str, code: str, *args: str) -> dict:
    r = subprocess.run([python, "-c", code, *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"child failed ({python}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _nfs_cp(url: str) -> dict:
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    dst = f"/dev/shm/cpb-{uuid.uuid4().hex[:8]}.bin"
    subprocess.run(["nfs-cp", url, dst], check=True, capture_output=True)
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    n = os.path.getsize(dst)
    os.unlink(dst)
    return {"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime, "bytes": n}


def _nfs_cp_write(src: str, url: str) -> dict:
    """nfs-cp from a file in /dev/shm (no disk read) to a new file on the server."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(["nfs-cp", src, url], check=True, capture_output=True)
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": t1 - t0, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
            "bytes": os.path.getsize(src)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp/cpu_per_byte")
    ap.add_argument("--build", action="append", default=[],
                    help="NAME=PYTHON: an interpreter with a flashwrite build (default: this one, as 'this')")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--nfs", action="store_true",
                    help="also load from and save to nfs:// on loopback (root, nfs-ganesha)")
    ap.add_argument("--what", nargs="+", choices=("load", "save"), default=["load", "save"],
                    help="which rows: loads, nfs:// saves (these need --nfs), or both (the default)")
    a = ap.parse_args()
    loads, saves = "load" in a.what, "save" in a.what and a.nfs
    builds = dict(b.split("=", 1) for b in a.build) or {"this": sys.executable}
    nbytes = int(a.gib * (1 << 30)) // (4 * 64) * 4 * 64
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "ck")
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([next(iter(builds.values())), "-c", SAVE, path, str(nbytes)], check=True)
    server = None
    if a.nfs:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from nfs_server import Export, NfsServer
        export = os.path.join(a.dir, "export")
        shutil.rmtree(export, ignore_errors=True)
        os.makedirs(export)
        shutil.copytree(path, os.path.join(export, "ck"))
        shutil.copyfile(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]),
                        os.path.join(export, "one.bin"))
        server = NfsServer(exports=[Export(export)], workdir=os.path.join(a.dir, "server")).start()
    rows: dict[str, list[dict]] = {"one memcpy of the state (torch copy_)": []}
    shm_stripe = None
    if saves:
        shm_stripe = f"/dev/shm/cpb-stripe-{uuid.uuid4().hex[:8]}.bin"
        shutil.copyfile(os.path.join(export, "one.bin"), shm_stripe)
    try:
        for r in range(a.rounds):
            rows["one memcpy of the state (torch copy_)"].append(_child(sys.executable, CHILD_COPY, str(nbytes)))
            if saves:
                for i, (name, py) in enumerate(builds.items()):
                    for how, call in (("save", "fw.save"), ("async", "fw.save_async(...).result()")):
                        where = f"saved-{r}-{i}-{how}"
                        rows.setdefault(f"{call} nfs:// loopback ({name})", []).append(
                            _child(py, CHILD_SAVE, server.url_ports(where), str(nbytes), how))
                        shutil.rmtree(os.path.join(export, where), ignore_errors=True)
                rows.setdefault("nfs-cp write of one stripe (reference)", []).append(
                    _nfs_cp_write(shm_stripe, server.libnfs_url(f"written-{r}.bin")))
                os.unlink(os.path.join(export, f"written-{r}.bin"))
            if not loads:
                continue
            for name, py in builds.items():
                # which goes first alternates round by round: the first of the pair, right
                # after the memory-hungry rows, ran 0.15-0.4 s slower whichever it was
                # (docs/loading.md, "Which load goes first")
                for zc, what in sorted(((False, "owned"), (True, "zero_copy")), reverse=bool(r % 2)):
                    _drop_caches()
                    rows.setdefault(f"fw.load {what}, local disk ({name})", []).append(
                        _child(py, CHILD_LOAD, path, "1" if zc else "0"))
                if server is not None:
                    _drop_caches()
                    rows.setdefault(f"fw.load owned, nfs:// loopback ({name})", []).append(
                        _child(py, CHILD_LOAD, server.url_ports("ck"), "0"))
            if server is not None:  # one stripe of the four: scaled to per GiB below like the others
                _drop_caches()
                rows.setdefault("nfs-cp read of one stripe (reference)", []).append(
                    _nfs_cp(server.libnfs_url("one.bin")))
    finally:
        if server is not None:
            server.stop()
        if shm_stripe is not None:
            os.unlink(shm_stripe)
    gib = nbytes / (1 << 30)
    print(f"{gib:g} GiB of float32 in 64 tensors, median of {a.rounds} fresh children each, page cache dropped "
          f"before each load; saves are timed from the call to the durable commit\n")
    print("| | user CPU-s/GiB | kernel CPU-s/GiB | wall |")
    print("|---|---|---|---|")
    summary = {}
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("user", "sys", "wall")}
        summary[name] = med
        g = rs[0]["bytes"] / (1 << 30)
        print(f"| {name} | {med['user'] / g:.3f} | {med['sys'] / g:.3f} | {med['wall']:.3f} s |")
    for name in builds if loads else ():
        o, z = summary[f"fw.load owned, local disk ({name})"], summary[f"fw.load zero_copy, local disk ({name})"]
        pairs = sorted(a_["wall"] / b_["wall"] for a_, b_ in zip(rows[f"fw.load owned, local disk ({name})"],
                                                                 rows[f"fw.load zero_copy, local disk ({name})"]))
        print(f"\n{name}: owned wall / zero_copy wall = {o['wall'] / z['wall']:.3f} (medians); "
              f"round by round {statistics.median(pairs):.3f} median, {pairs[0]:.2f}-{pairs[-1]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gib": gib, "rounds": rows, "medians": summary}, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
