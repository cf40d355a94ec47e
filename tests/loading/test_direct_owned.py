"""Owned CPU tensors of a local load, from defaults.DIRECT_TENSOR_BYTES up, are read with
O_DIRECT straight into memory each owns (``_core.owned_tensor``, handed to torch through
DLPack): no bounce slot, no copy. Their edge pages, shared with a neighbour in the file,
are read twice; every other byte lands once, verified where it lands."""

import gc
import os
import random

import pytest
import torch

from fault_util import flip_byte
import flashwrite as fw
from flashwrite import _core, defaults
from flashwrite.errors import ChecksumMismatchError
from flashwrite.format import read_manifest

DIRECT = -2


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_direct_copied_and_unplaced_bytes_side_by_side_land_once_each(tmp_path, backend):
    # Small chunks, so each direct extent spans many reads; extents that share a page
    # with a neighbour (direct or copied), and unplaced bytes between them, in one file.
    chunk = 8192
    rnd = random.Random(7)
    data = rnd.randbytes(200 * chunk + 123)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    cuts = sorted({0, len(data), *(rnd.randrange(len(data)) for _ in range(40))})
    placements, dests, pieces = [], [], []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        kind = i % 3  # 0: direct, 1: copied out of a slot, 2: left in the file's buffer
        if kind == 0:
            t = torch.from_dlpack(_core.owned_tensor(a, b - a))
            placements.append((0, a, b - a, DIRECT, t.data_ptr()))
        elif kind == 1:
            t = torch.empty(b - a, dtype=torch.uint8)
            placements.append((0, a, b - a, -1, t.data_ptr()))
        else:
            t = None
        dests.append((a, b, t))
        for off in range(a, b, chunk):  # pieces never cross a chunk boundary
            end = min(b, (off // chunk + 1) * chunk)
            pieces.append((0, off, end - off, _core.checksum(data[off:end])))
    job = _core.start_load([(str(path), len(data))], pieces, backend, 4, chunk, 2, True, placements=placements,
                           keepalive=dests)
    job.wait()
    job.rethrow()
    assert job.mismatches() == []
    buf = job.buffers()[0]
    for a, b, t in dests:
        got = bytes(t.numpy()) if t is not None else bytes(memoryview(buf)[a:b])
        assert got == data[a:b], (a, b, t is not None)


def test_a_damaged_piece_of_a_direct_placement_is_reported(tmp_path):
    chunk = 8192
    data = random.Random(3).randbytes(10 * chunk)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    t = torch.from_dlpack(_core.owned_tensor(100, len(data) - 200))
    pieces = [(0, off, chunk - off % chunk, _core.checksum(data[off:off + chunk - off % chunk]))
              for off in (100, chunk, 2 * chunk)]
    pieces[1] = (0, chunk, chunk, pieces[1][3] ^ 1)
    job = _core.start_load([(str(path), len(data))], pieces, "auto", 4, chunk, 2, True,
                           placements=[(0, 100, len(data) - 200, DIRECT, t.data_ptr())], keepalive=t)
    job.wait()
    job.rethrow()
    assert [m[0] for m in job.mismatches()] == [1]


def test_a_direct_placement_must_sit_in_its_page_as_in_the_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(3 * 4096))
    t = torch.from_dlpack(_core.owned_tensor(100, 4096))
    with pytest.raises(ValueError, match="modulo 4096"):
        _core.start_load([(str(path), 3 * 4096)], [], placements=[(0, 101, 4096, DIRECT, t.data_ptr())])


def test_owned_tensor_memory_is_freed_with_its_tensor_and_unused_capsules_free_theirs():
    t = torch.from_dlpack(_core.owned_tensor(4096 * 3 + 5, 3 << 20))
    addr = t.data_ptr()
    assert addr % 4096 == 5 and t.untyped_storage().nbytes() == 3 << 20
    t.fill_(7)
    assert _mapped(addr)
    del t
    gc.collect()
    assert not _mapped(addr)
    cap = _core.owned_tensor(0, 1 << 20)  # never given to torch: the capsule frees it
    del cap
    gc.collect()


def _state():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3, 700_001, generator=g)  # odd sizes: every neighbour shares a page
    sd = {
        "w": big,
        "w_row": big[1],  # a view: shares big's storage after load
        "h": torch.randn(900_007, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (400_003,), generator=g),
        "small": torch.arange(1001, dtype=torch.int16),
        "p": torch.nn.Parameter(torch.randn(600_001, generator=g)),
    }
    sd["tied"] = sd["p"]
    return sd


