"""Ctrl-C and the few steps it must not break.

Python runs a SIGINT handler between bytecodes of the main thread, so a ``KeyboardInterrupt``
can surface inside any Python-level function, among them the stdlib's ``Condition.__exit__``
(which then leaves the condition's lock held by the interrupted thread) and
``Thread.start``'s wait for the new thread (which then never registers it with the
executor that made it). A thread that later needs that lock, or an exit that joins an
executor's threads, then hangs for ever. Three tools keep flashwrite's saves clear of
that (issue 44 item 1):

- ``wait_until(ended, timeout)`` waits holding no lock: a sleep is interrupted cleanly;
- ``sigint_deferred(step)`` runs a short step that starts a thread with Ctrl-C held back,
  and raises it afterwards;
- ``ignoring_sigint(step)`` runs a bounded step of the exit to its end whatever comes.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

MAX_PAUSE_S = 0.005  # the longest wait_until sleeps between looks (its latency)


def wait_until(ended: Callable[[], bool], timeout: float | None = None) -> bool:
    """Sleep until ``ended()`` (a plain read, no lock); True when it has, False when
    ``timeout`` ran out first. Pauses start at 0.2 ms and double up to ``MAX_PAUSE_S``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.0002
    while not ended():
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            pause = min(pause, left)
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_S)
    return True


def sigint_deferred(step: Callable[[], T]) -> T:
    """Run ``step`` (short: it starts a thread, hands over work) with a Ctrl-C that comes
    meanwhile held back and raised once it has returned. Off the main thread, or where
    SIGINT is not Python's to handle, ``step`` just runs."""
    held: list[int] = []
    try:  # first of all: until this has returned, a Ctrl-C interrupts as usual
        before = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    except ValueError:  # not the main thread: no handler runs here
        return step()
    try:
        out = step()
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.SIG_DFL)
    if held:
        if callable(before):
            before(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt here
        elif before != signal.SIG_IGN:
            raise KeyboardInterrupt
    return out


def ignoring_sigint(step: Callable[[], None], keep: bool = True) -> None:
    """Run ``step`` (bounded: joins of cancelled jobs, removals) to its end whatever
    Ctrl-Cs come. With ``keep``, SIGINT stays ignored for the rest of the exit, whose
    joins of the remaining threads must not be broken either. A KeyboardInterrupt already
    pending when it was set is raised once more, and ``step`` is run again (idempotent)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    while True:
        try:
            step()
            break
        except KeyboardInterrupt:
            continue
    if main and not keep and before is not None:
        signal.signal(signal.SIGINT, before)
