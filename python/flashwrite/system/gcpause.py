"""Pause Python's cyclic garbage collector around per-tensor work.

Flattening, planning and loading a state of 100,000 tensors allocates hundreds of
thousands of small objects (nodes, entries, tensors). Each allocation burst starts
a collection that walks every live object, so on such states the collector costs
more than the work itself (measured: 5x on reading tensor attributes alone). None
of that work creates reference cycles that need collecting while it runs.

``paused()`` disables the collector for the duration of the block and restores it
afterwards (nested and concurrent pauses are counted: the collector comes back
only when the last one ends, and only if it was enabled before the first).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
