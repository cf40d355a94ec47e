"""load(into=) fills CPU destinations inside the native job (no whole-stripe buffer, no
second copy in Python), and a staging pool prepared in the background before the first
save means that save does not wait for it (SaveStats.pool_wait_s)."""

import pytest
import torch
from conftest import assert_same

import flashwrite as fw
from flashwrite.loading import read as _read
from flashwrite.saving.save import default_writer
from flashwrite.errors import ChecksumMismatchError
from fault_util import flip_byte


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 1000, generator=g),               # several read chunks of 1 MiB below
        "b": torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g),  # ends off a page
        "h": torch.randn(513, generator=g).to(torch.float16),
        "p": torch.nn.Parameter(torch.randn(64, 33, generator=g)),
        "step": 3,
    }


def _zeros_like(sd):
    return {k: (torch.nn.Parameter(torch.zeros_like(v)) if isinstance(v, torch.nn.Parameter) else torch.zeros_like(v))
            if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


@pytest.fixture
def small_chunks(monkeypatch):
    # Many chunks per tensor, so destinations straddle chunk boundaries.
    monkeypatch.setattr(_read.defaults, "READ_CHUNK_BYTES", 1 << 20)


def _count_copies(monkeypatch):
    calls = []
    real = torch.Tensor.copy_

    def counted(self, *a, **kw):
        calls.append(tuple(self.shape))
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return calls


def test_into_fills_contiguous_cpu_destinations_natively(tmp_path, monkeypatch, small_chunks):
    sd = _state()
    fw.save(sd, tmp_path / "ck", chunk_bytes=1 << 20)
    into = _zeros_like(sd)
    ptrs = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
    versions = {k: v._version for k, v in into.items() if isinstance(v, torch.Tensor)}
    calls = _count_copies(monkeypatch)
    assert fw.load(tmp_path / "ck", into=into) is into
    assert calls == []  # every byte placed by the native job, none copied in Python
    for k in ptrs:
        assert into[k].dtype == sd[k].dtype and torch.equal(into[k].detach(), sd[k].detach()), k
    assert isinstance(into["p"], torch.nn.Parameter) and into["step"] == 3
    assert {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)} == ptrs
    # Autograd sees the in-place write, as it would a copy_.
    assert all(into[k]._version > versions[k] for k in versions)


