"""Scenarios for the staging pool's pinning on the stand-in CUDA runtime (issue 37 items 2
and 6): pinned in bounded slabs off the caller's thread, a failed registration that leaves
only its slab pageable, the wait figures of SaveStats, the load bounce pool across GPUs.
Run like fake_cuda_child.py (python fake_cuda_child3.py SCENARIO DIR); each prints one JSON line."""

import ctypes
import json
import sys
import threading
import time

import torch

from fake_cuda_child import _load, fake, file_bytes, save, state

fake.fake_cudart_log.argtypes = [ctypes.c_char_p, ctypes.c_int]


def call_log():
    """The stand-in's call log: [(call, tid, ...)] in the order the calls happened."""
    n = fake.fake_cudart_log(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    fake.fake_cudart_log(buf, n + 1)
    return [tuple(e.split(" ")) for e in buf.value.decode().split(";") if e]


def _big_state():
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(3 << 20, generator=g), "b": torch.arange(1 << 20, dtype=torch.int64)}  # 20 MiB


def scenario_background_pin(d):
    """A first GPU save with block=False on a fresh pool: the pool grows in 4 MiB slabs
    (FLASHWRITE_PIN_SLAB_BYTES), each registered (slowly: FAKE_CUDART_REGISTER_DELAY_MS)
    on the save's own thread; copies start into the first slabs while later ones pin."""
    sd = _big_state()
    caller = threading.get_native_id()
    t0 = time.perf_counter()
    eng, job, files = save(sd, d + "/gpu", lambda k: 0, [(0, 0)], wait=False)
    returned_s = time.perf_counter() - t0
    registers_at_return = sum(e[0] == "register" for e in call_log())
    job.wait()
    job.rethrow()
    st = job.stats()
    log = call_log()
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    ref.rethrow()
    registers = [i for i, e in enumerate(log) if e[0] == "register"]
    copies = [i for i, e in enumerate(log) if e[0] == "d2h"]
    return {"returned_s": returned_s, "registers": len(registers), "registers_at_return": registers_at_return,
            "register_sizes": sorted({int(log[i][2]) for i in registers}),
            "caller_registered": any(int(log[i][1]) == caller for i in registers),
            "first_copy_before_last_register": bool(copies) and copies[0] < registers[-1],
            "same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files),
            "pinned": eng.pool_pinned, "pool_bytes": eng.pool_bytes,
            "pin_s": st["pin_s"], "staging_wait_s": st["staging_wait_s"],
            "staging_wait_reason": st["staging_wait_reason"], "unpinned_bytes": st["unpinned_bytes"]}


def scenario_existing_slabs(d):
    """A CPU save first (its pool is pageable), then a GPU save on the same engine: the
    slab the CPU save made is pinned by the GPU save's thread, not by its caller's."""
    sd = _big_state()
    eng, cpu, _ = save(sd, d + "/cpu", lambda k: -1)
    cpu.rethrow()
    caller = threading.get_native_id()
    _, job, files = save(sd, d + "/gpu", lambda k: 0, [(0, 0)], engine=eng)
    job.rethrow()
    log = call_log()
    registers = [e for e in log if e[0] == "register"]
    return {"registers": len(registers), "caller_registered": any(int(e[1]) == caller for e in registers),
            "pinned": eng.pool_pinned, "same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", files),
            "pin_s": job.stats()["pin_s"]}


def scenario_one_register_fails(d):
    """The 2nd slab's cudaHostRegister fails (FAKE_CUDART_FAIL_REGISTER_NTH=2): only that
    slab stays pageable; the save is byte-exact."""
    sd = _big_state()
    eng, job, files = save(sd, d + "/gpu", lambda k: 0, [(0, 0)])
    job.rethrow()
    st = job.stats()
    _, ref, ref_files = save(sd, d + "/cpu", lambda k: -1)
    ref.rethrow()
    log = call_log()
    return {"registers": [int(e[3]) for e in log if e[0] == "register"], "live": fake.fake_cudart_registered(),
            "pinned": eng.pool_pinned, "pool_bytes": eng.pool_bytes, "unpinned_bytes": eng.pool_unpinned_bytes,
            "stats_unpinned_bytes": st["unpinned_bytes"], "pin_error": eng.pin_error,
            "same_files": file_bytes(d + "/gpu", files) == file_bytes(d + "/cpu", ref_files)}


def scenario_bounce_alternating(d):
    """Loads to cuda:0, cuda:1, cuda:0, cuda:1 (FAKE_CUDART_DEVICES=2): the bounce pool,
    registered portable, is pinned once, not again at each change of GPU."""
    import os
    import flashwrite as fw
    from flashwrite import _core
    from flashwrite.format import piece_ranges, read_manifest
    from fake_cuda_child import device_zeros, from_device
    sd = state()
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        w.save(sd, d + "/ck")
    m = read_manifest(d + "/ck")
    specs = [(os.path.join(d, "ck", fe.name), fe.size) for fe in m.files]
    pieces = [(e.file, off, n, int(h, 16)) for e in m.tensors.values()
              for (off, n), h in zip(piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums)]
    ok = True
    for dev in (0, 1, 0, 1):
        addrs = {k: device_zeros(m.tensors[k].nbytes) for k in ("a", "b")}
        placements = [(m.tensors[k].file, m.tensors[k].offset, m.tensors[k].nbytes, dev, a) for k, a in addrs.items()]
        job = _core.start_load(specs, pieces, "auto", 4, 1 << 20, 2, True, placements=placements, streams=[(dev, 0)])
        job.wait()
        job.rethrow()
        ok &= all(torch.equal(from_device(a, m.tensors[k].nbytes), sd[k].reshape(-1).view(torch.uint8))
                  for k, a in addrs.items())
        del job
    return {"placed_ok": bool(ok), "registers": sum(e[0] == "register" for e in call_log())}


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    print(json.dumps(globals()["scenario_" + name](d)))
