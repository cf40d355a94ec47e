"""Compression on trained weights (issue 38 item 4): per kind of state (bf16 weights,
fp32 master weights, AdamW exp_avg / exp_avg_sq of benchmarks/trained_state.py) the
ratio and the native codec's compress / decompress GB/s on one core; then saves of the
whole state, compress off vs "auto" vs "zstd": time to durable, the stall and the load
time, on the local disk (--dir) and, with --rates, over shaped links to nfs-ganesha
(tests/nfs_netns.py, as benchmarks/nfs_link.py; needs root).

    nice -n 19 python benchmarks/trained_state.py --seconds 120
    python benchmarks/compress.py --dir /tmp/fw-compress [--rates 1000 2000 4000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid

import torch

import flashwrite as fw
from flashwrite import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trained_state import load_or_train  # noqa: E402

KINDS = ("weights_bf16", "master_fp32", "exp_avg", "exp_avg_sq")
CHUNK = 16 << 20


def codec_rates(state: dict) -> dict:
    out = {}
    for kind in KINDS:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state[kind].values()])
        width = next(iter(state[kind].values())).element_size()
        stored = tc = td = 0.0
        for i in range(0, flat.numel(), CHUNK):
            piece = flat[i:i + CHUNK].numpy()
            n, c, d = _core.codec_rate(piece, width, 1, 1)
            stored, tc, td = stored + n, tc + c, td + d
        out[kind] = {"bytes": flat.numel(), "ratio": flat.numel() / stored,
                     "compress_GBps_core": flat.numel() / tc / 1e9, "decompress_GBps_core": flat.numel() / td / 1e9}
        r = out[kind]
        print(f"{kind:13s} {r['bytes'] / 2**20:7.1f} MiB  ratio {r['ratio']:.3f}  compress {r['compress_GBps_core']:.2f} "
              f"GB/s/core  decompress {r['decompress_GBps_core']:.2f} GB/s/core", flush=True)
    return out


def save_round(writer: fw.Writer, state: dict, path: str) -> dict:
    t0 = time.perf_counter()
    fut = writer.save_async(state, path)
    stall = time.perf_counter() - t0
    st = fut.result()
    durable = st.durable_s
    t1 = time.perf_counter()
    fw.load(path)
    load_s = time.perf_counter() - t1
    return {"stall_s": stall, "durable_s": durable, "load_s": load_s, "bytes": st.bytes,
            "bytes_stored": st.bytes_stored or st.bytes, "compress": st.compress}


def rm(path: str) -> None:
    if "://" not in path:
        shutil.rmtree(path, ignore_errors=True)


def compare(place, state: dict, rounds: int, where=None) -> dict:
    """off / auto / zstd to `place(name)`, each through one warm Writer (its first save unmeasured)."""
    out = {}
    for mode in (None, "auto", "zstd"):
        with fw.Writer(compress=mode) as w:
            rows = []
            for r in range(rounds + 1):
                name = f"ck-{uuid.uuid4().hex[:8]}"
                row = save_round(w, state, place(name))
                (where or rm)(name)
                if r:
                    rows.append(row)
        m = {k: statistics.median(x[k] for x in rows) for k in ("stall_s", "durable_s", "load_s", "bytes_stored")}
        m["compress"] = rows[-1]["compress"]
        m["bytes"] = rows[-1]["bytes"]
        out[str(mode)] = m
        print(f"  {str(mode):5s} durable {m['durable_s']:6.2f} s  stall {m['stall_s']:5.3f} s  load {m['load_s']:6.2f} s "
              f"stored {m['bytes_stored'] / 2**20:7.1f} MiB  [{m['compress']}]", flush=True)
    return out


def links(rates: list[int], state: dict, rounds: int, workdir: str) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from nfs_netns import LinkedNfsServer, ShapedLink  # noqa: E402
    from nfs_server import Export  # noqa: E402
    export = os.path.join(workdir, "export")
    os.makedirs(export, exist_ok=True)
    out = {}
    with ShapedLink(rate_mbit=rates[0]) as link, \
            LinkedNfsServer(link=link, exports=[Export(export)], workdir=os.path.join(workdir, "server")) as srv:
        for rate in rates:
            link.set_rate(rate)
            print(f"{rate} Mbit/s link (nfs://, via the shaped veth)", flush=True)
            out[str(rate)] = compare(srv.url_ports, state, rounds,
                                     where=lambda name: shutil.rmtree(os.path.join(export, name), ignore_errors=True))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/fw-compress")
    ap.add_argument("--rates", type=int, nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    state = load_or_train()
    ckpt = {k: state[k] for k in KINDS}
    results: dict = {"meta": state["meta"], "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                     "zstd": _core.zstd_support()["version"], "codec": codec_rates(state)}
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    try:
        print(f"local disk ({a.dir})", flush=True)
        results["local"] = compare(lambda name: os.path.join(a.dir, name), ckpt, a.rounds)
        if a.rates:
            results["links"] = links(a.rates, ckpt, a.rounds, os.path.join(a.dir, "nfs"))
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
