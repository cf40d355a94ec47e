"""Scenarios of held files (csrc/write/save_held.cpp) run in a child process whose
FLASHWRITE_CUDA_RUNTIME is tests/fake_cudart.cpp, so GPU segments are staged by the native
D2H path on a machine with no GPU (see fake_cuda_child.py). Each scenario saves a base
stripe set from host memory, then saves the same layout from stand-in device memory with
every stripe held against the base, and prints one JSON line.

Usage: python held_child.py SCENARIO DIR [BASE_DIR]
"""

import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_cuda_child import file_bytes, state, to_device  # noqa: E402  (loads the stand-in runtime)

from flashwrite import _core  # noqa: E402
from flashwrite.state.flatten import flatten  # noqa: E402
from flashwrite.format import piece_ranges  # noqa: E402
from flashwrite.layout.plan import plan_files  # noqa: E402

CHUNK = 1 << 20
GPU_KEYS = {"a", "b", "c", "s"}


def start(sd, d, files, device_of, eng, held=(), streams=((0, 0),)):
    os.makedirs(d, exist_ok=True)
    segs = []
    for fi, f in enumerate(files):
        for p, j in zip(f.tensors, f.members):
            if p.nbytes:
                src = sd[p.key]
                dev = device_of(p.key)
                segs.append((to_device(src) if dev >= 0 else src.data_ptr(), p.nbytes, fi, p.offset, dev))
    return eng.start_save([(os.path.join(d, f.name), f.header, f.size) for f in files], segs, [sd],
                          streams=list(streams), held=list(held))


def base(sd, d):
    """A host save of sd into d: (files, [(file index, path, expected pieces)] to hold against it)."""
    _, tensors, _ = flatten(sd)
    files = plan_files(tensors, 3)
    job = start(sd, d, files, lambda k: -1, _core.Engine(CHUNK), streams=())
    job.wait()
    job.rethrow()
    sums = iter(job.checksums())
    held = []
    for fi, f in enumerate(files):
        exp = []
        for p in f.tensors:
            if p.nbytes:
                exp += [(off, n, h) for (off, n), h in zip(piece_ranges(p.offset, p.nbytes, CHUNK), next(sums))]
        held.append((fi, os.path.join(d, f.name), exp))
    return files, held


def inodes(d, files):
    return [[os.stat(os.path.join(d, f.name)).st_ino, os.stat(os.path.join(d, f.name)).st_nlink]
            if os.path.exists(os.path.join(d, f.name)) else None for f in files]


def outcome(sd, d, base_dir, eng, change=None, before=None):
    files, held = base(sd, base_dir)
    if change:
        sd = {**sd, **change}
    if before:
        before(files)
    job = start(sd, d, files, lambda k: 0 if k in GPU_KEYS else -1, eng, held)
    job.wait()
    error = None
    try:
        job.rethrow()
    except RuntimeError as e:
        error = str(e)
    _, ref_tensors, _ = flatten(sd)
    ref = start(sd, d + "-ref", plan_files(ref_tensors, 3), lambda k: -1, _core.Engine(CHUNK), streams=())
    ref.wait()
    ok = error is None
    return {"results": job.held_results(), "error": error, "stats": job.stats(),
            "same_bytes": ok and file_bytes(d, files) == file_bytes(d + "-ref", files),
            "same_checksums": ok and job.checksums() == ref.checksums(),
            "inodes": inodes(d, files), "base_inodes": inodes(base_dir, files),
            "trimmed": eng.trim(), "sizes": [f.size for f in files]}


def scenario_linked(d, base_dir):
    return outcome(state(), d + "/new", base_dir, _core.Engine(CHUNK))


def scenario_changed(d, base_dir):
    sd = state()
    c = sd["c"].clone()
    c[7] += 1
    return outcome(sd, d + "/new", base_dir, _core.Engine(CHUNK), change={"c": c})


def scenario_base_removed(d, base_dir):
    sd = state()
    return outcome(sd, d + "/new", base_dir, _core.Engine(CHUNK),
                   before=lambda files: os.unlink(os.path.join(base_dir, files[0].name)))


def scenario_small_pool(d, base_dir):
    # 2 slots of 1 MiB: fewer than one held file has chunks.
    return outcome(state(), d + "/new", base_dir, _core.Engine(CHUNK, 2 * CHUNK))


def scenario_bounded_pool_holds(d, base_dir):
    # Bounded, but with a slot for every chunk of the save: held files are held.
    return outcome(state(), d + "/new", base_dir, _core.Engine(CHUNK, 64 * CHUNK))


def scenario_copy_fails(d, base_dir):
    eng = _core.Engine(CHUNK, 64 * CHUNK)
    out = outcome(state(), d + "/new", base_dir, eng)
    os.environ.pop("FAKE_CUDART_FAIL_COPY")  # read per call by the fake
    for sub in ("/new", "/new-ref", "/base"):
        shutil.rmtree(d + sub)
    again = outcome(state(), d + "/new", base_dir, eng)
    return {**out, "again": again["results"], "again_same": again["same_bytes"]}


if __name__ == "__main__":
    name, d = sys.argv[1], sys.argv[2]
    base_dir = sys.argv[3] if len(sys.argv) > 3 else d + "/base"
    torch.manual_seed(0)
    print(json.dumps(globals()["scenario_" + name](d, base_dir)))
