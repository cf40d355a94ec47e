"""Time to durable of plain against zstd saves of N copies of the trained state over one
shaped link (issue 38's 1 Gbit/s target on more than 0.39 GiB): one warm Writer per mode,
rounds interleaved, medians.

    python benchmarks/compress_copies.py --rate 1000 --copies 3 --rounds 3 --dir /work/zsave-bed
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import uuid

import torch

import flashwrite as fw
from trained_state import load_or_train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from nfs_netns import LinkedNfsServer, ShapedLink  # noqa: E402
from nfs_server import Export  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=1000, help="Mbit/s")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fw-compress-copies")
    a = ap.parse_args()
    base = {k: v for k, v in load_or_train().items() if k != "meta"}
    state = {f"{k}.{i}": {n: t.clone() for n, t in d.items()} for i in range(a.copies) for k, d in base.items()}
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir + "/export")
    try:
        with ShapedLink(rate_mbit=a.rate) as link, \
                LinkedNfsServer(link=link, exports=[Export(a.dir + "/export")], workdir=a.dir + "/server") as srv:
            writers = {m: fw.Writer(compress=m) for m in (None, "zstd")}
            for m, w in writers.items():  # fills the pool; not counted
                w.save(state, srv.url_ports(f"warm-{m}"))
            got: dict = {m: [] for m in writers}
            for _ in range(a.rounds):
                for m, w in writers.items():
                    st = w.save(state, srv.url_ports(f"ck-{uuid.uuid4().hex[:8]}"))
                    got[m].append((st.durable_s, st.bytes_stored))
                    print(f"{str(m):5s} durable {st.durable_s:6.3f} s  stored {st.bytes_stored / 2**20:7.1f} MiB", flush=True)
            for w in writers.values():
                w.close()
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    off = statistics.median(d for d, _ in got[None])
    on = statistics.median(d for d, _ in got["zstd"])
    ratio = got[None][0][1] / got["zstd"][0][1]
    print(f"off {off:.2f} s  zstd {on:.2f} s  stored ratio {ratio:.3f}  target 1.05/ratio x off = {1.05 / ratio * off:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
