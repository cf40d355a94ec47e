"""The side-by-side comparison (until issue 36, ``flashwrite bench``): every contender
saves, then cold-loads, the same synthetic training state, next to the device limit and
a memcpy, one fresh process per contender per round; the table, and optionally JSON,
markdown, a PNG and the training-overhead benchmark.

    python benchmarks/compare.py --size 2GiB --rounds 3 --contenders torch_save,flashwrite \\
        --dir DIR --plain -q --json OUT

Runs from a source checkout against the flashwrite the interpreter imports; the harness
is ``benchmarks/harness/``, the peers that need other projects' internals
``benchmarks/peers.py``. The JSON is {"comparison": ..., "overhead": ...} as before
(``benchmarks/summarize.py`` and HISTORY.md read it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # harness/, wherever this is run from (a script has its folder first already);
    sys.path.append(_HERE)  # last, when imported: its scripts' names must not shadow an importer's modules

from flashwrite.ops.progress import Progress, step_logger  # noqa: E402
from flashwrite.system.sizes import parse_size  # noqa: E402
from harness import overhead, peers, report, runner  # noqa: E402


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def log_to_stderr(quiet: bool):
    return (lambda _msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def parser() -> argparse.ArgumentParser:
    b = argparse.ArgumentParser(prog="benchmarks/compare.py", description=__doc__.split("\n\n")[0])
    b.add_argument("--size", type=size_arg, default=size_arg("1GiB"), help="training state size (default 1GiB)")
    b.add_argument("--dir", default=".", help="where to write checkpoints (a temporary folder inside it is "
                   "removed afterwards; default: the current directory)")
    b.add_argument("--device-tool", choices=["auto", "fio", "probe"], default="auto",
                   help="how to measure the device limit: fio (default when installed) or the in-tree probe")
    b.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache before saves and loads (loads may then be warm)")
    b.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    b.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    b.add_argument("--contenders", default="all",
                   help="comma-separated keys, or 'all': torch_save, safetensors, dcp_save, dcp_async, "
                        "dcp_async_staged, torch_checkpointing, deepspeed, flashwrite")
    b.add_argument("--rounds", type=int, default=1, help="rounds of all contenders, interleaved; medians reported")
    b.add_argument("--plot", metavar="PNG", help="write a chart of the results (needs matplotlib)")
    b.add_argument("--no-load", action="store_true", help="skip the cold-load measurements")
    b.add_argument("--inprocess", action="store_true",
                   help="run contenders in this process (faster; RSS and CPU figures then less clean)")
    b.add_argument("--dcp-threads", type=int, default=4, help="FileSystemWriter thread_count for DCP (default 4)")
    b.add_argument("--flashwrite-options", metavar="JSON",
                   help='Writer options for flashwrite, e.g. \'{"stripes": 8}\' (default: the defaults)')
    b.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    b.add_argument("--overhead", action="store_true", help="also run the training-overhead benchmark")
    b.add_argument("--peers", metavar="FILE",
                   help="a peers.py of adapters to use instead of benchmarks/peers.py; nothing in the current "
                        "directory is ever loaded")
    b.add_argument("--steps", type=int, default=60, help="training steps for --overhead")
    b.add_argument("--every", type=int, default=10, help="checkpoint every N steps for --overhead")
    b.add_argument("--overhead-rounds", type=int, default=1, help="rounds for --overhead")
    return b


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        os.makedirs(a.dir, exist_ok=True)
    except OSError as e:
        print(f"compare.py: error: cannot create --dir {a.dir}: {e.strerror}", file=sys.stderr)
        return 2
    if a.peers:
        peers.use_peers_file(a.peers)
    if a.contenders in ("all", "default"):
        contenders = peers.default_contenders()
    else:
        contenders = [c.strip() for c in a.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in peers.contenders()]
    if unknown:
        print(f"error: unknown contender(s) {', '.join(unknown)}; choose from {', '.join(peers.contenders())}",
              file=sys.stderr)
        return 2
    fw_opts = json.loads(a.flashwrite_options) if a.flashwrite_options else None
    bar = Progress(quiet=a.quiet, force_plain=a.plain)
    log = step_logger(bar, a.rounds * (2 + len(contenders)), a.size, "bench") if not a.quiet else log_to_stderr(True)
    try:
        res = runner.compare(a.size, contenders, a.dir, rounds=a.rounds,
                             isolation="inprocess" if a.inprocess else "subprocess", load=not a.no_load,
                             device_tool=a.device_tool, dcp_threads=a.dcp_threads, drop_caches=not a.no_drop_caches,
                             flashwrite_options=fw_opts, log=log)
    finally:
        bar.finish()
    out = {"comparison": res}
    report.print_table(res, plain=a.plain)
    if a.markdown:
        print("\n" + report.markdown(res))
    if a.overhead:
        ov = overhead.run(steps=a.steps, every=a.every, rounds=a.overhead_rounds, directory=a.dir,
                          log=log_to_stderr(a.quiet))
        out["overhead"] = ov
        print()
        report.print_overhead(ov, plain=a.plain)
        if a.markdown:
            print("\n" + report.overhead_markdown(ov))
    if a.json:
        report.write_json(out, a.json)
        print(f"results written to {a.json}", file=sys.stderr)
    if a.plot:
        why = report.plot(res, a.plot)
        print(f"chart: {why}" if why else f"chart written to {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
