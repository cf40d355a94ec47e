"""Save -> load round trips with real files: every dtype, odd shapes, structure, tied weights."""

import collections
import math
import os
import threading
import warnings

import pytest
import torch
from conftest import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashwrite as fw
from flashwrite.format import dtypes


def _sample(dt, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtypes.itemsize(dt),), dtype=torch.uint8, generator=g)
    return raw.view(dt).reshape(shape)


ALL_DTYPES = dtypes.supported_dtypes()


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_every_dtype_byte_exact(writer, ckdir, dt):
    sd = {"x": _sample(dt, (3, 5, 7)), "scalar": _sample(dt, ()), "empty": _sample(dt, (0, 4))}
    writer.save(sd, ckdir / "ck")
    assert_same(fw.load(ckdir / "ck"), sd)


def test_covers_every_creatable_dtype():
    # Guard: a dtype added to torch that we would refuse to store shows up here.
    # Quantized tensors carry scales/zero points, not just bytes, and are refused on purpose.
    for name in dir(torch):
        dt = getattr(torch, name)
        if not isinstance(dt, torch.dtype) or name.startswith(("qint", "quint")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.empty(2, dtype=dt)
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        assert dt in ALL_DTYPES, f"{dt} can be created but not stored"


def test_noncontiguous_views_and_conj(writer, ckdir):
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    c = torch.randn(5, 3, dtype=torch.complex64)
    sd = {
        "t": base.transpose(0, 2),
        "slice": base[:, 1:5:2, ::3],
        "expand": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": c.conj(),
        "neg": torch._neg_view(torch.randn(3)),
    }
    writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    for k, v in sd.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
    # A view alone is stored contiguous; views that share a storage keep it (as torch.save does).
    for k in ("expand", "conj", "neg"):
        assert out[k].is_contiguous(), k
    assert out["t"].stride() == sd["t"].stride() and out["slice"].stride() == sd["slice"].stride()
    assert out["t"].untyped_storage().data_ptr() == out["slice"].untyped_storage().data_ptr()


def test_tied_weights_stored_once(writer, ckdir):
    w = torch.randn(64, 32)
    sd = {"embed": {"weight": w}, "lm_head": {"weight": w}, "other": w[1:].clone()}
    st_ = writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert out["embed"]["weight"].data_ptr() == out["lm_head"]["weight"].data_ptr()
    assert torch.equal(out["lm_head"]["weight"], w)
    m = fw.format.read_manifest(ckdir / "ck")
    assert len(m.tensors) == 2 and m.aliases == {"lm_head.weight": "embed.weight"}
    assert st_.bytes < 2 * w.numel() * 4 + 3 * 4096 * 3


def test_nested_structure_and_leaves(writer, ckdir):
    sd = collections.OrderedDict(
        model=collections.OrderedDict([("l.0.w", torch.randn(3)), ("l.1.w", torch.randn(2))]),
        optim={"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}, 1: {}},
               "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1],
                                 "amsgrad": False, "foreach": None, "name": "dé€", "big": 2**80,
                                 "inf": float("inf"), "nan": float("nan"), "neg0": -0.0}]},
        step=1000, rng=b"\x00\x01\xff", dtype=torch.bfloat16, dev=torch.device("cpu"), size=torch.Size([2, 3]),
        mixed_keys={1: "a", "1": "b", 2.5: "c", True: "d", None: "e", (1, 2): "f"},
        empty={}, empty_list=[], tup=(),
    )
    writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert_same(out, sd)
    assert math.copysign(1, out["optim"]["param_groups"][0]["neg0"]) == -1


def test_colliding_flat_keys(writer, ckdir):
    sd = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, 0: torch.full((2,), 3.0), "0": torch.full((2,), 4.0)}
    writer.save(sd, ckdir / "ck")
    assert_same(fw.load(ckdir / "ck"), sd)


def test_ten_thousand_small_tensors(ckdir):
    sd = {f"layer{i // 100}.p{i % 100}": torch.full((i % 7 + 1,), float(i)) for i in range(10_000)}
    with fw.Writer(stripes=4) as w:
        w.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert list(out) == list(sd)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_empty_state(writer, ckdir):
    writer.save({}, ckdir / "ck")
    assert fw.load(ckdir / "ck") == {}


