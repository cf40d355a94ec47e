"""Incremental saves that must write what changed, checked by the bytes that load (issue 33,
items 4-6): a change in one piece other than the first or smallest, a retry after a save
that failed after its compare pass, a base with another checksum block."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import flashwrite as fw
from flashwrite.incremental import held
from flashwrite.format import piece_ranges, read_manifest
from fault_util import fill, need_root, tmpfs

KiB, MiB = 1 << 10, 1 << 20


def frozen_state() -> dict:
    """Tensors of several pieces each (64 KiB checksum blocks below): "small" under the
    write watch's minimum (always hashed), "big" above it (watched once recorded). Each
    starts its stripe after a 4 KiB header and ends on a block boundary there, so its
    first piece is its smallest, its last one whole."""
    g = torch.Generator().manual_seed(11)
    return {"small": torch.randn((10 * 64 * KiB - 4 * KiB) // 4, generator=g),  # 10 pieces
            "big": torch.randn((49 * 64 * KiB - 4 * KiB) // 4, generator=g),  # 49 pieces
            "other": torch.randn(200_000, generator=g)}


def state(step: int, frozen: dict) -> dict:
    return {"model": frozen, "step": step}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def piece_at(t: torch.Tensor, where: str) -> int:
    """An element index inside ``t``'s middle piece or its last one (64 KiB blocks)."""
    n = t.numel()
    return n // 2 if where == "middle" else n - 3


@pytest.mark.parametrize("key", ["small", "big"])
@pytest.mark.parametrize("where", ["middle", "last"])
@pytest.mark.parametrize("when", [2, 4])  # the first compare (nothing recorded), or once the watch vouches
@pytest.mark.parametrize("hold_host", [False, True], ids=["compared", "held"])  # or the native job's checksums
def test_a_change_in_one_middle_or_last_piece_is_written(tmp_path, monkeypatch, key, where, when, hold_host):
    monkeypatch.setattr(held, "HOLD_HOST", hold_host)
    frozen = frozen_state()
    root = str(tmp_path)
    with fw.Writer(stripes=3, chunk_bytes=64 * KiB, incremental=True) as w:
        for s in range(1, when + 1):
            if s == when:
                t = frozen[key]
                t[piece_at(t, where)] += 1.0  # one element: one piece of the ~10 or ~49
                want = {k: v.clone() for k, v in frozen.items()}
            st = w.save(state(s, frozen), os.path.join(root, f"step-{s}"))
    te = read_manifest(os.path.join(root, "step-1")).tensors[f"model.{key}"]
    sizes = [n for _, n in piece_ranges(te.offset, te.nbytes, 64 * KiB)]
    at = te.offset + piece_at(frozen[key], where) * 4
    changed = next(n for o, n in piece_ranges(te.offset, te.nbytes, 64 * KiB) if o <= at < o + n)
    assert len(sizes) >= 10 and changed > min(sizes)  # neither the first piece nor the smallest
    out = fw.load(os.path.join(root, f"step-{when}"))["model"]
    for k, v in want.items():
        assert same_bytes(out[k], v), k
    assert st.bytes_written >= frozen[key].nbytes and st.bytes_linked > 0


