"""A map_location load's small tensors (issue 37 item 6): they used to be placed through a
gather buffer as large as they are, allocated beside them (twice their GPU memory during
the load). Now their new tensors are views of one allocation laid out as the stripe is and
the load places each run straight into it. Checked with CPU tensors (the layout and the
placements do not depend on the device)."""

import torch

import flashwrite as fw
from flashwrite.format import read_manifest
from flashwrite.loading.read import run_targets
from flashwrite.system import cuda as fw_cuda


def test_small_targets_share_one_allocation_and_need_no_gather_buffer(tmp_path):
    sd = {f"t{i:02d}": torch.randn(100 + i) for i in range(20)} | {"i": torch.arange(7, dtype=torch.int16),
                                                                   "big": torch.randn(1 << 18)}
    fw.save(sd, tmp_path / "ck", stripes=1)
    m = read_manifest(tmp_path / "ck")
    entries = sorted(m.tensors.values(), key=lambda e: e.offset)
    cpu = torch.device("cpu")
    targets = run_targets([(e, cpu) for e in entries], max_tensor=64 << 10, max_run=16 << 20)
    for e in entries:
        t = targets[e.key]
        assert t.dtype == sd[e.key].dtype and list(t.shape) == list(e.shape)
    run = [e for e in entries if e.key.startswith("t")]  # back to back in the stripe; "i" lies after "big"
    storages = {targets[e.key].untyped_storage().data_ptr() for e in run}
    assert len(storages) == 1  # one allocation for the run of small ones
    assert targets["big"].untyped_storage().data_ptr() not in storages  # a large one is its own
    items = [(targets[e.key], e.nbytes, 0, e.offset, 0) for e in entries if e.nbytes]
    scatter = fw_cuda.Scatter(items, 64 << 10, 16 << 20)
    assert scatter._src == [] and scatter._dst == []  # no gather buffer, nothing to copy out
    assert len(scatter.placements) == 3  # the run of small ones, the large one, "i"
    # The placements are where each target's bytes are: writing the stripe's bytes there fills them.
    raw = (tmp_path / "ck" / m.files[0].name).read_bytes()
    for fi, off, n, dev, addr in scatter.placements:
        dst = next(targets[e.key] for e in entries if targets[e.key].data_ptr() == addr)
        flat = torch.frombuffer(bytearray(raw[off:off + n]), dtype=torch.uint8)
        base = dst.untyped_storage()
        start = addr - base.data_ptr()
        torch.tensor([], dtype=torch.uint8).set_(base)[start:start + n].copy_(flat)
    assert all(torch.equal(targets[k], sd[k]) for k in sd)
