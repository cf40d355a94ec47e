"""The ``flashwrite`` command: demo, verify, info; ls, inspect, diff, convert, tune (ops/).

``bench`` and ``overhead`` moved to a source checkout's ``benchmarks/`` (issue 36); asked
for, they say where (``MOVED``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Sequence

from .._core import __version__
from ..errors import FlashwriteError
from ..system.info import backend_info
from .cli import register
from . import demo
from .common import BAD_PATH, bad_path_message
from .ls import record_verified
from .progress import Progress
from ..loading.load import verify
from ..system.sizes import parse_size
from ..targets.locate import kind_of
from ..targets.target import UnsupportedTargetError


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_demo(a: argparse.Namespace) -> int:
    return demo.main(a.size, a.dir, device_tool=a.device_tool, drop_caches=not a.no_drop_caches, plain=a.plain,
                     quiet=a.quiet, json_path=a.json)


# Commands that left the wheel (issue 36): what ships to every training node holds no
# benchmark harness. Each now lives in a source checkout's benchmarks/, same flags.
MOVED = {"bench": "benchmarks/compare.py", "overhead": "benchmarks/overhead.py"}


def moved(command: str, args: Sequence[str]) -> int:
    """Exit 2, naming the checkout script that took ``command``'s place, with the same arguments."""
    line = " ".join(["python", MOVED[command], *(shlex.quote(x) for x in args)])
    print(f"flashwrite {command}: error: the benchmark harness is no longer part of the installed package "
          f"(it ships to every training node); from a source checkout of flashwrite run:\n  {line}\n"
          f"(same flags; see benchmarks/README.md). For a quick look on this machine: flashwrite demo",
          file=sys.stderr)
    return 2


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
    if kind is None:
        print(f"flashwrite info: error: {a.dir}: flashwrite reads local (or mounted) paths and nfs:// URLs",
              file=sys.stderr)
        return 2
    if not kind.os_paths:  # nfs://: the machine's facts, and the server asked where the path is
        try:
            info = backend_info(a.dir)
        except (ValueError, UnsupportedTargetError) as e:  # the URL itself is wrong
            print(f"flashwrite info: error: {e}", file=sys.stderr)
            return 2
        except (OSError, FlashwriteError) as e:  # the server: unreachable, refused, no such export
            print(f"flashwrite info: error: {e}", file=sys.stderr)
            return 1
        return _print_info(info, a.json)
    if not os.path.exists(a.dir):
        print(f"flashwrite info: error: {a.dir}: no such directory; pass an existing directory to probe "
              "(default: the current one)", file=sys.stderr)
        return 2
    return _print_info(backend_info(a.dir), a.json)


def _print_info(info: dict, as_json: bool) -> int:
    if as_json:
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

    d = sub.add_parser("demo", help="save + load a synthetic training state, side by side with torch.save/torch.load")
    d.add_argument("--size", type=_size, default=_size("512MiB"), help="training state size (default 512MiB)")
    d.add_argument("--dir", default=".", help="where to write checkpoints (a temporary folder inside it is "
                   "removed afterwards; default: the current directory)")
    d.add_argument("--device-tool", choices=["auto", "fio", "probe"], default="auto",
                   help="how to measure the device limit: fio (default when installed) or the in-tree probe")
    d.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache before saves and loads (loads may then be warm)")
    d.add_argument("--plain", action="store_true", help="plain-text table even if rich is installed")
    d.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    d.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    d.set_defaults(func=cmd_demo, make_dir=True)

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
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in MOVED:
        return moved(args[0], args[1:])
    a = _parser().parse_args(args)
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
