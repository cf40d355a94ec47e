"""Scenarios run in a child process whose FLASHWRITE_CUDA_RUNTIME is tests/fake_cudart.cpp
(built by test_cuda.py), so the native D2H/H2D engine runs end to end on a machine without
a GPU. "Device memory" comes from the stand-in's allocator: the CPU cannot touch it (the
scenarios fill and read it with fake_cudart_poke/peek), and the stand-in refuses copies in
the wrong direction or with unregistered host memory. Each scenario prints one JSON line.

Usage: python fake_cuda_child.py SCENARIO DIR
"""

import ctypes
import json
import os
import sys
import time

import torch

from flashwrite import _core
from flashwrite.state.flatten import flatten
from flashwrite.format import read_manifest
from flashwrite.layout.plan import plan_files

fake = ctypes.CDLL(os.environ["FLASHWRITE_CUDA_RUNTIME"])  # the same handle the engine uses
fake.fake_cudart_enqueue_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
fake.fake_cudart_stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
fake.fake_cudart_malloc.restype = ctypes.c_void_p
fake.fake_cudart_malloc.argtypes = [ctypes.c_size_t]
fake.fake_cudart_poke.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
fake.fake_cudart_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
fake.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
fake.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
fake.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
fake.cudaHostUnregister.argtypes = [ctypes.c_void_p]