def test_a_retry_after_a_save_that_failed_after_its_compare_writes_the_changed_stripe(tmp_path):
    """ENOSPC after the compare pass hashed the changed piece (and the write watch recorded
    it); the retry of the same state must still see the change and write its stripe."""
    need_root()
    with tmpfs(str(tmp_path / "mnt"), "32m") as mnt:
        frozen = frozen_state()
        frozen["big"] = torch.randn(8 * MiB // 4, generator=torch.Generator().manual_seed(3))
        with fw.Writer(stripes=3, chunk_bytes=64 * KiB, incremental=True) as w:
            for s in (1, 2, 3):
                st = w.save(state(s, frozen), os.path.join(mnt, f"step-{s}"))
            assert st.watched_bytes >= frozen["big"].nbytes  # the watch vouches for "big" now
            t = frozen["big"]
            t[t.numel() // 2] += 1.0  # one piece in the middle
            want = t.clone()
            ballast = fill(mnt, 256 * KiB)
            with pytest.raises(OSError) as ei:
                w.save(state(4, frozen), os.path.join(mnt, "step-4"))
            assert ei.value.errno == errno.ENOSPC, ei.value
            assert not os.path.exists(os.path.join(mnt, "step-4"))
            os.unlink(ballast)
            st = w.save(state(4, frozen), os.path.join(mnt, "step-4"))
        out = fw.load(os.path.join(mnt, "step-4"))["model"]
        assert same_bytes(out["big"], want)
        for k in ("small", "other"):
            assert same_bytes(out[k], frozen[k])
        assert st.bytes_written >= want.nbytes and st.bytes_linked >= frozen["small"].nbytes
        assert fw.verify(os.path.join(mnt, "step-4"))


@pytest.mark.parametrize("hold_host", [False, True], ids=["compared", "held"])
@pytest.mark.parametrize("blocks", [(64 * KiB, 128 * KiB), (128 * KiB, 64 * KiB)], ids=["larger", "smaller"])
def test_a_base_saved_with_another_checksum_block_is_not_linked_from(tmp_path, monkeypatch, hold_host, blocks):
    """Its checksums are of other pieces: nothing can be linked, everything is written, and
    the result loads byte-exact and verifies."""
    monkeypatch.setattr(held, "HOLD_HOST", hold_host)
    frozen = frozen_state()
    root = str(tmp_path)
    with fw.Writer(stripes=3, chunk_bytes=blocks[0], incremental=True) as w:
        w.save(state(1, frozen), os.path.join(root, "step-1"))
        w.save(state(2, frozen), os.path.join(root, "step-2"))
    with fw.Writer(stripes=3, chunk_bytes=blocks[1], incremental=True) as w:
        st = w.save(state(3, frozen), os.path.join(root, "step-3"))
        assert st.bytes_linked == 0 and st.stripes_linked == 0 and st.bytes_written == st.bytes
        assert st.incremental.startswith("off:") and "checksum block" in st.incremental, st.incremental
        st2 = w.save(state(4, frozen), os.path.join(root, "step-4"))  # and the next links from that one
    assert st2.bytes_linked >= sum(v.nbytes for v in frozen.values())
    for s in (3, 4):
        out = fw.load(os.path.join(root, f"step-{s}"))["model"]
        for k, v in frozen.items():
            assert same_bytes(out[k], v), (s, k)
        assert fw.verify(os.path.join(root, f"step-{s}"))


@pytest.mark.parametrize("hold_host", [False, True], ids=["compared", "held"])
def test_the_same_bytes_as_another_dtype_are_written_with_it(tmp_path, monkeypatch, hold_host):
    """float32 bytes now viewed as int32: same size, same shape, same checksums; the stripe
    (whose header says F32) must not be linked, or the tensor loads as float32."""
    monkeypatch.setattr(held, "HOLD_HOST", hold_host)
    frozen = frozen_state()
    root = str(tmp_path)
    with fw.Writer(stripes=3, chunk_bytes=64 * KiB, incremental=True) as w:
        w.save(state(1, frozen), os.path.join(root, "step-1"))
        w.save(state(2, frozen), os.path.join(root, "step-2"))
        frozen = {**frozen, "small": frozen["small"].view(torch.int32)}
        st = w.save(state(3, frozen), os.path.join(root, "step-3"))
    out = fw.load(os.path.join(root, "step-3"))["model"]
    assert out["small"].dtype == torch.int32
    for k, v in frozen.items():
        assert same_bytes(out[k], v), k
    assert st.bytes_written >= frozen["small"].nbytes and st.bytes_linked >= frozen["big"].nbytes