def test_large_tensor_spans_many_chunks(ckdir):
    # Not a multiple of the chunk or the page: exercises piece boundaries and the padded tail.
    x = torch.randn(3 * (1 << 20) // 4 + 12345)
    y = torch.randint(0, 100, (777,), dtype=torch.int16)
    with fw.Writer(stripes=2, chunk_bytes=64 << 10, queue_depth=4) as w:
        w.save({"x": x, "y": y}, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert torch.equal(out["x"], x) and torch.equal(out["y"], y)


def test_streamed_copies_at_every_alignment(ckdir):
    # Pieces of 256 KiB and more are staged with non-temporal stores (stream_copy): an
    # unaligned head, 64-byte blocks and a tail. Odd sizes put every piece at a
    # different alignment in its slot; the sizes straddle the threshold.
    sizes = [1, 7, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, (256 << 10) + 63, 1000003, (3 << 20) + 5]
    g = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}
    state["unaligned_src"] = torch.randint(0, 256, ((1 << 20) + 9,), dtype=torch.uint8, generator=g)[9:]
    with fw.Writer(stripes=1, chunk_bytes=4 << 20) as w:
        w.save(state, ckdir / "ck")
    assert_same(fw.load(ckdir / "ck"), state)


def test_pickle_needs_opt_in_on_both_sides(writer, ckdir):
    sd = {"obj": collections.Counter("hello"), "t": torch.ones(1)}
    with pytest.raises(TypeError, match="allow_pickle"):
        writer.save(sd, ckdir / "ck")
    assert not (ckdir / "ck").exists() and os.listdir(ckdir) == []
    writer.save(sd, ckdir / "ck", allow_pickle=True)
    with pytest.raises(fw.UnsafeCheckpointError, match="allow_pickle"):
        fw.load(ckdir / "ck")
    assert fw.load(ckdir / "ck", allow_pickle=True)["obj"] == sd["obj"]


def test_load_into_existing_tensors(writer, ckdir):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    sd = {"model": model.state_dict(), "step": 7}
    writer.save(sd, ckdir / "ck")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    target = {"model": fresh.state_dict(), "step": 0}
    ptrs = [t.data_ptr() for t in target["model"].values()]
    out = fw.load(ckdir / "ck", into=target)
    assert out is target and target["step"] == 7
    assert [t.data_ptr() for t in target["model"].values()] == ptrs
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    with pytest.raises(KeyError, match="no destination"):
        fw.load(ckdir / "ck", into={"model": {}})


def test_load_async(writer, ckdir):
    sd = {"a": torch.randn(100)}
    writer.save(sd, ckdir / "ck")
    assert torch.equal(fw.load_async(ckdir / "ck").result(timeout=30)["a"], sd["a"])


def test_overwrite_keeps_old_until_commit(writer, ckdir):
    writer.save({"v": torch.zeros(4)}, ckdir / "ck")
    with pytest.raises(fw.CheckpointExistsError):
        writer.save_async({"v": torch.ones(4)}, ckdir / "ck")
    assert torch.equal(fw.load(ckdir / "ck")["v"], torch.zeros(4))
    writer.save({"v": torch.ones(4)}, ckdir / "ck", overwrite=True)
    assert torch.equal(fw.load(ckdir / "ck")["v"], torch.ones(4))
    assert sorted(os.listdir(ckdir)) == ["ck"]


def _states():
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
        st.builds(lambda dt, shape, seed: _sample(dt, tuple(shape), seed),
                  st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 5), max_size=3), st.integers(0, 1000)))
    keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
    return st.recursive(leaves, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(keys, c, max_size=4),
                                                   st.tuples(c, c)), max_leaves=20)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_states())
def test_random_nested_states(tmp_path_factory, state):
    d = tmp_path_factory.mktemp("h")
    with fw.Writer(stripes=3, chunk_bytes=8192) as w:
        w.save({"s": state}, d / "ck")
    assert_same(fw.load(d / "ck"), {"s": state})


