"""The native walk and layout of a save (csrc/python/state_walk.cpp, csrc/write/stripe_layout.cpp).

What they make must be what flatten.py and plan.py document: the same tree, keys and
headers a reader that knows nothing of flashwrite can open; these tests hold them to
that where the native code has its own paths (escaped keys, untracked tree lists,
views stored resolved, columns handed to the engine).
"""

import collections
import gc
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

import flashwrite as fw
from flashwrite import _core
from flashwrite.state.flatten import MAX_DEPTH, flatten, flatten_columns
from flashwrite.layout.plan import plan_files


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _stripes(path):
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


KEYS = ['quote"d', "back\\slash", "new\nline", "tab\tand\x01ctl", "\x7fdel", "café", "日本語", "emoji 😀", "plain.key"]


def test_keys_that_need_escapes_round_trip_and_open_in_safetensors(writer, ckdir):
    state = {k: torch.full((2, 3), float(i)) for i, k in enumerate(KEYS)}
    p = str(ckdir / "ck")
    writer.save(state, p)
    out = fw.load(p)
    assert list(out) == KEYS
    for k in KEYS:
        assert torch.equal(out[k], state[k]), k
    seen = {}
    for f in _stripes(p):
        # The header is JSON as Python's json spells it, and safetensors itself reads every key.
        assert set(_header(f)) - {"__metadata__"} == set(safe_open(f, "pt").keys())
        with safe_open(f, "pt") as st:
            seen.update({k: st.get_tensor(k) for k in st.keys()})
    assert set(seen) == set(KEYS)
    for k in KEYS:
        assert torch.equal(seen[k], state[k]), k


def test_headers_lay_out_largest_elements_first_with_no_holes(ckdir):
    state = {"b": torch.zeros(3, dtype=torch.uint8), "a": torch.ones(5, dtype=torch.float64),
             "c": torch.ones(7, dtype=torch.int16), "d": torch.zeros(0), "e": torch.ones((), dtype=torch.float32),
             "f": torch.ones(4, dtype=torch.float64)}
    p = str(ckdir / "ck")
    fw.save(state, p, stripes=1)
    (f,) = _stripes(p)
    h = _header(f)
    meta = h.pop("__metadata__")
    assert meta["writer"] == "flashwrite"
    order = list(h)  # JSON objects keep their order
    assert order == ["a", "f", "d", "e", "c", "b"]  # 8-byte elements, then 4, 2, 1; the state's order within
    end = 0
    for k in order:
        lo, hi = h[k]["data_offsets"]
        assert lo == end
        end = hi
    assert h["e"]["shape"] == [] and h["d"]["shape"] == [0] and h["a"]["shape"] == [5]
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
    assert (8 + n) % 4096 == 0
    assert os.path.getsize(f) == 8 + n + end


def test_tree_lists_are_not_left_to_the_garbage_collector():
    """A save of 100,000 tensors must not leave 100,000 tracked lists for the next
    collection to walk (20-35 ms at 20,000 tensors, measured inside the stall)."""
    state = {"m": {f"p{i}": torch.zeros(2) for i in range(50)}, "l": [torch.zeros(1), {"x": torch.zeros(1)}],
             "size": torch.Size([2, 3]), "step": 7}
    tree, tensors, aliases = flatten(state)
    stack, lists = [tree], 0
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if "items" in n:
                assert not gc.is_tracked(n["items"])
                lists += 1
                for it in n["items"]:
                    if isinstance(it, list):
                        assert not gc.is_tracked(it)
                        lists += 1
                        stack.extend(it)
                    else:
                        stack.append(it)
            elif n.get("t") != "size":
                stack.extend(v for v in n.values() if isinstance(v, (dict, list)))
    assert lists > 50
    # A tracked object inside an untracked list (the size leaf's list) outlives a collection.
    gc.collect()
    assert tree["items"][2][1] == {"t": "size", "v": [2, 3]}
    assert len(tensors) == 52 and not aliases


def test_walk_errors_name_the_key():
    deep = torch.zeros(1)
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match=r"0\.0\.0.*nested deeper than 200 levels"):
        flatten(deep)
    with pytest.raises(TypeError, match=r"inner: unsupported key type Tensor"):
        flatten({"inner": {torch.zeros(1): 1}})
    with pytest.raises(TypeError, match=r"outer\.0: cannot store builtins\.object without pickling"):
        flatten({"outer": [object()]})

    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"a\.b: tensor subclass .*Sub cannot be stored"):
        flatten({"a": {"b": torch.zeros(2).as_subclass(Sub)}})


