"""The training-overhead benchmark (until issue 36, ``flashwrite overhead``): how much
slower a small CPU training run gets when it checkpoints, per mode (none, torch.save,
dcp.async_save, flashwrite, and the external peers' modes of benchmarks/peers.py).
See ``harness/overhead.py`` for the method.

    python benchmarks/overhead.py --steps 60 --every 10 --rounds 3 --plain --json OUT
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness/, wherever this is run from

from compare import log_to_stderr  # noqa: E402
from harness import overhead, peers, report  # noqa: E402


def parser() -> argparse.ArgumentParser:
    o = argparse.ArgumentParser(prog="benchmarks/overhead.py", description=__doc__.split("\n\n")[0])
    o.add_argument("--steps", type=int, default=60)
    o.add_argument("--every", type=int, default=10)
    o.add_argument("--rounds", type=int, default=1)
    o.add_argument("--modes", default="none,torch_save,dcp_async,flashwrite",
                   help="comma-separated: none, torch_save, dcp_async, flashwrite, torch_checkpointing")
    o.add_argument("--width", type=int, default=2048, help="MLP width (default 2048)")
    o.add_argument("--depth", type=int, default=6, help="MLP layers (default 6)")
    o.add_argument("--threads", type=int, default=1, help="training intra-op threads (default 1)")
    o.add_argument("--dir", default=".")
    o.add_argument("--peers", metavar="FILE", help="a peers.py of adapters to use instead of benchmarks/peers.py")
    o.add_argument("--plain", action="store_true")
    o.add_argument("--quiet", "-q", action="store_true")
    o.add_argument("--markdown", action="store_true")
    o.add_argument("--json", metavar="PATH")
    return o


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    if a.peers:
        peers.use_peers_file(a.peers)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    res = overhead.run(steps=a.steps, every=a.every, rounds=a.rounds, directory=a.dir, modes=modes,
                       width=a.width, depth=a.depth, threads=a.threads, log=log_to_stderr(a.quiet))
    report.print_overhead(res, plain=a.plain)
    if a.markdown:
        print("\n" + report.overhead_markdown(res))
    if a.json:
        report.write_json({"overhead": res}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
