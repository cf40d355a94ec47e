"""The GIL is released around every blocking native call (issue 24: the bindings
split by area keep that). The staging pool's getters take the pool's lock, which a
reserve() holds while it faults in a new slab: a getter called meanwhile waits, and
must wait without the GIL, or every Python thread stops with it."""

import threading
import time

from flashwrite import _core


def test_pool_getters_wait_for_a_reserve_without_the_gil():
    engine = _core.Engine(16 << 20)
    ticks, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=spin)
    reserving = threading.Thread(target=engine.reserve, args=(512 << 20,))
    ticker.start()
    reserving.start()
    try:
        time.sleep(0.02)  # the reserve holds the pool's lock by now, for far longer
        waits, got = [], []
        for get in (lambda: engine.pool_bytes, lambda: engine.file_backed, lambda: engine.pool_pinned,
                    lambda: engine.backing_error, engine.trim):
            t0 = time.perf_counter()
            got.append(get())
            waits.append((t0, time.perf_counter()))
    finally:
        reserving.join()
        stop.set()
        ticker.join()
    t0, t1 = waits[0]
    assert t1 - t0 > 0.05, "pool_bytes did not wait for the reserve: nothing shown"
    inside = [x for x in ticks if t0 <= x <= t1]
    # With the GIL held while it waits, the ticker gets no tick in the window (0 in
    # 4.9 s before the fix); the bound leaves room for a loaded machine's scheduling.
    assert len(inside) >= max(3, 0.05 * (t1 - t0) / 0.001), (len(inside), t1 - t0)
    assert got[0] >= 512 << 20  # it saw the pool the reserve grew
