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
page costs the hashing of one piece. A piece's first and last page may be shared with
other memory (a heap tensor's neighbour, the allocator's bookkeeping right before it): the
record keeps the piece's own bytes in those pages (at most two partial pages), captured
before it was hashed, and a write that reached only such a page costs a comparison of
those bytes, not the hashing of the piece.

Why a record can be trusted: its bytes were hashed after a scan protected all of its pages
(step 1 precedes step 3); every later scan covers every record, so a write to any of those
pages makes the next scan forget it; a record survives only while every scan finds its
pages present, anonymous and unwritten. The lock keeps scans from interleaving with a
pass's hashing. As with any save, the state must not change while ``save_async`` has not
returned (the compare pass runs inside that call).

Defence in depth: the watch decides what is never hashed again, so a defect in it (or in
the kernel) would be silent. A record vouches for its piece at most ``recheck_every() - 1``
passes in a row (``FLASHWRITE_WATCH_RECHECK_EVERY``, default ``RECHECK_EVERY`` = 16; 1
hashes every piece at every pass); at the next one the piece is hashed again
(``SaveStats.rechecked_bytes``). A hash that differs from the record means the watch missed
a write: the piece counts as changed (its stripe is written), and the save warns, naming
the tensor (``SaveStats.watch_misses``).

``FLASHWRITE_WRITE_WATCH=off`` hashes everything, as before; where the kernel cannot watch
(older than 6.7, userfaultfd forbidden by seccomp) everything is hashed, and ``why_off()``
says why.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from . import _core

MIN_BYTES = 1 << 20  # smaller tensors are hashed: cheap, and each watched range may split a mapping
ENV = "FLASHWRITE_WRITE_WATCH"
RECHECK_ENV = "FLASHWRITE_WATCH_RECHECK_EVERY"
RECHECK_EVERY = 16  # a record vouches for its piece at most this many passes minus one in a row

# Tests only: called with each scanned piece, True makes the scan report it unwritten (a
# watch that misses a write on purpose, which the periodic re-hash must catch).
BLIND: Callable[[Range], bool] | None = None

Range = tuple[int, int]  # (address, nbytes) of one checksummed piece
PAGE = 4096
INSIDE, HEAD, TAIL = 1, 2, 4  # _core.WriteWatch.scan's flags
Edges = tuple[bytes, bytes]  # a piece's own bytes in its first and in its last page, where shared


def _edges(rng: Range) -> Edges:
    a, n = rng
    head = min(n, -a % PAGE)
    tail = min(n, (a + n) % PAGE)
    return (ctypes.string_at(a, head) if head else b"", ctypes.string_at(a + n - tail, tail) if tail else b"")


class _Watch:
    """The process's watch and what it recorded (one per process: a scan protects pages
    for every record, so two watches would hide writes from each other)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        # piece -> (its XXH3, its edges when hashed, passes that trusted it since)
        self.records: dict[Range, tuple[int, Edges, int]] = {}
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


def recheck_every() -> int:
    """How many passes in a row may use a record: ``FLASHWRITE_WATCH_RECHECK_EVERY`` (an
    integer >= 1), else ``RECHECK_EVERY``."""
    v = os.environ.get(RECHECK_ENV, "").strip()
    if not v:
        return RECHECK_EVERY
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{RECHECK_ENV}={v!r}: expected an integer >= 1 (1: hash every piece at every save)")
    return n


class Pass:
    """What one compare pass may skip and what it records (see the module's steps)."""

    def __init__(self, watch: _Watch | None, protected: set[Range], every: int = RECHECK_EVERY):
        self._watch, self._protected, self._every = watch, protected, every
        self._edges: dict[Range, Edges] = {}
        self._due: dict[Range, int] = {}  # pieces hashed again: the checksum their record vouched for
        self.watched_bytes = 0
        self.rechecked_bytes = 0

    def known(self, rng: Range) -> int | None:
        """The checksum of the piece at ``rng`` if no write reached it since it was hashed
        (and its record is not due for a re-hash), else None: hash it (after every call to
        ``known``: its edges are kept now)."""
        if self._watch is None or rng not in self._protected:
            return None
        rec = self._watch.records.get(rng)
        if rec is None or rec[2] + 1 >= self._every:
            if rec is not None:
                self._due[rng] = rec[0]
            self._edges[rng] = _edges(rng)
            return None
        self._watch.records[rng] = (rec[0], rec[1], rec[2] + 1)
        self.watched_bytes += rng[1]
        return rec[0]

    def record(self, rng: Range, checksum: int) -> bool:
        """The piece at ``rng`` was hashed in this pass, after its pages were protected and
        its edges kept (``known``). True if it was a re-hash of a piece whose record
        vouched for another checksum: a write the watch missed."""
        edges = self._edges.get(rng)
        if self._watch is None or edges is None:
            return False
        self._watch.records[rng] = (checksum, edges, 0)
        vouched = self._due.pop(rng, None)
        if vouched is None:
            return False
        self.rechecked_bytes += rng[1]
        return vouched != checksum


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
    every = recheck_every()
    if w.core is None or not ranges:
        yield Pass(None, set())
        return
    with w.lock:
        wanted = list(dict.fromkeys(ranges))
        armed = w.core.arm(wanted)
        fresh = [r for r, ok in zip(wanted, armed) if ok]
        fresh_set = set(fresh)
        scanned = [r for r in w.records if r not in fresh_set] + fresh
        for r, f in zip(scanned, w.core.scan(scanned)):
            if BLIND is not None and BLIND(r):
                f = 0
            rec = w.records.get(r)
            # A write to a page of its own forgets it; to a first or last page shared with
            # other memory, only if the piece's own bytes there changed.
            if rec is not None and (f & INSIDE or (f & (HEAD | TAIL) and _edges(r) != rec[1])):
                del w.records[r]
        yield Pass(w, fresh_set, every)
