"""SIGTERM preemption for a CheckpointManager.

On SIGTERM the manager finishes its save in flight and, if it was given a
``final_state``, saves that too; then the signal goes to the handler that was
installed before (the default one terminates the process). The handler runs
between bytecodes of the main thread, so a signal that arrives while the main
thread is inside a manager call is handled when that call returns (``call()``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable


class Preemption:
    """The SIGTERM side of one manager: ``drain()`` is the manager's work on a signal."""

    def __init__(self, drain: Callable[[], None]):
        self._drain = drain
        self.installed = False
        self.preempted = False
        self._prev: Any = None
        self._pending = False
        self._running = False
        self._in_call = 0

    def install(self, handler: Callable[[int, Any], None]) -> None:
        """Register ``handler`` (which calls ``on_signal``) for SIGTERM. Main thread only."""
        if self.installed:
            return
        self._prev = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, handler)
        self.installed = True

    def uninstall(self, handler: Callable[[int, Any], None]) -> None:
        """Put back the handler that was there before ``install``, if ours is still the one."""
        if not self.installed:
            return
        if signal.getsignal(signal.SIGTERM) == handler:
            prev = self._prev
            signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
        self.installed = False

    def enter_call(self) -> None:
        """A manager call begins (main thread): a SIGTERM now waits for its end."""
        self._in_call += 1

    def leave_call(self) -> None:
        """A manager call ends: a SIGTERM that came during it is handled now."""
        self._in_call -= 1
        if not self._in_call and self._pending:
            self._pending = False
            self.preempt(signal.SIGTERM, None)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self._in_call:
            self._pending = True
            return
        self.preempt(signum, frame)

    def preempt(self, signum: int, frame: Any) -> None:
        if self._running:
            return
        self._running = True
        self.preempted = True
        try:
            self._drain()
        finally:
            self._running = False
        prev = self._prev
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            # The default action: terminate, with the status a plain SIGTERM gives.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def call(self) -> _CallGuard | _NullGuard:
        """A guard around a manager call: a SIGTERM during it is handled when it returns.
        Only the main thread counts: signal handlers run there."""
        return _CallGuard(self) if threading.current_thread() is threading.main_thread() else _NULL_GUARD


class _CallGuard:
    def __init__(self, p: Preemption):
        self.p = p

    def __enter__(self) -> None:
        self.p.enter_call()

    def __exit__(self, *exc: Any) -> None:
        self.p.leave_call()


class _NullGuard:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


_NULL_GUARD = _NullGuard()
