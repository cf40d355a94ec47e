"""Tensors that no write reached since a save last hashed them are not hashed again.

An incremental save tells an unchanged tensor from a changed one by hashing it
(``incremental._changed``): for a frozen base model that is the whole model at every
save, bound by memory bandwidth, and it is most of such a save's time. The kernel can say
which memory was written instead (``_core.WriteWatch``: userfaultfd write-protection in
asynchronous mode and ``PAGEMAP_SCAN``, Linux 6.7, the mechanism behind "write watches"
of other systems). A write to a protected page costs one minor fault, once, and only
clears the page's bit; nothing waits on it.

One compare pass (``compare_pass``), under one process-wide lock:

1. arm (register) the pages of every checksummed piece it may hash (of host tensors of
   at least ``MIN_BYTES``, not pinned: a device writes pinned memory by DMA, which the
   kernel does not see), then scan them together with every piece recorded before, in
   one call: a recorded piece with a page written, absent or shared since its last scan
   is forgotten, and every page scanned is protected again;
2. a piece still recorded has its recorded checksum: no hashing (counted in
   ``SaveStats.watched_bytes``);
3. the others are hashed as before, and recorded.

Records are per piece (the checksum blocks of the format), not per tensor: a write to one
page costs the hashing of one piece, and so does the allocator's bookkeeping in the page
a heap tensor shares with its neighbour.

Why a record can be trusted: its bytes were hashed after a scan protected all of its pages
(step 1 precedes step 3); every later scan covers every record, so a write to any of those
pages makes the next scan forget it; a record survives only while every scan finds its
pages present, anonymous and unwritten. The lock keeps scans from interleaving with a
pass's hashing. As with any save, the state must not change while ``save_async`` has not
returned (the compare pass runs inside that call).

``FLASHWRITE_WRITE_WATCH=off`` hashes everything, as before; where the kernel cannot watch
(older than 6.7, userfaultfd forbidden by seccomp) everything is hashed, and ``why_off()``
says why.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import _core

MIN_BYTES = 1 << 20  # smaller tensors are hashed: cheap, and each watched range may split a mapping
ENV = "FLASHWRITE_WRITE_WATCH"

Range = tuple[int, int]  # (address, nbytes) of one checksummed piece


class _Watch:
    """The process's watch and what it recorded (one per process: a scan protects pages
    for every record, so two watches would hide writes from each other)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.records: dict[Range, int] = {}  # piece -> its XXH3
        self.core: _core.WriteWatch | None = None
        self.why = ""
        setting = os.environ.get(ENV, "auto").strip().lower()
        if setting in ("off", "0", "no", "false"):
            self.why = f"{ENV}={setting}"
        elif setting not in ("auto", "on", "1", "yes", "true", ""):
            raise ValueError(f"{ENV}={setting!r}: expected auto or off")
        else:
            try:
                self.core = _core.WriteWatch()
            except OSError as e:
                self.why = f"the kernel cannot watch writes here: {e}"


_watch: _Watch | None = None
_watch_lock = threading.Lock()


def _get() -> _Watch:
    global _watch
    with _watch_lock:
        if _watch is None or _watch.pid != os.getpid():  # a fork's child starts afresh
            _watch = _Watch()
        return _watch


def why_off() -> str:
    """Why incremental saves hash every tensor they compare in this process, or "" if
    the kernel's write watch spares them that."""
    return _get().why


class Pass:
    """What one compare pass may skip and what it records (see the module's steps)."""

    def __init__(self, watch: _Watch | None, protected: set[Range]):
        self._watch, self._protected = watch, protected
        self.watched_bytes = 0

    def known(self, rng: Range) -> int | None:
        """The checksum of the piece at ``rng`` if no write reached it since it was hashed,
        else None (hash it)."""
        if self._watch is None or rng not in self._protected:
            return None
        h = self._watch.records.get(rng)
        if h is not None:
            self.watched_bytes += rng[1]
        return h

    def record(self, rng: Range, checksum: int) -> None:
        """The piece at ``rng`` was hashed in this pass, after its pages were protected."""
        if self._watch is not None and rng in self._protected:
            self._watch.records[rng] = checksum


def eligible(address: int, nbytes: int, tensor: object) -> bool:
    """Whether a host tensor's bytes at ``address`` are worth watching (and can be)."""
    if nbytes < MIN_BYTES or not address:
        return False
    is_pinned = getattr(tensor, "is_pinned", None)
    try:
        return not (is_pinned is not None and is_pinned())
    except RuntimeError:  # no CUDA runtime to ask: nothing is pinned
        return True


@contextmanager
def compare_pass(ranges: Sequence[Range]) -> Iterator[Pass]:
    """One compare pass over the host pieces ``ranges`` it may hash (steps 1-3 of the
    module's docstring); the caller hashes what ``Pass.known`` does not answer and records
    what it hashed, inside the ``with``."""
    w = _get()
    if w.core is None or not ranges:
        yield Pass(None, set())
        return
    with w.lock:
        wanted = list(dict.fromkeys(ranges))
        armed = w.core.arm(wanted)
        fresh = [r for r, ok in zip(wanted, armed) if ok]
        old = list(w.records)
        dirty = w.core.scan(old + fresh)
        for r, d in zip(old, dirty):
            if d:
                del w.records[r]
        yield Pass(w, set(fresh))