@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_load_reads_large_tensors_into_their_own_memory(tmp_path, backend):
    sd = _state()
    path = tmp_path / "ck"
    fw.save(sd, path, stripes=1)
    m = read_manifest(str(path))
    out = fw.load(path, backend=backend)
    for k, v in sd.items():
        assert torch.equal(out[k], v.detach()), k
    assert type(out["p"]) is torch.nn.Parameter and out["tied"] is out["p"]
    assert out["w_row"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    for k in ("w", "h", "i", "p"):
        t, e = out[k], m.tensors[k]
        assert e.nbytes >= defaults.DIRECT_TENSOR_BYTES
        # Exactly its bytes, at offset 0; placed in its page as in the file: read there.
        assert t.untyped_storage().nbytes() == e.nbytes and t.storage_offset() == 0, k
        assert t.data_ptr() % 4096 == e.offset % 4096, k
    # Small tensors still come out of the bounce slots, as owned as the others.
    assert out["small"].untyped_storage().nbytes() == 2002
    addr = out["w"].data_ptr()
    del out
    gc.collect()
    assert not _mapped(addr)  # the tensors' memory goes with them


def test_zero_copy_and_compressed_loads_are_unchanged(tmp_path):
    sd = _state()
    fw.save(sd, tmp_path / "plain", stripes=1)
    z = fw.load(tmp_path / "plain", zero_copy=True)
    assert z["w"].untyped_storage().nbytes() > z["w"].numel() * 4  # views of a stripe buffer
    fw.save(sd, tmp_path / "z", stripes=1, compress="zstd")
    c = fw.load(tmp_path / "z")
    for k, v in sd.items():
        assert torch.equal(z[k], v.detach()) and torch.equal(c[k], v.detach()), k


def test_a_flipped_byte_inside_a_direct_tensor_is_named(tmp_path):
    sd = _state()
    path = tmp_path / "ck"
    fw.save(sd, path, stripes=1)
    m = read_manifest(str(path))
    e = m.tensors["i"]
    flip_byte(os.path.join(path, m.files[e.file].name), e.offset + e.nbytes // 2)
    with pytest.raises(ChecksumMismatchError) as ei:
        fw.load(path)
    assert ei.value.tensor == "i"


def test_huge_pages_on_places_memory_as_the_file_modulo_2_mib(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHWRITE_HUGE_PAGES", "on")
    off = 5 * 4096 + 7
    t = torch.from_dlpack(_core.owned_tensor(off, 3 << 20))
    assert (t.data_ptr() - off) % (2 << 20) == 0  # every chunk read starts on a huge page
    sd = _state()
    fw.save(sd, tmp_path / "ck", stripes=1)
    out = fw.load(tmp_path / "ck")
    for k, v in sd.items():
        assert torch.equal(out[k], v.detach()), k


@pytest.mark.nfs
def test_an_nfs_load_lands_its_read_replies_in_the_tensors(nfs_server, nfs_staging):
    # nfs://: each READ reply is copied straight into the tensor's memory, not a slot first.
    sd = _state()
    fw.save(sd, nfs_server.url("ck"), stripes=1)
    m = read_manifest(os.path.join(nfs_server.export, "ck"))
    out = fw.load(nfs_server.url("ck"))
    for k, v in sd.items():
        assert torch.equal(out[k], v.detach()), k
    for k in ("w", "h", "i", "p"):
        t, e = out[k], m.tensors[k]
        assert t.untyped_storage().nbytes() == e.nbytes and t.data_ptr() % 4096 == e.offset % 4096, k
    assert out["tied"] is out["p"]