def to_device(t: torch.Tensor) -> int:
    """A stand-in device copy of t's bytes; returns its address (valid for the process)."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    addr = fake.fake_cudart_malloc(max(n, 1))
    assert addr, "fake_cudart_malloc failed"
    if n:
        assert fake.fake_cudart_poke(addr, t.data_ptr(), n) == 0
    return addr


def device_zeros(n: int) -> int:
    addr = fake.fake_cudart_malloc(max(n, 1))
    assert addr, "fake_cudart_malloc failed"
    return addr  # memfd pages start zeroed


def from_device(addr: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8)
    if n:
        assert fake.fake_cudart_peek(out.data_ptr(), addr, n) == 0
    return out


def state():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3_000_000, generator=g), "b": torch.arange(100_000, dtype=torch.int64),
            "c": torch.randn(333, generator=g), "h": torch.randn(1000, generator=g),
            "e": torch.empty(0), "s": torch.tensor(5, dtype=torch.int16)}


def save(sd, d, device_of, streams=(), engine=None, stripes=3, wait=True, on_device=lambda addr: None):
    """Stage sd into directory d; device_of(key) gives the segment's device (-1 = host):
    device segments are copied into stand-in device memory first (on_device(addr) then)."""
    os.makedirs(d, exist_ok=True)
    _, tensors, _ = flatten(sd)
    files = plan_files(tensors, stripes)
    def address(p, source):
        if device_of(p.key) < 0:
            return source.data_ptr()
        addr = to_device(source)
        on_device(addr)
        return addr

    segs = [(address(p, f.columns.sources[j]), p.nbytes, fi, p.offset, device_of(p.key))
            for fi, f in enumerate(files) for p, j in zip(f.tensors, f.members) if p.nbytes]
    eng = engine or _core.Engine(1 << 20)
    job = eng.start_save([(os.path.join(d, f.name), f.header, f.size) for f in files], segs,
                         [f.columns.sources for f in files], streams=list(streams))
    if wait:
        job.wait()
    return eng, job, files


def file_bytes(d, files):
    return [open(os.path.join(d, f.name), "rb").read() for f in files]


def scenario_save(d):
    sd = state()
    gpu_keys = {"a", "b", "c", "s"}
    eng, job, files = save(sd, d + "/gpu", lambda k: 0 if k in gpu_keys else -1, [(0, 0)])
    job.rethrow()
    _, again, _ = save(sd, d + "/again", lambda k: 0 if k in gpu_keys else -1, [(0, 0)], engine=eng)
    again.rethrow()
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    ref.rethrow()
    return {"same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files),
            "same_checksums": job.checksums() == ref.checksums(),
            "device_bytes": job.stats()["device_bytes"],
            "expected_device_bytes": sum(sd[k].numel() * sd[k].element_size() for k in gpu_keys),
            "pinned": eng.pool_pinned, "pin_error": eng.pin_error, "registered": fake.fake_cudart_registered(),
            "pin_s": [job.stats()["pin_s"], again.stats()["pin_s"]]}


def scenario_order(d):
    x = torch.zeros(8 << 20, dtype=torch.uint8)  # 8 MiB, saved from "device" memory
    xdev = []
    stream = ctypes.c_void_p()
    fake.fake_cudart_stream_create(ctypes.byref(stream))

    def fill_later(addr):
        # The caller's queued work: x becomes 7, 300 ms from now.
        xdev.append(addr)
        t_fence.append(time.perf_counter())
        assert fake.fake_cudart_enqueue_fill(stream, addr, 7, x.numel(), 300_000) == 0

    t_fence = []
    eng, job, files = save({"x": x}, d, lambda k: 0, [(0, stream.value)], wait=False, on_device=fill_later)
    # Times from the fence (on a loaded machine the setup before it takes a while).
    t0 = t_fence[0]
    returned_s = time.perf_counter() - t0
    staged_at_return = job.staged
    job.wait_staged()
    staged_s = time.perf_counter() - t0
    # The caller's next step, queued once staging is over: must not reach the checkpoint.
    assert fake.fake_cudart_enqueue_fill(stream, xdev[0], 9, x.numel(), 0) == 0
    job.wait()
    job.rethrow()
    data = file_bytes(d, files)[0][len(files[0].header):]
    return {"returned_s": returned_s, "staged_at_return": staged_at_return, "staged_s": staged_s,
            "all_sevens": data == bytes([7]) * x.numel()}


def scenario_two_devices(d):
    sd = state()
    eng, job, files = save(sd, d + "/gpu", lambda k: {"a": 1, "b": 0, "c": 1}.get(k, -1), [(0, 0), (1, 0)])
    job.rethrow()
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    return {"same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files)}


def scenario_bounded_and_failing(d):
    # The 3rd copy fails with a sticky error: the save reports it, every slot comes back,
    # and the next GPU save fails at once saying so (CUDA does not recover).
    sd = state()
    eng = _core.Engine(1 << 20, 4 << 20)
    _, job, _ = save(sd, d + "/bad", lambda k: 0, [(0, 0)], engine=eng)
    try:
        job.rethrow()
        error = None
    except RuntimeError as e:
        error = str(e)
    os.environ.pop("FAKE_CUDART_FAIL_COPY")  # read per call by the fake
    t0 = time.perf_counter()
    try:
        save(sd, d + "/again", lambda k: 0, [(0, 0)], engine=eng)[1].rethrow()
        second_error = None
    except RuntimeError as e:
        second_error = str(e)
    return {"error": error, "second_error": second_error, "second_s": time.perf_counter() - t0,
            "pool_bytes": eng.pool_bytes}


def scenario_bad_device(d):
    try:  # raised by start_save itself (asking whether the stream captures), or by the job
        _, job, _ = save({"x": torch.randn(1000)}, d, lambda k: 5, [(5, 0)])
        job.rethrow()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def scenario_pin_fails(d):
    eng, job, files = save(state(), d, lambda k: 0, [(0, 0)])
    job.rethrow()
    return {"pinned": eng.pool_pinned, "pin_error": eng.pin_error}


def _load(d, placements_for, flip_at=None, host_for=(), headers=False, chunk=8 << 20):
    import flashwrite as fw
    sd = state()
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        w.save(sd, d + "/ck")
    m = read_manifest(d + "/ck")
    if flip_at is not None:
        e = m.tensors["a"]
        with open(os.path.join(d, "ck", m.files[e.file].name), "r+b") as f:
            f.seek(e.offset + flip_at)
            b = f.read(1)
            f.seek(e.offset + flip_at)
            f.write(bytes([b[0] ^ 1]))
    specs = [(os.path.join(d, "ck", fe.name), fe.size) for fe in m.files]
    from flashwrite.format import piece_ranges
    pieces = [(e.file, off, n, int(h, 16)) for e in m.tensors.values()
              for (off, n), h in zip(piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums)]
    addrs = {k: device_zeros(m.tensors[k].nbytes) for k in placements_for}
    placements = [(m.tensors[k].file, m.tensors[k].offset, m.tensors[k].nbytes, 0, a) for k, a in addrs.items()]
    # Host placements (device -1) of the same load: owned CPU tensors, and the stripe headers.
    host = {k: torch.zeros(m.tensors[k].nbytes, dtype=torch.uint8) for k in host_for}
    placements += [(m.tensors[k].file, m.tensors[k].offset, t.numel(), -1, t.data_ptr()) for k, t in host.items()]
    if headers:
        for i, fe in enumerate(m.files):
            host[f"header{i}"] = t = torch.zeros(fe.header_bytes, dtype=torch.uint8)
            placements.append((i, 0, fe.header_bytes, -1, t.data_ptr()))
    job = _core.start_load(specs, pieces, "auto", 4, chunk, 2, True, placements=placements, streams=[(0, 0)])
    job.wait()
    dst = {k: from_device(a, m.tensors[k].nbytes) for k, a in addrs.items()}
    dst.update(host)
    return sd, m, dst, job


def scenario_load(d):
    sd, m, dst, job = _load(d, ["a", "b", "s"])
    job.rethrow()
    bufs = job.buffers()
    host_ok = True
    for k in ("c", "h"):  # not placed: still in the host buffers, as before
        e = m.tensors[k]
        host = torch.frombuffer(bufs[e.file], dtype=torch.uint8)[e.offset:e.offset + e.nbytes]
        host_ok &= torch.equal(host, sd[k].view(torch.uint8).reshape(-1))
    headers_ok = all(bytes(memoryview(bufs[i])[:fe.header_bytes]) ==
                     open(os.path.join(d, "ck", fe.name), "rb").read(fe.header_bytes) for i, fe in enumerate(m.files))
    return {"mismatches": len(job.mismatches()),
            "placed_ok": all(torch.equal(t, sd[k].reshape(-1).view(torch.uint8)) for k, t in dst.items()),
            "host_ok": bool(host_ok), "headers_ok": headers_ok}


def scenario_load_mixed(d):
    # Every byte placed, on the device or the host: no file is read into a whole buffer.
    sd, m, dst, job = _load(d, ["a", "s"], host_for=["b", "c", "h"], headers=True)
    job.rethrow()
    headers_ok = all(bytes(dst[f"header{i}"].numpy()) == open(os.path.join(d, "ck", fe.name), "rb").read(fe.header_bytes)
                     for i, fe in enumerate(m.files))
    return {"mismatches": len(job.mismatches()), "buffers": [b is not None for b in job.buffers()],
            "placed_ok": all(torch.equal(dst[k], sd[k].reshape(-1).view(torch.uint8)) for k in ("a", "s", "b", "c", "h")),
            "headers_ok": headers_ok}


def scenario_load_damaged(d):
    flip = (9 << 20) + 5  # inside the second 8 MiB read chunk of tensor "a" (12 MB)
    sd, m, dst, job = _load(d, ["a"], flip_at=flip)
    job.rethrow()
    a = dst["a"]
    src = sd["a"].view(torch.uint8).reshape(-1)
    e = m.tensors["a"]
    chunk = 8 << 20
    lo = (e.offset + flip) // chunk * chunk - e.offset  # the damaged read chunk, in tensor bytes
    hi = lo + chunk
    return {"mismatches": len(job.mismatches()),
            "damaged_chunk_untouched": bool(torch.all(a[lo:hi] == 0)),
            "rest_placed": torch.equal(a[:lo], src[:lo]) and torch.equal(a[hi:], src[hi:])}


def scenario_load_failing(d):
    try:
        _, _, _, job = _load(d, ["a"])
        job.rethrow()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def _stream():
    s = ctypes.c_void_p()
    assert fake.fake_cudart_stream_create(ctypes.byref(s)) == 0
    return s


def _end_capture(stream):
    graph = ctypes.c_void_p()
    return fake.cudaStreamEndCapture(stream, ctypes.byref(graph))


def scenario_capture_refused(d):
    # The caller's current stream is being captured (torch.cuda.graph, global mode):
    # a save or a load ordered after it is refused before any file or copy.
    cap = _stream()
    assert fake.cudaStreamBeginCapture(cap, 0) == 0
    errors = {}
    try:
        save({"x": torch.randn(1000)}, d + "/ck", lambda k: 0, [(0, cap.value)])
    except RuntimeError as e:
        errors["save"] = str(e)
    try:
        _core.start_load([(os.path.join(d, "none"), 4096)], [], placements=[(0, 0, 16, 0, device_zeros(16))],
                         streams=[(0, cap.value)])
    except RuntimeError as e:
        errors["load"] = str(e)
    files = sorted(os.listdir(d + "/ck")) if os.path.isdir(d + "/ck") else []
    return {"errors": errors, "files": files, "copies": fake.fake_cudart_copies(),
            "captured": fake.fake_cudart_captured(), "end_capture": _end_capture(cap)}


def scenario_capture_concurrent(d):
    # Another thread captures in global mode (torch.cuda.graph's default) while a save
    # of GPU tensors ordered after a stream that is not capturing runs from start (the
    # pool is pinned then) to durable: flashwrite's threads sync in relaxed mode, so
    # the capture survives and the checkpoint is exact.
    import threading
    cap, mine = _stream(), _stream()
    began, end = threading.Event(), threading.Event()
    result = {}

    def capturer():
        result["begin"] = fake.cudaStreamBeginCapture(cap, 0)
        began.set()
        end.wait()
        result["end"] = _end_capture(cap)

    t = threading.Thread(target=capturer)
    t.start()
    began.wait()
    sd = state()
    try:
        eng, job, files = save(sd, d + "/gpu", lambda k: 0 if k in {"a", "b", "c"} else -1, [(0, mine.value)])
        job.rethrow()
        err = None
    except RuntimeError as e:
        err, files = str(e), None
    end.set()
    t.join()
    same = False
    if files is not None:
        _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
        same = file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files)
    return {"error": err, "same_files": same, "begin": result["begin"], "end_capture": result["end"]}


def _small_state(n):
    g = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(256 * (1 + i % 16), generator=g) for i in range(n)}  # 1..16 KiB each


def scenario_small_tensors(d):
    # Small tensors laid out on the device as in their stripes (what cuda.gather does
    # with torch.cat): the engine moves each chunk's run with one copy, not one per tensor.
    n = 3000
    sd = _small_state(n)
    _, tensors, _ = flatten(sd)
    files = plan_files(tensors, 2)
    bases = {fi: fake.fake_cudart_malloc(f.size) for fi, f in enumerate(files)}
    segs = []
    for fi, f in enumerate(files):
        for p, j in zip(f.tensors, f.members):
            src = f.columns.sources[j]
            assert fake.fake_cudart_poke(bases[fi] + p.offset, src.data_ptr(), p.nbytes) == 0
            segs.append((bases[fi] + p.offset, p.nbytes, fi, p.offset, 0))
    os.makedirs(d + "/gpu")
    eng = _core.Engine(1 << 20)
    c0 = fake.fake_cudart_copies()
    job = eng.start_save([(os.path.join(d, "gpu", f.name), f.header, f.size) for f in files], segs,
                         [f.columns.sources for f in files], streams=[(0, 0)])
    job.wait()
    job.rethrow()
    save_copies = fake.fake_cudart_copies() - c0
    # The same tensors each in a device allocation of its own: one copy per tensor.
    c0 = fake.fake_cudart_copies()
    _, scattered, sfiles = save(sd, d + "/scattered", lambda k: 0, [(0, 0)], stripes=2)
    scattered.rethrow()
    scattered_copies = fake.fake_cudart_copies() - c0
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1, stripes=2)
    same = file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files)
    # Load back into one device buffer per stripe, each tensor where the stripe has it.
    import flashwrite as fw
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        w.save(sd, d + "/ck")
    m = read_manifest(d + "/ck")
    from flashwrite.format import piece_ranges
    specs = [(os.path.join(d, "ck", fe.name), fe.size) for fe in m.files]
    pieces = [(e.file, off, nb, int(h, 16)) for e in m.tensors.values()
              for (off, nb), h in zip(piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums)]
    dst = {fi: device_zeros(fe.size) for fi, fe in enumerate(m.files)}
    placements = [(e.file, e.offset, e.nbytes, 0, dst[e.file] + e.offset) for e in m.tensors.values()]
    c0 = fake.fake_cudart_copies()
    lj = _core.start_load(specs, pieces, "auto", 4, 8 << 20, 2, True, placements=placements, streams=[(0, 0)])
    lj.wait()
    lj.rethrow()
    load_copies = fake.fake_cudart_copies() - c0
    back_ok = all(torch.equal(from_device(dst[e.file] + e.offset, e.nbytes), sd[k].view(torch.uint8))
                  for k, e in m.tensors.items())
    return {"tensors": n, "save_copies": save_copies, "scattered_copies": scattered_copies, "same_files": same,
            "load_copies": load_copies, "load_ok": back_ok, "mismatches": len(lj.mismatches())}


def scenario_bounce_pools(d):
    # Loads with three read chunk sizes: the bounce pool of the last is kept, the
    # others are unpinned and freed; release_bounce_pool() gives the last one back.
    out = {"registered": [], "bounce_bytes": []}
    for chunk in (1 << 20, 2 << 20, 4 << 20):
        sd, m, dst, job = _load(d + f"/{chunk}", ["a", "b"], chunk=chunk)
        job.rethrow()
        assert all(torch.equal(t, sd[k].reshape(-1).view(torch.uint8)) for k, t in dst.items())
        del job
        out["registered"].append(fake.fake_cudart_registered())
        out["bounce_bytes"].append(_core.bounce_pool_bytes())
    out["released"] = _core.release_bounce_pool()
    out["registered_after_release"] = fake.fake_cudart_registered()
    return out


def scenario_stale_registration(d):
    import mmap
    size = 1 << 20
    out = {}
    # A registration left at this address by an earlier mapping (unmapped without
    # cudaHostUnregister): dropped, and the new pages pinned.
    a = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(a))
    assert fake.cudaHostRegister(addr, size, 1) == 0
    out["same_base"] = _core._cuda_pin(addr, size, 0)
    out["registered"] = fake.fake_cudart_registered()
    # One that only overlaps the range cannot be dropped from here: an error.
    b = mmap.mmap(-1, size)
    baddr = ctypes.addressof(ctypes.c_char.from_buffer(b))
    assert fake.cudaHostRegister(baddr + 4096, 4096, 1) == 0
    out["overlap"] = _core._cuda_pin(baddr, size, 0)
    return out


def scenario_fork_after_info(d):
    # backend_info() in the parent, then fork(): the child can still use CUDA. After
    # backend_info(initialize_cuda=True) it cannot (as with real CUDA).
    import flashwrite as fw
    out = {"info": fw.backend_info(d)["cuda"]}

    def child_saves(sub):
        pid = os.fork()
        if pid == 0:
            import faulthandler
            faulthandler.dump_traceback_later(120, exit=True)  # a hung child never outlives the test
            code = 1
            try:
                _, job, files = save(state(), os.path.join(d, sub), lambda k: 0, [(0, 0)])
                job.rethrow()
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported through the exit code and stderr
                print(f"child: {e}", file=sys.stderr, flush=True)
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    out["child_after_info"] = child_saves("a")
    out["initialized_info"] = fw.backend_info(d, initialize_cuda=True)["cuda"]
    out["child_after_init"] = child_saves("b")
    return out


def _big_mappings(min_bytes):
    """{start address: policy} of the mappings of at least min_bytes (/proc/self/numa_maps)."""
    out = {}
    with open("/proc/self/numa_maps") as f:
        for line in f:
            parts = line.split()
            kv = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
            pages = max(int(kv.get("anon", 0)), int(kv.get("mapped", 0)))
            if pages * int(kv.get("kernelpagesize_kB", 4)) * 1024 >= min_bytes:
                out[parts[0]] = parts[1]
    return out


def scenario_numa(d):
    """The pool pinned for device 0 is faulted in on that device's node."""
    before = _big_mappings(32 << 20)
    eng = _core.Engine(8 << 20)
    eng.reserve(64 << 20, device=0)
    new = {a: p for a, p in _big_mappings(32 << 20).items() if a not in before}
    return {"node": eng.pool_numa_node, "error": eng.pool_numa_error, "pinned": eng.pool_pinned,
            "new_policies": sorted(new.values())}


def scenario_pin_outside_lock(d):
    """Pinning a new slab (slow: FAKE_CUDART_REGISTER_DELAY_MS) does not hold the pool's lock."""
    import threading
    eng = _core.Engine(8 << 20)
    took = {}

    def grow():
        t0 = time.monotonic()
        eng.reserve(32 << 20, device=0)
        took["reserve_s"] = time.monotonic() - t0

    t = threading.Thread(target=grow)
    t.start()
    time.sleep(0.4)
    t0 = time.monotonic()
    during = eng.pool_bytes, eng.trim()
    took["query_s"] = time.monotonic() - t0
    t.join()
    return {**took, "during": list(during), "after": eng.pool_bytes, "pinned": eng.pool_pinned,
            "trim_after": eng.trim()}


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    print(json.dumps(globals()["scenario_" + name](d)))
