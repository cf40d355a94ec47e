"""I/O the kernel may legally do but a local disk rarely does, forced through LD_PRELOAD
shims built at test time (no root, no special mount), plus the chunk arithmetic's edge.

- short writes (and reads): every pwrite moves at most 4 KiB; saves still round-trip
  byte for byte. The threads backend is the one a shim can reach: the io_uring backend
  submits through liburing's own system calls (linked statically), which no preload
  can shorten. A FUSE file system that returns short writes reaches it: see
  test_fuse_faults.py (tests/fuse_faults.c, needs libfuse3-dev and /dev/fuse).
- O_DIRECT refused at open time (EINVAL, as on ramfs): the fallback to buffered I/O.
- the last chunk of a stripe whose size is one byte more than a multiple of chunk_bytes.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from conftest import assert_same
from shim_util import build_shim, preload_env, run_child

import flashwrite as fw
from flashwrite.format import MANIFEST_NAME
from flashwrite.format import decode_manifest_json

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


safetensors_torch = pytest.importorskip("safetensors.torch")

# Deterministic, so the parent rebuilds what the child saved without sharing memory.
_STATE = textwrap.dedent("""
    import torch
    def make_state():
        g = torch.Generator().manual_seed(5)
        return {"w": torch.randn(3 << 18, generator=g), "h": torch.randn(777, generator=g).half(),
                "ids": torch.randint(-9, 9, (40001,), dtype=torch.int64, generator=g),
                "mask": torch.rand(4097, generator=g) > 0.5, "c": torch.randn(33, dtype=torch.complex64, generator=g),
                "step": 3}
""")
exec(_STATE)


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    d = tmp_path_factory.mktemp("shims")
    return {n: build_shim(n, d) for n in ("shim_short_io", "shim_odirect_einval")}


def _stripes_match_saved(path, state):
    """The stripes, read by safetensors (no flashwrite, no shim), hold the saved bytes."""
    m = decode_manifest_json((path / MANIFEST_NAME).read_text())
    got = {}
    for f in m["files"]:
        got.update(safetensors_torch.load_file(str(path / f["name"])))
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("direct", [True, False])
def test_short_writes_and_reads_round_trip(shims, tmp_path, direct):
    report = tmp_path / "shortened"
    code = _STATE + textwrap.dedent(f"""
        import sys, flashwrite as fw
        from conftest import assert_same
        sd = make_state()
        with fw.Writer(backend="threads", stripes=3, chunk_bytes=1 << 18, queue_depth=8, direct={direct}) as w:
            st = w.save(sd, sys.argv[1])
        assert st.backend == "threads", st.backend
        assert_same(fw.load(sys.argv[1], backend="threads", direct={direct}), sd)
        print("OK")
    """)
    env = preload_env(shims["shim_short_io"], FW_SHIM_REPORT=str(report), FW_SHIM_SHORT_READS="1",
                      PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(_TESTS_FILE), os.environ.get("PYTHONPATH")])))
    r = run_child(code, env, str(tmp_path / "ck"))
    assert "OK" in r.stdout
    assert int(report.read_text()) > 100, "the shim shortened (almost) nothing: is it loaded?"
    state = make_state()
    _stripes_match_saved(tmp_path / "ck", state)
    assert_same(fw.load(tmp_path / "ck"), state)  # and without the shim, through the default backend


@pytest.mark.parametrize("create_first", ["0", "1"])
@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_open_time_odirect_einval_falls_back_to_buffered(shims, tmp_path, backend, create_first):
    """Every open with O_DIRECT fails with EINVAL (create_first: after creating the file,
    as ramfs does): stripes are written buffered and fsync'd, and read back buffered."""
    code = _STATE + textwrap.dedent(f"""
        import json, sys, flashwrite as fw
        from conftest import assert_same
        d = sys.argv[1]
        info = fw.backend_info(d)
        sd = make_state()
        with fw.Writer(backend="{backend}", stripes=3, chunk_bytes=1 << 18) as w:
            st = w.save(sd, d + "/ck")
        res = fw.load(d + "/ck", backend="{backend}")
        assert_same(res, sd)
        print(json.dumps({{"probe": info["direct_io"], "direct": st.direct, "buffered": st.files_buffered,
                          "stripes": st.stripes}}))
    """)
    env = preload_env(shims["shim_odirect_einval"], FW_SHIM_CREATE_FIRST=create_first,
                      PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(_TESTS_FILE), os.environ.get("PYTHONPATH")])))
    r = run_child(code, env, str(tmp_path))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"probe": False, "direct": False, "buffered": out["stripes"], "stripes": 3}, out
    _stripes_match_saved(tmp_path / "ck", make_state())


@pytest.mark.parametrize("backend", ["threads", "auto"])
@pytest.mark.parametrize("tail", [1, 2, 4095, 4097])
def test_last_chunk_when_size_mod_chunk_is_small(tmp_path, backend, tail):
    """A stripe of k*chunk + tail bytes (tail == 1 explicitly: the last chunk holds one
    byte) is written whole, for both backends."""
    chunk = 1 << 16
    header = 4096  # a one-tensor header pads to one page
    nbytes = 3 * chunk + tail - header
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(tail))
    with fw.Writer(backend=backend, stripes=1, chunk_bytes=chunk) as w:
        w.save({"x": x}, tmp_path / "ck")
    m = fw.format.read_manifest(tmp_path / "ck")
    assert [f.header_bytes for f in m.files] == [header]
    size = m.files[0].size
    assert size % chunk == tail and os.path.getsize(tmp_path / "ck" / m.files[0].name) == size
    _stripes_match_saved(tmp_path / "ck", {"x": x})
    assert torch.equal(fw.load(tmp_path / "ck", backend=backend)["x"], x)
