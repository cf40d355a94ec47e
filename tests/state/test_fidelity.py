"""What ``load`` returns behaves like what ``torch.load`` returns.

Storage ownership, Parameters and requires_grad, storage sharing between views,
numpy and Python RNG states, and clear errors for what cannot be stored.
"""

import itertools
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashwrite as fw
from flashwrite.format import dtypes
from flashwrite.errors import CorruptCheckpointError
from flashwrite.format import MANIFEST_NAME, encode_manifest
from flashwrite.format import decode_manifest_json


def _tensors(x, out=None):
    out = [] if out is None else out
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    return out


def _held_bytes(tensors):
    """Bytes of the distinct storages a set of tensors keeps alive."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_loaded_tensors_own_exactly_their_bytes(writer, ckdir):
    sd = {"a": torch.randn(7, 5), "b": torch.arange(3, dtype=torch.int16), "c": torch.zeros(()),
          "d": torch.randn(100).to(torch.bfloat16), "rng": torch.get_rng_state()}
    writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    for k, t in out.items():
        assert t.storage_offset() == 0, k
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), k
        assert torch.equal(t, sd[k]), k
    # zero_copy keeps views into the read buffers (one stripe buffer per file)
    views = fw.load(ckdir / "ck", zero_copy=True)
    assert any(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in views.values())
    for k, t in views.items():
        assert torch.equal(t, sd[k]), k


def test_optimizer_keeps_only_its_own_bytes(writer, ckdir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    writer.save({"model": model.state_dict(), "optim": opt.state_dict()}, ckdir / "ck")

    def retained(zero_copy):
        opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt2.load_state_dict(fw.load(ckdir / "ck", zero_copy=zero_copy)["optim"])
        held = _tensors(opt2.state_dict()["state"])
        return _held_bytes(held), sum(t.numel() * t.element_size() for t in held)

    held, need = retained(False)
    assert held <= 1.05 * need, (held, need)
    held_views, _ = retained(True)
    assert held_views > 1.05 * need  # the reason owning is the default


def test_rng_states_set_back_directly(tmp_path):
    """torch, numpy and Python RNG states load and set back; the next draws match."""
    script = textwrap.dedent(f"""
        import random, sys
        import numpy as np, torch
        import flashwrite as fw
        path = {str(tmp_path / "ck")!r}
        if sys.argv[1] == "save":
            torch.manual_seed(3); np.random.seed(4); random.seed(5)
            fw.save({{"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                     "python": random.getstate()}}, path)
        else:
            s = fw.load(path)
            torch.set_rng_state(s["torch"]); np.random.set_state(s["numpy"]); random.setstate(s["python"])
        print(torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random())
    """)
    run = lambda mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,  # noqa: E731
                                      timeout=120)
    saved, loaded = run("save"), run("load")
    assert saved.returncode == 0, saved.stderr
    assert loaded.returncode == 0, loaded.stderr  # used to die in set_rng_state with SIGSEGV
    assert saved.stdout == loaded.stdout


def test_parameters_and_requires_grad(writer, ckdir):
    p = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(5).requires_grad_()
    sd = {"p": p, "frozen": frozen, "leaf": leaf, "plain": torch.randn(2), "tied": p}
    writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
    assert out["tied"] is out["p"]
    for k in sd:
        assert torch.equal(out[k].detach(), sd[k].detach()), k
    # a Parameter feeds straight back into a module
    lin = torch.nn.Linear(4, 3)
    lin.weight = out["p"]
    lin(torch.randn(1, 4)).sum().backward()
    assert out["p"].grad is not None


def test_shared_storage_comes_back_shared_and_is_written_once(writer, ckdir):
    base = torch.arange(48, dtype=torch.float32)
    sd = {"full": base, "slice": base[2:4], "t": base.view(6, 8).t(), "exp": base[:1].expand(4, 3),
          "twice": base, "bytes": base.view(torch.uint8)[4:12]}
    writer.save(sd, ckdir / "ck")
    m = decode_manifest_json((ckdir / "ck" / MANIFEST_NAME).read_text())
    assert sum(t["nbytes"] for t in m["tensors"].values()) == base.numel() * 4  # the shared bytes once
    out = fw.load(ckdir / "ck")
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
        assert out[k].stride() == v.stride() and out[k].storage_offset() * out[k].element_size() == \
            v.storage_offset() * v.element_size(), k
    ptr = out["full"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == ptr for k in sd)
    out["full"][2] = -1.0  # an in-place change through one name shows through the others
    assert out["slice"][0] == -1.0 and out["t"][2, 0] == -1.0 and out["twice"][2] == -1.0


def test_views_without_a_covering_tensor_store_their_span(writer, ckdir):
    big = torch.randn(1000)
    sd = {"a": big[10:20], "b": big[15:40:3]}
    writer.save(sd, ckdir / "ck")
    m = decode_manifest_json((ckdir / "ck" / MANIFEST_NAME).read_text())
    (stored,) = m["tensors"].values()
    assert stored["nbytes"] == (39 - 10 + 1) * 4  # the span the views reach, not the whole storage
    out = fw.load(ckdir / "ck")
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    # a reader that knows nothing of flashwrite still sees the stored span
    from safetensors.torch import load_file
    names = [n for f in sorted((ckdir / "ck").glob("*.safetensors")) for n in load_file(f)]
    assert names == list(m["tensors"])


NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64,
                np.float16, np.float32, np.float64, np.complex64, np.complex128]


@pytest.mark.parametrize("dt", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_arrays_without_pickle(writer, ckdir, dt):
    rs = np.random.RandomState(0)
    a = (rs.rand(3, 4) * 100).astype(dt)
    sd = {"a": a, "t": a.T, "scalar0d": np.array(7, dtype=dt), "be": a.astype(np.dtype(dt).newbyteorder(">")),
          "np_scalar": a.reshape(-1)[1]}
    writer.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck")
    for k, v in sd.items():
        assert type(out[k]) is type(v) or (k == "be" and isinstance(out[k], np.ndarray)), k
        assert out[k].shape == v.shape and out[k].dtype == v.dtype.newbyteorder("="), k
        assert np.array_equal(out[k], v), k


def test_non_numeric_numpy_needs_pickle(writer, ckdir):
    with pytest.raises(TypeError, match="objs.*allow_pickle"):
        writer.save({"objs": np.array(["a", None], dtype=object)}, ckdir / "ck")
    writer.save({"objs": np.array(["a", "b"])}, ckdir / "ck2", allow_pickle=True)
    assert list(fw.load(ckdir / "ck2", allow_pickle=True)["objs"]) == ["a", "b"]


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("make, words", [
    (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized.*dequantize"),
    (lambda: torch.empty(3, device="meta"), "meta tensor has no data"),
    (lambda: torch.eye(3).to_sparse(), "sparse.*to_dense"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged), "nested tensors.*unbind"),
    (lambda: torch.ones(2).as_subclass(_Sub), "subclass.*_Sub"),
], ids=["quantized", "meta", "sparse", "nested", "subclass"])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated in torch, still made
def test_unstorable_tensors_say_why_and_where(writer, ckdir, make, words):
    with pytest.raises(TypeError, match=f"layer.0.w: .*{words}"):
        writer.save({"layer": [{"w": make()}]}, ckdir / "ck")
    assert not (ckdir / "ck").exists()


# --- hostile view nodes --------------------------------------------------------------------------

def _with_view_node(ckdir, writer, **edit):
    base = torch.arange(16, dtype=torch.float32)
    writer.save({"full": base, "part": base[4:8]}, ckdir / "ck")
    path = ckdir / "ck" / MANIFEST_NAME
    m = decode_manifest_json(path.read_text())
    items = m["tree"]["items"]
    view = items[1][1]
    assert view["t"] == "view"
    view.update(edit)
    path.write_bytes(encode_manifest(m))  # sealed: the view checks must refuse it, not the manifest checksum
    return ckdir / "ck"


@pytest.mark.parametrize("edit", [
    {"off": 64}, {"off": 60}, {"off": 2}, {"off": -4}, {"shape": [100]}, {"stride": [5]}, {"shape": [2, 2]},
    {"dtype": "float64", "off": 56}, {"dtype": "nope"}, {"k": "missing"}, {"shape": "x"}, {"shape": [1] * 65},
    {"off": True}, {"param": "yes"},
])
def test_hostile_view_nodes_are_refused(writer, ckdir, edit):
    path = _with_view_node(ckdir, writer, **edit)
    with pytest.raises(CorruptCheckpointError):
        fw.load(path, verify=False)


# --- property: random states of shared views ----------------------------------------------------

_runs = itertools.count()
def _printable(dt):
    try:  # hypothesis prints falsifying states: dtypes with no copy kernel (uint3, bits8) cannot be printed
        repr(torch.zeros(32, dtype=torch.uint8).view(dt)[::2])
        return True
    except (RuntimeError, NotImplementedError):
        return False


_DTS = [d for d in dtypes.supported_dtypes() if d.itemsize in (1, 2, 4, 8) and _printable(d)]


@st.composite
def _view_of(draw, base):
    n = base.numel()
    start = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from(["slice", "strided", "reshape_t", "expand", "same", "retype"]))
    if kind == "slice":
        return base[start:draw(st.integers(start, n))]
    if kind == "strided":
        return base[start::draw(st.integers(1, 5))]
    if kind == "reshape_t" and n % 2 == 0:
        return base.view(2, n // 2).t()
    if kind == "expand":
        return base[start:start + 1].expand(draw(st.integers(0, 4)), 3)
    if kind == "retype" and (n * base.element_size()) % 8 == 0:
        return base.view(torch.uint8)
    return base


@st.composite
def _state(draw):
    state, originals = {}, []
    for i in range(draw(st.integers(1, 4))):
        dt = draw(st.sampled_from(_DTS))
        n = draw(st.integers(1, 40))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
        base = (raw & 1 if dt == torch.bool else raw).view(dt)  # bools must be 0 or 1 to survive a copy
        views = [base] * draw(st.booleans()) + [draw(_view_of(base)) for _ in range(draw(st.integers(1, 3)))]
        state[f"g{i}"] = views if draw(st.booleans()) else tuple(views)
        originals.append(views)
    state["leaf"] = draw(st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.floats(allow_nan=False)))
    return state


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(t):
    """The bytes a tensor shows, in logical order, for any dtype (no dtype kernels needed)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).clone(memory_format=torch.contiguous_format) \
        .reshape(-1).view(torch.uint8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_state())
def test_property_shared_views_round_trip(writer, ckdir, state):
    path = ckdir / f"p{next(_runs)}"  # hypothesis seeds `random`: a counter, not random names
    writer.save(state, path)
    out = fw.load(path)
    saved_t, loaded_t = _tensors(state), _tensors(out)
    assert len(saved_t) == len(loaded_t)
    views_of = {}
    for a in saved_t:
        if a.numel():
            views_of.setdefault(a.untyped_storage().data_ptr(), set()).add(
                (a.dtype, a.storage_offset(), tuple(a.shape), a.stride()))
    for a, b in zip(saved_t, loaded_t):
        assert a.dtype == b.dtype and a.shape == b.shape
        shared = a.numel() and len(views_of[a.untyped_storage().data_ptr()]) > 1
        assert b.stride() == a.stride() if shared else b.is_contiguous()  # a lone view is stored contiguous
        assert torch.equal(_bytes(a), _bytes(b))
    # sharing: two saved tensors share a storage exactly when the loaded ones do (non-empty ones)
    ne = [(a, b) for a, b in zip(saved_t, loaded_t) if a.numel()]
    for a1, b1 in ne:
        for a2, b2 in ne:
            same_saved = a1.untyped_storage().data_ptr() == a2.untyped_storage().data_ptr()
            same_loaded = b1.untyped_storage().data_ptr() == b2.untyped_storage().data_ptr()
            assert same_saved == same_loaded
    assert type(out["leaf"]) is type(state["leaf"]) and out["leaf"] == state["leaf"]
    for k in state:
        assert type(out[k]) is type(state[k])
    stored = decode_manifest_json((path / MANIFEST_NAME).read_text())["tensors"]
    distinct = {a.untyped_storage().data_ptr() for a, _ in ne}
    assert len([t for t in stored.values() if t["nbytes"]]) <= len(distinct)


@pytest.mark.cuda
def test_cuda_loads_own_their_memory(ckdir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sd = {"a": torch.randn(1000, device="cuda"), "p": torch.nn.Parameter(torch.randn(10, device="cuda")),
          "b": torch.arange(7, device="cuda")}
    sd["slice"] = sd["a"][10:20]
    fw.save(sd, ckdir / "ck")
    out = fw.load(ckdir / "ck", map_location="cuda")
    for k in ("a", "b"):
        assert out[k].storage_offset() == 0 and out[k].untyped_storage().nbytes() == out[k].numel() * 4 * \
            (2 if out[k].dtype == torch.int64 else 1)
    assert type(out["p"]) is torch.nn.Parameter
    assert out["slice"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert math.isclose(out["a"].sum().item(), sd["a"].sum().item(), rel_tol=1e-6)
