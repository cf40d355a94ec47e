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
from flashwrite.flatten import flatten
from flashwrite.format import read_manifest
from flashwrite.plan import plan_files

fake = ctypes.CDLL(os.environ["FLASHWRITE_CUDA_RUNTIME"])  # the same handle the engine uses
fake.fake_cudart_enqueue_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
fake.fake_cudart_stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
fake.fake_cudart_malloc.restype = ctypes.c_void_p
fake.fake_cudart_malloc.argtypes = [ctypes.c_size_t]
fake.fake_cudart_poke.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
fake.fake_cudart_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


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
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    ref.rethrow()
    return {"same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files),
            "same_checksums": job.checksums() == ref.checksums(),
            "device_bytes": job.stats()["device_bytes"],
            "expected_device_bytes": sum(sd[k].numel() * sd[k].element_size() for k in gpu_keys),
            "pinned": eng.pool_pinned, "pin_error": eng.pin_error, "registered": fake.fake_cudart_registered()}


def scenario_order(d):
    x = torch.zeros(8 << 20, dtype=torch.uint8)  # 8 MiB, saved from "device" memory
    xdev = []
    stream = ctypes.c_void_p()
    fake.fake_cudart_stream_create(ctypes.byref(stream))

    def fill_later(addr):
        # The caller's queued work: x becomes 7, 300 ms from now.
        xdev.append(addr)
        assert fake.fake_cudart_enqueue_fill(stream, addr, 7, x.numel(), 300_000) == 0

    t0 = time.perf_counter()
    eng, job, files = save({"x": x}, d, lambda k: 0, [(0, stream.value)], wait=False, on_device=fill_later)
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
    # The 3rd copy fails: the save reports it, every slot comes back, the next save works.
    sd = state()
    eng = _core.Engine(1 << 20, 4 << 20)
    _, job, _ = save(sd, d + "/bad", lambda k: 0, [(0, 0)], engine=eng)
    try:
        job.rethrow()
        error = None
    except RuntimeError as e:
        error = str(e)
    os.environ.pop("FAKE_CUDART_FAIL_COPY")  # read per call by the fake
    _, job2, files2 = save(sd, d + "/good", lambda k: 0, [(0, 0)], engine=eng)
    job2.rethrow()
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    return {"error": error, "second_ok": file_bytes(d + "/good", files2) == file_bytes(d + "/cpu", ref_files),
            "pool_bytes": eng.pool_bytes}


def scenario_bad_device(d):
    _, job, _ = save({"x": torch.randn(1000)}, d, lambda k: 5, [(5, 0)])
    try:
        job.rethrow()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def scenario_pin_fails(d):
    eng, job, files = save(state(), d, lambda k: 0, [(0, 0)])
    job.rethrow()
    return {"pinned": eng.pool_pinned, "pin_error": eng.pin_error}


def _load(d, placements_for, flip_at=None, host_for=(), headers=False):
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
    job = _core.start_load(specs, pieces, "auto", 4, 8 << 20, 2, True, placements=placements, streams=[(0, 0)])
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


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    print(json.dumps(globals()["scenario_" + name](d)))