@pytest.mark.parametrize("shift", [1, 7, 4093])
def test_into_unaligned_destinations_byte_exact(tmp_path, small_chunks, shift):
    sd = _state(shift)
    fw.save(sd, tmp_path / "ck", chunk_bytes=1 << 20)
    # Destinations at every misalignment to the page and to the stored offsets, inside
    # one larger buffer whose other bytes must stay untouched.
    nbytes = {k: v.numel() * v.element_size() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    arena = torch.full((sum(nbytes.values()) + shift * (len(nbytes) + 1) + 64,), 0xA5, dtype=torch.uint8)
    into, pos, spans = {"step": 0}, shift, []
    for k, n in nbytes.items():
        es = sd[k].element_size()
        pos = -(-pos // es) * es  # a dtype view needs its element alignment, nothing more
        into[k] = arena[pos:pos + n].view(sd[k].dtype).view(sd[k].shape)
        spans.append((pos, pos + n))
        pos += n + shift
    fw.load(tmp_path / "ck", into=into)
    for k in nbytes:
        assert torch.equal(into[k].view(torch.uint8).reshape(-1), sd[k].detach().reshape(-1).view(torch.uint8)), k
    mask = torch.ones_like(arena, dtype=torch.bool)
    for a, b in spans:
        mask[a:b] = False
    assert bool((arena[mask] == 0xA5).all())  # nothing written around the destinations


def test_into_other_dtype_or_strided_destinations_still_copied(tmp_path, monkeypatch, small_chunks):
    sd = _state(2)
    fw.save(sd, tmp_path / "ck", chunk_bytes=1 << 20)
    into = _zeros_like(sd)
    into["w"] = torch.zeros(1000, 300).t()       # strided: filled by a copy
    into["h"] = torch.zeros(513, dtype=torch.float32)  # another dtype: converted by the copy
    calls = _count_copies(monkeypatch)
    fw.load(tmp_path / "ck", into=into)
    assert sorted(calls) == sorted([(300, 1000), (513,)])
    assert torch.equal(into["w"], sd["w"]) and torch.equal(into["h"], sd["h"].float())
    assert torch.equal(into["b"], sd["b"])


def test_into_shape_mismatch_refused_before_any_byte_moves(tmp_path):
    sd = _state(3)
    fw.save(sd, tmp_path / "ck")
    into = _zeros_like(sd)
    into["w"] = torch.zeros(10, 10)
    with pytest.raises(ValueError, match="shape"):
        fw.load(tmp_path / "ck", into=into)
    assert not into["b"].any() and not into["p"].detach().any()


def test_into_damaged_checkpoint_raises(tmp_path):
    sd = _state(4)
    fw.save(sd, tmp_path / "ck")
    stripe = max((tmp_path / "ck").glob("*.safetensors"), key=lambda f: f.stat().st_size)
    flip_byte(stripe, stripe.stat().st_size - 100)  # tensor data: stripes end with their last tensor
    with pytest.raises(ChecksumMismatchError):
        fw.load(tmp_path / "ck", into=_zeros_like(sd))


# ------------------------------------------------------------- the first save


def _big(seed=0):
    return {"a": torch.randn(8 << 20, generator=torch.Generator().manual_seed(seed)), "n": 1}  # 32 MiB


def test_first_save_of_a_fresh_writer_reports_growing_the_pool(tmp_path):
    with fw.Writer() as w:
        first = w.save(_big(), tmp_path / "a")
        grown = w.pool_bytes
        later = w.save(_big(1), tmp_path / "b")
        assert w.pool_bytes == grown  # reused
    assert first.pool_wait_s > 0 and first.pool_wait_s <= first.stall_s
    assert later.pool_wait_s < first.pool_wait_s


def test_writer_prepared_at_construction_does_not_wait_for_the_pool(tmp_path):
    sd = _big()
    with fw.Writer() as cold:
        unprepared = cold.save(sd, tmp_path / "cold")
    with fw.Writer(reserve=sd) as w:
        w._reserving.result()
        ready = w.pool_bytes
        assert ready >= sum(t.numel() * 4 for t in sd.values() if isinstance(t, torch.Tensor))
        st = w.save(sd, tmp_path / "a")
        assert w.pool_bytes == ready  # the save did not grow the pool
    assert st.pool_wait_s < unprepared.pool_wait_s / 5
    assert_same(fw.load(tmp_path / "a"), sd)


def test_manager_prepares_the_pool_from_a_state_that_was_not_due(tmp_path):
    sd = _big(2)
    with fw.CheckpointManager(tmp_path / "ck", every_n_steps=2) as mgr:
        assert mgr.maybe_save(1, sd) is None
        fut = mgr._writer._reserving
        assert fut is not None
        fut.result()
        ready = mgr._writer.pool_bytes
        assert ready > 0
        assert mgr.maybe_save(3, sd) is None and mgr._writer._reserving is fut  # once
        st = mgr.maybe_save(2, sd).result()
        assert mgr._writer.pool_bytes == ready
    assert st.pool_wait_s < 0.5 * st.stall_s or st.pool_wait_s < 1e-3


def test_module_prepare_readies_the_pool_that_save_async_then_uses(tmp_path):
    # The README's recipe: fw.prepare(state, path) once before the loop, then fw.save_async.
    # A chunk size of its own names a shared writer no other test uses.
    sd, opts = _big(4), {"chunk_bytes": 3 << 20}
    fut = fw.prepare(sd, tmp_path / "ck", **opts)
    assert fut is not None
    ready = fut.result()
    assert ready >= 32 << 20
    assert fw.prepare(sd, tmp_path / "ck", **opts) is None  # prepared once
    writer = default_writer(tmp_path / "ck", **opts)
    st = fw.save_async(sd, tmp_path / "ck" / "step-1", **opts).result()
    assert writer.pool_bytes == ready  # the save found the pool prepared, and grew nothing
    assert st.pool_wait_s < 1e-3
    assert_same(fw.load(tmp_path / "ck" / "step-1"), sd)
    with pytest.raises(TypeError, match="Writer options only"):
        fw.prepare(sd, tmp_path / "ck", overwrite=True)


def test_manager_prepares_the_pool_from_the_state_it_restores(tmp_path):
    sd = _big(3)
    fw.save(sd, tmp_path / "ck" / "step-00000004")
    with fw.CheckpointManager(tmp_path / "ck", every_n_steps=2) as mgr:
        assert mgr._writer.pool_bytes == 0
        step, state = mgr.restore()
        assert step == 4
        mgr._writer._reserving.result()
        ready = mgr._writer.pool_bytes
        assert ready >= 32 << 20
        mgr.maybe_save(6, state).result()
        assert mgr._writer.pool_bytes == ready


# ------------------------------------------------------------------ zero_copy


def test_zero_copy_views_whole_stripe_buffers_filled_through_the_bounce_slots(tmp_path, monkeypatch, small_chunks):
    sd = _state(5)
    fw.save(sd, tmp_path / "ck", chunk_bytes=1 << 20, stripes=2)
    jobs = []
    real = _read._core.start_load

    def spy(*a, **kw):
        jobs.append(real(*a, **kw))
        return jobs[-1]

    monkeypatch.setattr(_read._core, "start_load", spy)
    views = fw.load(tmp_path / "ck", zero_copy=True)
    # Every byte was placed into the stripe buffers (read through the job's huge-page
    # bounce slots), so the job itself held no whole-file buffer.
    assert len(jobs) == 1 and jobs[0].buffers() == [None, None]
    storages = {t.untyped_storage().data_ptr() for k, t in views.items() if isinstance(t, torch.Tensor)}
    assert len(storages) == 2  # one buffer per stripe, viewed by its tensors
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(views[k].detach(), v.detach()), k
    assert views["step"] == 3


def test_a_save_during_the_preparation_finds_its_slots_there(tmp_path):
    # The save's reservation meets the preparation's in whatever order: the pool ends at
    # one save's worth, never the two added up (a preparation used to hold a reservation
    # after growing the pool, and a save that came in between grew it again).
    from flashwrite.saving.save import _planned_bytes
    sd = _big(4)
    for i in range(3):
        with fw.Writer() as w:
            need, _ = _planned_bytes(sd, w.stripes, w.chunk_bytes)
            w.reserve(sd)
            w.save(sd, tmp_path / f"s{i}")
            w._reserving.result()
            assert w.pool_bytes == need


def test_exit_while_the_pool_is_prepared_in_the_background():
    """A process that ends while its pool is still being prepared (a restore, then exit)
    exits cleanly: the interpreter waits for the reservation instead of tearing its thread
    down inside native code (that aborted with std::terminate)."""
    import subprocess
    import sys

    code = "import flashwrite as fw\nw = fw.Writer()\nw.reserve(512 << 20)\nprint('returned', flush=True)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "returned"), r.stderr[-2000:]
    assert "terminate" not in r.stderr


@pytest.mark.parametrize("stored,into", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                         (torch.int32, torch.float32), (torch.float32, torch.int32)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_into_a_same_size_dtype_converts_the_values(tmp_path, small_chunks, stored, into, device):
    """Same element size, other dtype (issue 33, item 8): the values are converted, as for
    any other dtype, never the stored bits copied as they are."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(4)
    ints = torch.randint(-2000, 2000, (3, 100_000), generator=g)  # exact in all four dtypes
    sd = {"x": ints.to(stored), "y": (ints[:, :777] * 2).to(stored)}
    fw.save(sd, tmp_path / "ck", chunk_bytes=1 << 20)
    dst = {"x": torch.zeros(3, 100_000, dtype=into, device=device), "y": torch.zeros(3, 777, dtype=into, device=device)}
    out = fw.load(tmp_path / "ck", into=dst)
    assert out is dst
    for k, v in sd.items():
        got = dst[k].cpu()
        assert got.dtype == into
        assert torch.equal(got, v.to(into)), k
        assert not torch.equal(got.view(stored), v), k  # not the raw bits
