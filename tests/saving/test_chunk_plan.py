"""The chunk arithmetic of a save (csrc/write/chunk_plan.cpp), checked against a
direct model: every byte of every segment lands exactly once, in the right chunk,
at the right place; chunks are aligned and round-robin across files."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashwrite import _core


@st.composite
def layouts(draw):
    chunk = draw(st.sampled_from([4096, 8192, 3 * 4096, 1 << 16]))
    nfiles = draw(st.integers(1, 4))
    sizes, segs = [], []
    for f in range(nfiles):
        pos = draw(st.integers(0, 5000))  # a header-like lead-in may or may not be covered
        lengths = draw(st.lists(st.integers(0, 40000), max_size=6))
        gaps = draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
        for n, g in zip(lengths, gaps):
            pos += g
            segs.append((n, f, pos))
            pos += n
        sizes.append(pos + draw(st.integers(0, 10)))
    return chunk, sizes, segs


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_byte_placed_once(layout):
    chunk, sizes, segs = layout
    chunks, hash_start = _core.plan_chunks(sizes, segs, chunk)
    # Expected coverage per file, from the segments directly.
    covered = {f: bytearray(sizes[f]) for f in range(len(sizes))}
    for i, (n, f, off) in enumerate(segs):
        for b in range(off, off + n):
            covered[f][b] = 1
    seen = {f: bytearray(sizes[f]) for f in range(len(sizes))}
    hash_slots = set()
    per_file_offsets = {f: [] for f in range(len(sizes))}
    for file, foff, data_len, write_len, has_gaps, pieces in chunks:
        assert foff % chunk == 0 and write_len % 4096 == 0 and data_len <= write_len < data_len + 4096
        assert data_len == min(chunk, sizes[file] - foff)
        per_file_offsets[file].append(foff)
        got = 0
        for seg, src_off, chunk_off, length, hidx in pieces:
            n, f, off = segs[seg]
            assert f == file and 0 < length and src_off + length <= n
            assert off + src_off == foff + chunk_off, "piece placed at its file offset"
            assert chunk_off + length <= data_len
            for b in range(foff + chunk_off, foff + chunk_off + length):
                assert not seen[file][b], "byte written twice"
                seen[file][b] = 1
            assert hash_start[seg] <= hidx < hash_start[seg + 1]
            assert hidx not in hash_slots
            hash_slots.add(hidx)
            got += length
        assert has_gaps == (got != data_len)
    assert seen == covered
    assert hash_slots == set(range(hash_start[-1]))
    for f, offs in per_file_offsets.items():
        assert offs == [k * chunk for k in range(-(-sizes[f] // chunk))]
    # Round robin: the k-th chunks of all files come before any (k+1)-th chunk.
    order = [(foff // chunk) for _, foff, *_ in chunks]
    assert order == sorted(order)


def test_rejects_overlap_and_overflow():
    with pytest.raises(ValueError, match="overlap"):
        _core.plan_chunks([100], [(10, 0, 0), (10, 0, 5)], 4096)
    with pytest.raises(ValueError, match="past its file"):
        _core.plan_chunks([100], [(10, 0, 95)], 4096)
    with pytest.raises(ValueError, match="file 1 of 1"):
        _core.plan_chunks([100], [(10, 1, 0)], 4096)
    with pytest.raises(ValueError, match="multiple of 4096"):
        _core.plan_chunks([100], [], 1000)