def test_keys_of_every_kind_spell_as_flatten_documents():
    od = collections.OrderedDict([(3, torch.zeros(1)), ((1, "h"), torch.zeros(1)), (2.5, torch.zeros(1))])
    state = {"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}, "od": od, "t": (torch.zeros(1), torch.zeros(1))}
    tree, tensors, _ = flatten(state)
    assert [ft.key for ft in tensors] == ["a.b", "a.b#1", "od.3", "od.(1, 'h')", "od.2.5", "t.0", "t.1"]
    od_node = tree["items"][2][1]
    assert od_node["t"] == "odict"
    assert [it[0] for it in od_node["items"]] == [
        {"t": "int", "v": 3}, {"t": "tuple", "items": [{"t": "int", "v": 1}, {"t": "str", "v": "h"}]},
        {"t": "float", "v": (2.5).hex()}]
    assert flatten(torch.zeros(1))[1][0].key == "tensor"


def test_views_stored_resolved_come_from_their_own_copy(writer, ckdir):
    """A transposed, a negative and a conjugate view that share nothing are stored as
    their values (a copy made for the save), not as the bytes their pointer shows."""
    base = torch.arange(12.0).reshape(3, 4)
    c = torch.complex(torch.randn(4), torch.randn(4))
    state = {"t": base.t(), "neg": torch._neg_view(torch.arange(3.0)), "conj": c.conj(), "plain": torch.ones(2)}
    _, _, columns = flatten_columns(state)
    assert columns.sources[3] is state["plain"]  # the common case: the caller's tensor, no copy
    for i in range(3):
        src = columns.sources[i]
        assert src.is_contiguous() and not src.is_neg() and not src.is_conj()
        assert columns.ptrs[i] == src.data_ptr()
    p = str(ckdir / "ck")
    writer.save(state, p)
    out = fw.load(p)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg().contiguous()), k


def test_parameter_and_requires_grad_flags_from_the_walk():
    w = torch.nn.Parameter(torch.zeros(2))
    g = torch.zeros(2, requires_grad=True)
    tree, _, columns = flatten_columns({"w": w, "g": g, "x": torch.zeros(2)})
    nodes = [it[1] for it in tree["items"]]
    assert nodes == [{"t": "tensor", "param": True, "rg": True, "k": "w"}, {"t": "tensor", "rg": True, "k": "g"},
                     {"t": "tensor", "k": "x"}]
    assert columns.keys == ["w", "g", "x"] and columns.devices == ["cpu"] * 3


def test_plan_drops_its_sources_once_staged(ckdir):
    """The plan keeps no reference to the caller's tensors after staging: only the job
    does, until staged (so a save does not hold the state until the commit)."""
    _, _, columns = flatten_columns({"a": torch.ones(4), "b": torch.ones(8)})
    files = plan_files(None, 2, columns=columns)
    assert [p.key for f in files for p in f.tensors] and columns.sources is not None
    from flashwrite.saving.write import _stage_sources
    keepalive, segments, host_files, streams = _stage_sources(files)
    assert columns.sources is None and not segments and not streams
    assert sorted(j for _, members, *_ in host_files for j in members) == [0, 1]
    with pytest.raises(RuntimeError, match="staged already"):
        _stage_sources(files)


def test_engine_refuses_host_columns_that_do_not_add_up(ckdir):
    eng = _core.Engine(1 << 20)
    t = torch.ones(1024)
    files = [(str(ckdir / "x"), b"\0" * 4096, 4096 + t.nbytes)]
    with pytest.raises(IndexError, match="host_files"):
        eng.start_save(files, [], [t], host_files=[(0, [1], [4096], [t.data_ptr()], [t.nbytes])])
    with pytest.raises(ValueError, match="no address"):
        eng.start_save(files, [], [t], host_files=[(0, [0], [4096], [0], [t.nbytes])])
    with pytest.raises(ValueError, match="members != offsets"):
        eng.start_save(files, [], [t], host_files=[(0, [0], [], [t.data_ptr()], [t.nbytes])])


def test_layout_refuses_a_header_past_the_safetensors_limit():
    n = 3
    keys = ["k" * (_core.MAX_HEADER_BYTES // 2) + str(i) for i in range(n)]
    with pytest.raises(ValueError, match=r"m-00001-of-00001\.safetensors: safetensors header would be \d+ bytes"):
        _core.layout_stripes(keys, [torch.float32] * n, ["1"] * n, [4] * n, {torch.float32: ("F32", 4)},
                             ["m-00001-of-00001.safetensors"], "{}", json.dumps)
