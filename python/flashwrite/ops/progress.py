"""Progress of long commands (verify, convert, tune, bench), on stderr.

On a terminal: a rich progress bar with bytes done, total and rate. Otherwise
(a pipe, a CI log): a plain line at most every few seconds and at the end, so
logs stay short and greppable. ``quiet`` prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from ..sizes import fmt_bytes


class Progress:
    """start(total, what) -> advance(n)* -> finish(); may be started again for the next phase."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None, force_plain: bool = False,
                 interval_s: float = 5.0):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.rich = not quiet and not force_plain and tty
        self.interval_s = interval_s
        self._bar: Any = None
        self._task: Any = None
        self.total = self.done = 0
        self.what = ""
        self._t0 = self._last = 0.0

    def start(self, total: int, what: str) -> None:
        self.finish()
        self.total, self.done, self.what = int(total), 0, what
        self._t0 = self._last = time.perf_counter()
        if self.quiet:
            return
        if self.rich:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                     TransferSpeedColumn(), TimeRemainingColumn(),
                                     console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(what, total=max(1, self.total))
        else:
            print(f"{what}: {fmt_bytes(self.total)} ...", file=self.stream, flush=True)

    def advance(self, n: int) -> None:
        self.done += int(n)
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=int(n))
            return
        now = time.perf_counter()
        if now - self._last >= self.interval_s:
            self._last = now
            print(self._line(now), file=self.stream, flush=True)

    def note(self, msg: str) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(msg)
        else:
            print(msg, file=self.stream, flush=True)

    def _line(self, now: float) -> str:
        el = max(now - self._t0, 1e-9)
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return (f"{self.what}: {fmt_bytes(self.done)} of {fmt_bytes(self.total)}{pct}, "
                f"{self.done / el / 1e6:.1f} MB/s, {el:.1f} s")

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = self._task = None
        elif self.what and not self.quiet:
            # Finished early (an error, Ctrl-C): say so, not "done", before the caller reports why.
            end = " done" if self.done >= self.total else " stopped"
            print(self._line(time.perf_counter()) + end, file=self.stream, flush=True)
        self.what = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


def step_logger(progress: Progress, steps: int, bytes_per_step: int, what: str) -> Callable[[str], None]:
    """A ``log`` callback for code that reports one line per finished step (the
    benchmark runner): each line is printed and moves the bar by one step's bytes."""
    progress.start(steps * bytes_per_step, what)

    def log(msg: str) -> None:
        progress.note(msg)
        if progress.done + bytes_per_step <= progress.total:
            progress.advance(bytes_per_step)

    return log
