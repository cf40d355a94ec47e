"""The ``flashwrite`` command: demo, bench, overhead, verify, info; ls, inspect, diff, convert, tune (ops/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .._core import __version__
from ..bench import overhead, peers, report, runner
from ..errors import FlashwriteError
from ..system.info import backend_info
from .cli import register
from .common import BAD_PATH, bad_path_message
from .ls import record_verified
from .progress import Progress, step_logger
from ..loading.load import verify
from ..system.sizes import fmt_bytes, parse_size
from ..targets.locate import kind_of
from ..targets.target import UnsupportedTargetError


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _log(quiet: bool):
    return (lambda _msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def cmd_demo(a: argparse.Namespace) -> int:
    print(f"flashwrite demo: saving and loading a {fmt_bytes(a.size)} synthetic training state "
          f"(GPT-like parameters + Adam moments + optimizer fields) in {os.path.abspath(a.dir)}", flush=True)
    res = runner.compare(a.size, ["torch_save", "flashwrite"], a.dir, rounds=1, isolation="inprocess",
                         device_tool=a.device_tool, drop_caches=not a.no_drop_caches, log=_log(a.quiet))
    report.print_table(res, plain=a.plain, targets=False)
    rows = {r["key"]: r for r in res["rows"]}
    fw, ts = rows.get("flashwrite", {}), rows.get("torch_save", {})
    if fw.get("durable_s") and ts.get("durable_s"):
        def than(ours: float, theirs: float, what: str) -> str:
            r = theirs / ours if ours else float("inf")
            return f"{r:.1f}x sooner than {what}" if r >= 1 else f"{1 / r:.1f}x later than {what}"

        print(f"\nIn short: with flashwrite, training could go on after {fw['stall_s']:.3f} s, where torch.save held "
              f"it for {ts['stall_s']:.2f} s. The checkpoint was safely on disk after {fw['durable_s']:.2f} s, "
              f"{than(fw['durable_s'], ts['durable_s'], 'torch.save + fsync')}, and it loaded back from a cold cache "
              f"in {fw['load_s']:.2f} s, {than(fw['load_s'], ts['load_s'], 'torch.load')}.")
    if a.json:
        report.write_json(res, a.json)
    bad = [r for r in res["rows"] if r.get("status") != "ok" or r.get("load_check") not in ("ok", None)]
    for r in bad:
        print(f"error: {r['name']}: {r.get('status')} {r.get('load_check', '')}", file=sys.stderr)
    return 1 if bad else 0


def cmd_bench(a: argparse.Namespace) -> int:
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
    log = step_logger(bar, a.rounds * (2 + len(contenders)), a.size, "bench") if not a.quiet else _log(True)
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
                          log=_log(a.quiet))
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


def cmd_overhead(a: argparse.Namespace) -> int:
    if a.peers:
        peers.use_peers_file(a.peers)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    res = overhead.run(steps=a.steps, every=a.every, rounds=a.rounds, directory=a.dir, modes=modes,
                       width=a.width, depth=a.depth, threads=a.threads, log=_log(a.quiet))
    report.print_overhead(res, plain=a.plain)
    if a.markdown:
        print("\n" + report.overhead_markdown(res))
    if a.json:
        report.write_json({"overhead": res}, a.json)
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    try:
        summary = verify(a.path, Progress(quiet=a.json or a.quiet))
    except OSError as e:
        if e.errno not in BAD_PATH:
            return _verify_failed(a.path, e)
        print(f"flashwrite verify: error: {bad_path_message(e)}", file=sys.stderr)
        return 2
    except UnsupportedTargetError as e:
        print(f"flashwrite verify: error: {e}", file=sys.stderr)
        return 2
    except (FlashwriteError, ValueError) as e:
        return _verify_failed(a.path, e)
    record_verified(a.path)  # for `flashwrite ls`; best effort (read-only checkpoints stay unmarked)
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{a.path}: OK: {summary['files']} files, {summary['tensors']} tensors, {summary['bytes']} bytes, "
              f"every checksum matches (read in {summary['seconds']:.2f} s)")
    return 0


def _verify_failed(path: str, e: Exception) -> int:
    record_verified(path, failed=str(e))  # so `flashwrite ls` no longer says "yes"
    print(f"{path}: FAILED: {e}", file=sys.stderr)
    return 1


def cmd_info(a: argparse.Namespace) -> int:
    try:
        kind = kind_of(a.dir, "info")
    except UnsupportedTargetError:
        kind = None  # a URL of a scheme flashwrite does not handle
    if kind is None or not kind.os_paths:
        other = (f"for an nfs:// target, `flashwrite tune {a.dir}` measures it and `flashwrite ls {a.dir}` lists it"
                 if kind is not None else "flashwrite reads local (or mounted) paths and nfs:// URLs")
        print(f"flashwrite info: error: {a.dir}: info probes a local directory (O_DIRECT, io_uring, CUDA); {other}",
              file=sys.stderr)
        return 2
    if not os.path.exists(a.dir):
        print(f"flashwrite info: error: {a.dir}: no such directory; pass an existing directory to probe "
              "(default: the current one)", file=sys.stderr)
        return 2
    info = backend_info(a.dir)
    if a.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        if isinstance(v, dict):
            v = ", ".join(f"{kk}={vv}" for kk, vv in v.items())
        print(f"{k.ljust(width)}  {v}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashwrite", description="Nearly free PyTorch checkpoints.")
    p.add_argument("--version", action="version", version=f"flashwrite {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser, size: str) -> None:
        sp.add_argument("--size", type=_size, default=_size(size), help=f"training state size (default {size})")
        sp.add_argument("--dir", default=".", help="where to write checkpoints (a temporary folder inside it is "
                        "removed afterwards; default: the current directory)")
        sp.add_argument("--device-tool", choices=["auto", "fio", "probe"], default="auto",
                        help="how to measure the device limit: fio (default when installed) or the in-tree probe")
        sp.add_argument("--no-drop-caches", action="store_true",
                        help="do not drop the page cache before saves and loads (loads may then be warm)")
        sp.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
        sp.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    d = sub.add_parser("demo", help="save + load a synthetic training state, side by side with torch.save/torch.load")
    common(d, "512MiB")
    d.set_defaults(func=cmd_demo, make_dir=True)

    b = sub.add_parser("bench", help="the full side-by-side comparison against the device limit and every peer")
    common(b, "1GiB")
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
                   help="a peers.py of adapters for more contenders (a source checkout's benchmarks/peers.py); "
                        "nothing in the current directory is ever loaded")
    b.add_argument("--steps", type=int, default=60, help="training steps for --overhead")
    b.add_argument("--every", type=int, default=10, help="checkpoint every N steps for --overhead")
    b.add_argument("--overhead-rounds", type=int, default=1, help="rounds for --overhead")
    b.set_defaults(func=cmd_bench, make_dir=True)

    o = sub.add_parser("overhead", help="training slowdown caused by checkpointing: torch.save, dcp.async_save, "
                                        "flashwrite")
    o.add_argument("--steps", type=int, default=60)
    o.add_argument("--every", type=int, default=10)
    o.add_argument("--rounds", type=int, default=1)
    o.add_argument("--modes", default="none,torch_save,dcp_async,flashwrite",
                   help="comma-separated: none, torch_save, dcp_async, flashwrite, torch_checkpointing")
    o.add_argument("--width", type=int, default=2048, help="MLP width (default 2048)")
    o.add_argument("--depth", type=int, default=6, help="MLP layers (default 6)")
    o.add_argument("--threads", type=int, default=1, help="training intra-op threads (default 1)")
    o.add_argument("--dir", default=".")
    o.add_argument("--peers", metavar="FILE", help="a peers.py of adapters for more modes (as for bench)")
    o.add_argument("--plain", action="store_true")
    o.add_argument("--quiet", "-q", action="store_true")
    o.add_argument("--markdown", action="store_true")
    o.add_argument("--json", metavar="PATH")
    o.set_defaults(func=cmd_overhead, make_dir=True)

    v = sub.add_parser("verify", help="check a checkpoint offline: manifest, sizes, headers, every checksum")
    v.add_argument("path")
    v.add_argument("--json", action="store_true")
    v.add_argument("--quiet", "-q", action="store_true", help="no progress")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("info", help="which I/O backend, O_DIRECT and CUDA flashwrite will use here")
    i.add_argument("dir", nargs="?", default=".", help="directory to probe O_DIRECT in (default: current)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    register(sub, _size)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if getattr(a, "make_dir", False):
        try:  # the commands that write under --dir make it first (tune, info, ls take an existing one)
            os.makedirs(a.dir, exist_ok=True)
        except OSError as e:
            what = "it is a file; pass a directory (made if missing)" if os.path.isfile(a.dir) else e.strerror
            print(f"flashwrite {a.command}: error: cannot create --dir {a.dir}: {what}", file=sys.stderr)
            return 2
    try:
        rc = a.func(a)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `flashwrite diff A B | head`: the reader has what it wanted
        # What the Python docs advise: no more writes to the dead pipe, not even at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as a tool killed by the signal reports


if __name__ == "__main__":
    sys.exit(main())
