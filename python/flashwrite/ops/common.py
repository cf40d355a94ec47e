"""Shared by the operator commands: exit codes, error reporting, tables."""

from __future__ import annotations

import errno
import json
import sys
from typing import Any, Callable, Sequence

from ..errors import FlashwriteError
from ..targets.target import UnsupportedTargetError, shown

OK, PROBLEM, USAGE = 0, 1, 2
UNDETERMINED = 3  # diff: nothing differs by the stored checksums, some tensors they cannot compare


class UsageError(Exception):
    """Bad arguments the parser could not catch (exit code 2)."""


# A path that is not what the command takes (nothing there, a file for a directory, a
# directory for a file) is the operator's mistake, like a bad option: exit code 2.
BAD_PATH = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def bad_path_message(e: OSError) -> str:
    """The error naming its path, with what to do where it does not say already."""
    what, path = e.strerror or str(e), e.filename
    msg = what if path is None or str(path) in what else f"{path}: {what}"
    if e.errno == errno.ENOENT and not any(c in what for c in ":;`"):
        msg += " (check the path; `flashwrite ls DIR` lists the checkpoints in a directory)"
    elif e.errno == errno.ENOTDIR and not any(c in what for c in ":;`"):
        msg += " (pass a directory)"
    return msg


class Problem(Exception):
    """The command ran but found something wrong (exit code 1)."""


def _with_subject(a: Any, msg: str) -> str:
    """A message about a command's one input names it (a damaged stripe is named by its
    file alone; which checkpoint it is in, the command line says)."""
    inputs = [str(v) for v in (getattr(a, k, None) for k in ("ckpt", "src", "root", "dir")) if v is not None]
    if len(inputs) == 1 and not any(s in msg for s in (inputs[0], shown(inputs[0]))):
        return f"{inputs[0]}: {msg}"
    return msg


def guarded(fn: Callable[[Any], int]) -> Callable[[Any], int]:
    """Run a command: expected failures become one line on stderr and an exit code.

    Anything a damaged or hostile checkpoint, a missing path or a permission can
    raise is reported, not dumped as a traceback.
    """

    def run(a: Any) -> int:
        try:
            return fn(a)
        except BrokenPipeError:
            raise  # the reader went away (`| head`): main() ends quietly
        except (UsageError, UnsupportedTargetError) as e:  # a URL scheme or form flashwrite does not take
            print(f"flashwrite {a.command}: error: {e}", file=sys.stderr)
            return USAGE
        except OSError as e:
            if e.errno not in BAD_PATH:
                print(f"flashwrite {a.command}: {e}", file=sys.stderr)
                return PROBLEM
            print(f"flashwrite {a.command}: error: {bad_path_message(e)}", file=sys.stderr)
            return USAGE
        except (Problem, FlashwriteError, OSError, ValueError, KeyError, TypeError, RuntimeError,
                RecursionError, UnicodeError) as e:
            msg = str(e) or type(e).__name__
            if isinstance(e, KeyError) and e.args:
                msg = str(e.args[0])
            msg = _with_subject(a, msg)
            print(f"flashwrite {a.command}: {msg}", file=sys.stderr)
            return PROBLEM

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str, sort_keys=False))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = (),
                file: Any = None) -> None:
    """A plain aligned text table (stable for scripts that grep it, readable on a terminal)."""
    out = file or sys.stdout
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    print(line(cells[0]), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in cells[1:]:
        print(line(r), file=out)
