"""Owned CPU tensors are filled by the native load job out of its bounce chunks (host
placements, csrc/read/host_placer.*), not copied out of whole-stripe buffers in Python."""

import json
import os
import random
import struct
import subprocess
import sys

import pytest
import torch
from conftest import assert_same

from fault_util import flip_byte
import flashwrite as fw
from flashwrite import _core
from flashwrite.format import dtypes
from flashwrite.errors import ChecksumMismatchError
from flashwrite.format import read_manifest
from flashwrite.loading.read import _read_chunk

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))


def _owns_its_bytes(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0


def _sample(dt, n, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dt)


# -------------------------------------------------------- the native job, directly


def _file(tmp_path, n, seed=0):
    data = random.Random(seed).randbytes(n)
    p = tmp_path / f"f{seed}.bin"
    p.write_bytes(data)
    return str(p), data


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_one_file_of_many_chunks_placed_at_unaligned_offsets(tmp_path, backend, workers):
    # The workers fault destinations in ahead of the reads while they copy earlier
    # chunks out; slots (fewer than chunks) are reused. Every byte must land once.
    chunk = 8192
    path, data = _file(tmp_path, 300 * chunk + 4097, seed=workers)
    rnd = random.Random(workers)
    cuts = sorted({0, len(data), 8 + 117, *(rnd.randrange(len(data)) for _ in range(120))})
    dests = [(a, torch.empty(b - a, dtype=torch.uint8)) for a, b in zip(cuts, cuts[1:])]
    placements = [(0, a, len(d), -1, d.data_ptr()) for a, d in dests]
    job = _core.start_load([(path, len(data))], [], backend, 4, chunk, workers, True, placements=placements)
    job.wait()
    job.rethrow()
    assert job.buffers() == [None]
    for a, d in dests:
        assert bytes(d.numpy()) == data[a:a + len(d)], a


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_whole_file_buffers_with_nothing_to_verify_or_place(tmp_path, backend, workers):
    # No checksums and no placements: the workers only fault the buffers in, racing
    # the reads into them (neither writes a byte the other needs).
    chunk = 8192
    files = [_file(tmp_path, n, seed=i) for i, n in enumerate([0, 1, 4095, 3 * chunk + 1, 200 * chunk + 5])]
    job = _core.start_load([(p, len(d)) for p, d in files], [], backend, 4, chunk, workers, True)
    job.wait()
    job.rethrow()
    for (_, data), buf in zip(files, job.buffers()):
        assert bytes(buf) == data


@pytest.mark.parametrize("backend", ["threads", "auto"])
@pytest.mark.parametrize("seed", range(6))
def test_placements_at_any_offset_get_their_bytes(tmp_path, backend, seed):
    chunk = 8192
    rnd = random.Random(seed)
    sizes = [3 * chunk + 1, chunk, 5 * chunk - 7, 1]
    files = [_file(tmp_path, n, seed * 10 + i) for i, n in enumerate(sizes)]
    placements, dests, whole = [], [], []
    for fi, (_, data) in enumerate(files):
        # Cut the file at random points, some cuts on chunk boundaries, some one past.
        cuts = sorted({0, len(data), *(rnd.randrange(len(data) + 1) for _ in range(rnd.randrange(6))),
                       *(c for c in (chunk, chunk + 1, 2 * chunk - 1) if c < len(data))})
        covered = fi % 2 == 0  # every other file wholly placed, the rest with gaps
        whole.append(covered)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            if not covered and i % 2:
                continue
            d = torch.empty(b - a, dtype=torch.uint8)
            dests.append((fi, a, d))
            placements.append((fi, a, b - a, -1, d.data_ptr()))
        if not covered and len(cuts) == 2:
            placements.pop(), dests.pop()  # leave this file unplaced altogether
    job = _core.start_load([(p, len(d)) for p, d in files], [], backend, 4, chunk, 2, True, placements=placements)
    job.wait()
    job.rethrow()
    for fi, a, d in dests:
        assert bytes(d.numpy()) == files[fi][1][a:a + len(d)]
    for fi, buf in enumerate(job.buffers()):
        if whole[fi]:
            assert buf is None
        else:  # unplaced bytes are in the whole-file buffer
            data, got = files[fi][1], bytes(buf)
            placed = [(a, a + len(d)) for f, a, d in dests if f == fi]
            for i in range(len(data)):
                if not any(a <= i < b for a, b in placed):
                    assert got[i] == data[i], (fi, i)


def test_host_placements_check_their_chunks_first(tmp_path):
    path, data = _file(tmp_path, 3 * 8192)
    d = torch.zeros(len(data), dtype=torch.uint8)
    bad_piece = (0, 8192, 8192, 12345)  # a wrong checksum for the middle chunk
    job = _core.start_load([(path, len(data))], [bad_piece], "auto", 4, 8192, 2, True,
                           placements=[(0, 0, len(data), -1, d.data_ptr())])
    job.wait()
    job.rethrow()
    assert [m[0] for m in job.mismatches()] == [0]
    assert bytes(d[8192:16384].numpy()) == bytes(8192)  # damaged bytes never reach the destination
    assert bytes(d[:8192].numpy()) == data[:8192]


@pytest.mark.parametrize("bad", [(0, 0, 10, -2, 1), (0, 0, 10, -1, 0), (5, 0, 10, -1, 1)])
def test_bad_placements_are_refused(tmp_path, bad):
    path, data = _file(tmp_path, 100)
    with pytest.raises(ValueError):
        _core.start_load([(path, len(data))], [], placements=[bad])


def test_overlapping_placements_are_refused(tmp_path):
    path, data = _file(tmp_path, 100)
    a, b = torch.empty(50, dtype=torch.uint8), torch.empty(50, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _core.start_load([(path, len(data))], [],
                         placements=[(0, 0, 50, -1, a.data_ptr()), (0, 40, 50, -1, b.data_ptr())])


# ------------------------------------------------------------- through fw.load


def test_odd_sizes_every_dtype_owned_and_byte_exact(ckdir):
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        w.save({"probe": torch.zeros(1)}, ckdir / "probe")
    chunk = _read_chunk(read_manifest(str(ckdir / "probe")).block_bytes)
    sd = {}
    for i, dt in enumerate(dtypes.supported_dtypes()):
        size = dt.itemsize
        sd[f"{dt}.one_past_chunk"] = _sample(dt, (chunk + size) // size, i)  # size % chunk == 1 element
        sd[f"{dt}.empty"] = torch.empty(0, dtype=torch.uint8).view(dt).reshape(0, 3)
        sd[f"{dt}.tiny"] = _sample(dt, 3, i + 100)
    sd["spans"] = _sample(torch.uint8, 3 * chunk + 1, 7)  # crosses chunk boundaries at odd offsets
    sd["exact"] = _sample(torch.uint8, chunk + 1, 8)
    for i in range(2000):
        sd[f"tiny.{i}"] = _sample(torch.uint8, i % 5 + 1, i)
    with fw.Writer(stripes=3, chunk_bytes=1 << 20) as w:
        w.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert_same(out, sd)
    assert all(_owns_its_bytes(t) for t in out.values())


def test_foreign_unaligned_offsets_across_chunks(tmp_path):
    chunk = _read_chunk(fw.defaults.READ_CHUNK_BYTES)
    parts = {"a": torch.arange(3, dtype=torch.uint8), "big": _sample(torch.float32, chunk // 4 + 3, 1),
             "c": _sample(torch.int64, 5, 2), "d": _sample(torch.bfloat16, chunk // 2 + 1, 3)}
    header, off, body = {}, 0, b""
    names = {torch.uint8: "U8", torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}
    for k, t in parts.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        body += t.view(torch.uint8).numpy().tobytes()
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % 8 + 3)  # data starts off any alignment
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)
    got = fw.load(path)
    for k, t in parts.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
        assert _owns_its_bytes(got[k]), k


def test_checksum_mismatch_still_names_file_tensor_and_offset(writer, ckdir):
    sd = {"w": torch.randn(1 << 18), "b": torch.randn(7)}
    writer.save(sd, ckdir / "ck")
    m = read_manifest(str(ckdir / "ck"))
    e = m.tensors["w"]
    path = ckdir / "ck" / m.files[e.file].name
    flip_byte(path, e.offset + 1000, 0xFF)
    with pytest.raises(ChecksumMismatchError) as ei:
        fw.load(ckdir / "ck")
    err = ei.value
    assert err.file == m.files[e.file].name and err.tensor == "w" and err.offset <= e.offset + 1000
    assert m.files[e.file].name in str(err) and "'w'" in str(err)


def test_damaged_stripe_header_is_still_caught(writer, ckdir):
    # The header is placed into a small buffer of its own and checked against the manifest.
    writer.save({"w": torch.randn(1000)}, ckdir / "ck")
    m = read_manifest(str(ckdir / "ck"))
    path = ckdir / "ck" / m.files[m.tensors["w"].file].name
    raw = bytearray(path.read_bytes())
    i = raw.index(b'"w"')
    raw[i + 1:i + 2] = b"v"
    path.write_bytes(bytes(raw))
    with pytest.raises(fw.errors.CorruptCheckpointError, match="header"):
        fw.load(ckdir / "ck", verify=False)


def _shim(tmp_path):
    lib = tmp_path / "fault_pread_direct.so"
    cc = subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), os.path.join(HERE, "fault_pread_direct.c"),
                         "-ldl"], capture_output=True, text=True)
    if cc.returncode:
        pytest.skip(f"no C compiler for the shim: {cc.stderr[:200]}")
    return str(lib)


def test_io_error_mid_load_returns_nothing(tmp_path):
    d = None
    for cand in (str(tmp_path), "/dev/shm"):
        if os.path.isdir(cand) and _core.probe_direct(cand):
            d = cand
            break
    if d is None:
        pytest.skip("no directory here takes O_DIRECT")
    import tempfile
    lib = _shim(tmp_path)
    with tempfile.TemporaryDirectory(dir=d) as root:
        ck = os.path.join(root, "ck")
        with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:  # 8 MiB reads: the second one fails
            w.save({f"p{i}": torch.randn(1 << 20) for i in range(6)}, ck)
        code = f"""
import errno, json, flashwrite as fw
try:
    out = fw.load({ck!r}, backend="threads")
    print(json.dumps({{"returned": True}}))
except OSError as e:
    print(json.dumps({{"returned": False, "errno": e.errno, "filename": e.filename}}))
"""
        env = dict(os.environ, LD_PRELOAD=":".join(p for p in [os.environ.get("LD_PRELOAD", ""), lib] if p),
                   FAULT_PREAD_MODE="eio", FAULT_PREAD_EIO_AT=str(8 << 20))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["returned"] is False and res["errno"] == 5, res
    assert res["filename"].startswith(ck) and res["filename"].endswith(".safetensors"), res


# The peak is this process's VmHWM: ru_maxrss would carry the parent's peak across fork and exec.
PEAK_CHILD = """
import json, sys, psutil, torch, flashwrite as fw

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
base = psutil.Process().memory_info().rss
assert hwm() < base + (64 << 20)  # nothing big happened yet
out = fw.load(sys.argv[1], zero_copy=sys.argv[2] == "1")
assert all(t.untyped_storage().nbytes() == t.nbytes for t in out.values()) or sys.argv[2] == "1"
print(json.dumps({"base": base, "peak": hwm(), "bytes": sum(t.nbytes for t in out.values())}))
"""


def test_owned_load_peak_memory_is_well_under_twice_its_size(tmp_path):
    pytest.importorskip("psutil")
    n = 512 << 20
    sd = {f"layer{i}": torch.ones(n // 16 // 4) * i for i in range(16)}
    with fw.Writer() as w:
        w.save(sd, tmp_path / "ck")
    del sd
    r = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(tmp_path / "ck"), "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["bytes"] == n
    grew = res["peak"] - res["base"]
    # The tensors plus the bounce slots in flight (defaults::kHostBounceBytes), no stripe buffers.
    assert grew < 1.4 * n, (grew / n, res)