def test_overwrite_replaces_only_checkpoints(writer, ckdir):
    """overwrite=True must never delete a directory that is not a flashwrite checkpoint."""
    run = ckdir / "run1"
    run.mkdir()
    (run / "train.log").write_text("precious")
    with pytest.raises(fw.CheckpointExistsError, match="not a flashwrite checkpoint"):
        writer.save({"a": torch.ones(2)}, run, overwrite=True)
    assert (run / "train.log").read_text() == "precious"
    (ckdir / "file").write_text("x")
    with pytest.raises(fw.CheckpointExistsError):
        writer.save({"a": torch.ones(2)}, ckdir / "file", overwrite=True)
    (ckdir / "empty").mkdir()
    writer.save({"a": torch.ones(2)}, ckdir / "empty", overwrite=True)  # an empty directory is fine
    assert torch.equal(fw.load(ckdir / "empty")["a"], torch.ones(2))
    assert sorted(os.listdir(ckdir)) == ["empty", "file", "run1"]


def test_refusal_of_what_is_not_a_checkpoint_does_not_advise_overwrite(writer, ckdir):
    """Issue 44 item 5: without overwrite=True, a run directory or a file in the way was
    answered "pass overwrite=True", which then refused it differently. Say at once that
    it is not a checkpoint and will not be replaced."""
    run = ckdir / "run1"
    run.mkdir()
    (run / "train.log").write_text("precious")
    (ckdir / "file").write_text("x")
    for path in (run, ckdir / "file"):
        with pytest.raises(fw.CheckpointExistsError, match="not a flashwrite checkpoint") as e:
            writer.save({"a": torch.ones(2)}, path)
        assert "pass overwrite=True" not in str(e.value)
    writer.save({"a": torch.ones(2)}, ckdir / "ck")
    with pytest.raises(fw.CheckpointExistsError, match="pass overwrite=True"):  # a checkpoint: the advice holds
        writer.save({"a": torch.ones(2)}, ckdir / "ck")
    (ckdir / "empty").mkdir()
    with pytest.raises(fw.CheckpointExistsError, match="empty directory.*pass overwrite=True"):
        writer.save({"a": torch.ones(2)}, ckdir / "empty")
    assert (run / "train.log").read_text() == "precious"


def test_cancel_before_commit(ckdir):
    import concurrent.futures

    gate = threading.Event()
    with fw.Writer() as w:
        w._committer().submit(gate.wait, 30)  # keep the commit thread busy: the save cannot commit yet
        fut = w.save_async({"a": torch.ones(1 << 16)}, ckdir / "ck")
        assert fut.cancel()
        gate.set()
        with pytest.raises(concurrent.futures.CancelledError):
            fut.result(timeout=30)
        late = w.save_async({"a": torch.ones(4)}, ckdir / "ck2")
        late.result(timeout=30)
        assert not late.cancel()  # finished: nothing to cancel
    assert sorted(os.listdir(ckdir)) == ["ck2"]


def test_closed_writer_refuses_without_leaving_files(ckdir):
    w = fw.Writer()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.save_async({"a": torch.ones(2)}, ckdir / "ck")
    assert os.listdir(ckdir) == []


def test_module_instead_of_state_dict_is_a_clear_error(writer, ckdir):
    with pytest.raises(TypeError, match="state_dict"):
        writer.save({"model": torch.nn.Linear(2, 2)}, ckdir / "ck")


def test_load_never_mixes_two_checkpoints_when_the_path_is_swapped(ckdir, monkeypatch):
    """An overwrite that lands between reading the manifest and reading the stripes must
    not give the old tree with the new weights: the load pins the directory it started
    with, so it returns the old checkpoint whole or says that its files are gone."""
    import sys

    from flashwrite import format as fmt

    with fw.Writer() as w:
        w.save({"step": 1, "w": torch.full((1000,), 1.0)}, ckdir / "ck")
        real = fmt.read_manifest
        swapped = []

        def read_then_swap(*args, **kwargs):
            m = real(*args, **kwargs)
            if not swapped:
                swapped.append(True)
                w.save({"step": 2, "w": torch.full((1000,), 2.0)}, ckdir / "ck", overwrite=True)
            return m

        monkeypatch.setattr(sys.modules["flashwrite.loading.read"], "read_manifest", read_then_swap)
        try:
            out = fw.load(ckdir / "ck", verify=False)
        except fw.CorruptCheckpointError as e:
            assert "missing" in str(e)  # the old checkpoint was deleted under us: said plainly
        else:
            assert out["step"] == 1 and torch.equal(out["w"], torch.full((1000,), 1.0))
    monkeypatch.undo()
    assert fw.load(ckdir / "ck")["step"] == 2
