"""Untrusted checkpoints: every crafted inconsistency is rejected with a flashwrite
error (CorruptCheckpointError family) before anything is allocated from its
numbers, nothing escapes the checkpoint directory, nothing is unpickled unless
asked for on both sides; plus >10,000 fuzzed manifests, stripe headers and trees.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashwrite as fw
from flashwrite import format as fmt
from flashwrite.errors import CorruptCheckpointError, UnsafeCheckpointError
from flashwrite.state.flatten import unflatten
from flashwrite.format import decode_manifest_json

xxhash = pytest.importorskip("xxhash")


def _state():
    g = torch.Generator().manual_seed(3)
    return {"f64": torch.randn(40, generator=g).double(), "f32": torch.randn(3, 5, generator=g),
            "u8": torch.arange(13, dtype=torch.uint8), "i16": torch.arange(7, dtype=torch.int16),
            "nested": {"x": torch.randn(9, generator=g), "tied": None}, "step": 3, "name": "run"}


def _read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


class Ckpt:
    """A real 2-stripe checkpoint and helpers to make it say what a test wants,
    consistently (checksums recomputed) so that only the targeted lie remains."""

    def __init__(self, path):
        self.path = str(path)
        self.state = _state()
        fw.save(self.state, self.path, stripes=2, chunk_bytes=1 << 16)
        self.manifest_bytes = _read(self.file("flashwrite.json"))
        self.stripes = {f["name"]: _read(self.file(f["name"])) for f in self.m0()["files"]}

    def file(self, name):
        return os.path.join(self.path, name)

    def m0(self):
        return decode_manifest_json(self.manifest_bytes)

    def reset(self):
        for name, data in self.stripes.items():
            p = self.file(name)
            if os.path.islink(p) or not os.path.isfile(p):
                (os.unlink if not os.path.isdir(p) or os.path.islink(p) else os.rmdir)(p)
            with open(p, "wb") as fh:
                fh.write(data)
        self.write_manifest(self.m0())

    def write_manifest(self, m, raw: bytes | None = None):
        """Write ``m`` sealed with a fresh manifest checksum (so the targeted lie is what
        a load meets, not the checksum), or ``raw`` exactly as given."""
        p = self.file("flashwrite.json")
        if os.path.lexists(p) and not os.path.isfile(p):
            os.unlink(p)
        with open(p, "wb") as fh:
            fh.write(raw if raw is not None else fmt.encode_manifest(m))

    def header(self, name):
        data = _read(self.file(name))
        (n,) = struct.unpack("<Q", data[:8])
        return json.loads(data[8:8 + n]), n

    def write_header(self, name, header, length=None):
        (n,) = struct.unpack("<Q", self.stripes[name][:8])  # the writer's length: the space there is
        body = json.dumps(header).encode()
        assert len(body) <= n
        with open(self.file(name), "r+b") as fh:
            fh.write(struct.pack("<Q", n if length is None else length) + body + b" " * (n - len(body)))

    def rechecksum(self, m):
        block = m["checksum"]["block_bytes"]
        for t in m["tensors"].values():
            data = _read(self.file(m["files"][t["file"]]["name"]))
            t["checksums"] = [f"{xxhash.xxh3_64_intdigest(data[o:o + n]):016x}"
                              for o, n in fmt.piece_ranges(t["offset"], t["nbytes"], block)]
        return m

    def stripe_of(self, m, key):
        return m["files"][m["tensors"][key]["file"]]["name"]


@pytest.fixture
def ck(tmp_path):
    return Ckpt(tmp_path / "ck")


def rejected(path, exc=CorruptCheckpointError, *, file=None, tensor=None, into=None, offline=True):
    """Both load modes and verify() reject the checkpoint with ``exc``. (offline=False:
    a fault in the tree, which verify() does not build, only loads can see.)"""
    calls = [lambda: fw.load(path), lambda: fw.load(path, verify=False)]
    if offline:
        calls.append(lambda: fw.verify(path))
    if into is not None:
        calls.append(lambda: fw.load(path, into=into))
    errors = []
    for call in calls:
        with pytest.raises(exc) as ei:
            call()
        e = ei.value
        if file is not None:
            assert e.file == file, e
        if tensor is not None:
            assert e.tensor == tensor, e
        errors.append(e)
    return errors[0]


def test_base_checkpoint_is_fine(ck):
    assert_same(fw.load(ck.path), ck.state)
    m = ck.rechecksum(ck.m0())
    assert m == ck.m0()  # the test's checksum helper agrees with the writer


# ------------------------------------------------------------------ paths

@pytest.mark.parametrize("name", ["../evil.safetensors", "ABS", "sub/x.safetensors", "..", ".", "",
                                  "flashwrite.json", "a\x00b", 123, None, "x" * 300, ".hidden",
                                  "model\\..\\x", "evil.safetensors\n/x"])
def test_member_names_cannot_escape(ck, tmp_path, name):
    m = ck.m0()
    real = m["files"][0]["name"]
    # The escape target exists and holds the real stripe: following the name would "work".
    with open(tmp_path / "evil.safetensors", "wb") as fh:
        fh.write(ck.stripes[real])
    m["files"][0]["name"] = str(tmp_path / "evil.safetensors") if name == "ABS" else name
    ck.write_manifest(m)
    rejected(ck.path, UnsafeCheckpointError, file="flashwrite.json")


def test_symlinked_stripe_is_refused(ck, tmp_path):
    m = ck.m0()
    name = m["files"][1]["name"]
    os.rename(ck.file(name), tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", ck.file(name))
    e = rejected(ck.path, UnsafeCheckpointError, file=name)
    assert "not a regular file" in str(e)


def test_directory_or_fifo_in_place_of_a_stripe(ck):
    m = ck.m0()
    name = m["files"][0]["name"]
    os.unlink(ck.file(name))
    os.mkdir(ck.file(name))
    m["files"][0]["size"] = os.stat(ck.file(name)).st_size  # even with the size made to agree
    ck.write_manifest(m)
    with pytest.raises(CorruptCheckpointError) as ei:
        fw.load(ck.path, verify=False)
    assert ei.value.file == name
    os.rmdir(ck.file(name))
    os.mkfifo(ck.file(name))
    with pytest.raises(CorruptCheckpointError):
        fw.load(ck.path, verify=False)


def test_fifo_manifest_does_not_hang(ck):
    os.unlink(ck.file("flashwrite.json"))
    os.mkfifo(ck.file("flashwrite.json"))
    out = {}

    def run():
        try:
            fw.load(ck.path)
        except BaseException as e:
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock it before failing
        fd = os.open(ck.file("flashwrite.json"), os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("load() hung opening a FIFO planted as the manifest")
    assert isinstance(out["e"], CorruptCheckpointError), out


# ------------------------------------------------------------------ sizes and offsets

def test_absurd_stripe_header_length(ck):
    m = ck.m0()
    name = m["files"][0]["name"]
    header, _ = ck.header(name)
    for length in (2**64 - 1, 2**63, 0, 7):
        ck.write_header(name, header, length=length)
        e = rejected(ck.path, file=name)
        assert "header length" in str(e)


@pytest.mark.parametrize("field,value", [("header_bytes", 2**40), ("header_bytes", 0), ("size", 2**60),
                                         ("size", -1), ("size", 2**70), ("header_bytes", 4095)])
def test_absurd_file_sizes_in_manifest(ck, field, value):
    m = ck.m0()
    m["files"][0][field] = value
    ck.write_manifest(m)
    t0 = time.perf_counter()
    rejected(ck.path)
    assert time.perf_counter() - t0 < 5


def test_huge_manifest_is_refused_before_reading(ck):
    with open(ck.file("flashwrite.json"), "r+b") as fh:
        fh.truncate(fmt.MAX_MANIFEST_BYTES + 4096)  # sparse: costs no disk
    t0 = time.perf_counter()
    e = rejected(ck.path, file="flashwrite.json")
    assert "larger than" in str(e) and time.perf_counter() - t0 < 2


def test_offset_past_end_of_file(ck):
    m = ck.m0()
    key = "f64"
    t = m["tensors"][key]
    t["offset"] = m["files"][t["file"]]["size"] - 8
    ck.write_manifest(m)
    e = rejected(ck.path, tensor=key)
    assert "past the end" in str(e)


def test_offset_inside_header(ck):
    m = ck.m0()
    t = m["tensors"]["u8"]
    t["offset"] = 8
    ck.write_manifest(ck.rechecksum(m))
    rejected(ck.path)


def test_header_data_offsets_past_end(ck):
    m = ck.m0()
    name = ck.stripe_of(m, "f32")
    header, _ = ck.header(name)
    header["f32"]["data_offsets"] = [10**9, 10**9 + 60]
    ck.write_header(name, header)
    ck.write_manifest(ck.rechecksum(m))
    rejected(ck.path, file=name, tensor="f32")


def _crowded_stripe(m):
    """The stripe holding most tensors, and its tensors in file order."""
    by_file = {}
    for k, t in m["tensors"].items():
        if t["nbytes"]:
            by_file.setdefault(t["file"], []).append(k)
    fi = max(by_file, key=lambda f: len(by_file[f]))
    keys = sorted(by_file[fi], key=lambda k: m["tensors"][k]["offset"])
    assert len(keys) >= 2
    return m["files"][fi]["name"], keys


def test_overlapping_tensors_in_manifest(ck):
    m = ck.m0()
    name, (k1, k2) = _crowded_stripe(m)[0], _crowded_stripe(m)[1][:2]
    m["tensors"][k2]["offset"] = m["tensors"][k1]["offset"]  # both start at the same byte
    header, _ = ck.header(name)
    start = header[k1]["data_offsets"][0]
    header[k2]["data_offsets"] = [start, start + m["tensors"][k2]["nbytes"]]
    ck.write_header(name, header)
    ck.write_manifest(ck.rechecksum(m))
    e = rejected(ck.path, file=name)
    assert "overlap" in str(e)


def test_overlapping_tensors_in_header_only(ck):
    m = ck.m0()
    name, (k1, k2) = _crowded_stripe(m)[0], _crowded_stripe(m)[1][:2]
    header, _ = ck.header(name)
    header[k2]["data_offsets"] = header[k1]["data_offsets"]
    ck.write_header(name, header)
    rejected(ck.path, file=name)


@pytest.mark.parametrize("shape", [[41], [5, 9], [], [-40], [40.0], [True] * 40, [1] * 65, [2**62, 2**62, 0]])
def test_shape_disagrees_with_byte_length(ck, shape):
    m = ck.m0()
    m["tensors"]["f64"]["shape"] = shape
    ck.write_manifest(m)
    rejected(ck.path)


@pytest.mark.parametrize("dtype", ["float128", "", 5, ["float64"], None, "complex64x", "int8"])
def test_dtype_disagrees_with_byte_length(ck, dtype):
    m = ck.m0()
    m["tensors"]["f64"]["dtype"] = dtype
    ck.write_manifest(m)
    rejected(ck.path)


def test_header_dtype_or_shape_disagrees(ck):
    m = ck.m0()
    name = ck.stripe_of(m, "f32")
    for change in ({"dtype": "I32"}, {"shape": [15]}, {"dtype": "F64", "shape": [3, 5]}):
        ck.reset()
        header, _ = ck.header(name)
        header["f32"].update(change)
        ck.write_header(name, header)
        rejected(ck.path, file=name, tensor="f32")


def test_unaligned_tensor(ck):
    """Consistent manifest, header and checksums, but a float32 one byte off its
    alignment: must be a flashwrite error, not a crash in a view."""
    m = ck.m0()
    name, keys = _crowded_stripe(m)
    key = "f32"
    assert key in keys
    header, _ = ck.header(name)
    t = m["tensors"][key]
    f = m["files"][t["file"]]
    data_end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    rel = data_end + 1
    while (f["header_bytes"] + rel) % 4 == 0:  # off a 4-byte boundary, past every other tensor
        rel += 1
    with open(ck.file(name), "r+b") as fh:
        fh.seek(f["header_bytes"] + rel)
        fh.write(ck.stripes[name][t["offset"]:t["offset"] + t["nbytes"]])
    f["size"] = f["header_bytes"] + rel + t["nbytes"]
    header[key]["data_offsets"] = [rel, rel + t["nbytes"]]
    t["offset"] = f["header_bytes"] + rel
    assert t["offset"] % 4
    ck.write_header(name, header)
    ck.write_manifest(ck.rechecksum(m))
    e = rejected(ck.path, file=name, tensor=key)
    assert "aligned" in str(e)


def test_piece_count_is_not_materialised(ck):
    """nbytes of 2**60 with one checksum: rejected by arithmetic, not by building a list."""
    m = ck.m0()
    t = m["tensors"]["u8"]
    f = m["files"][t["file"]]
    f["size"] = 2**61
    t["nbytes"] = 2**60
    t["shape"] = [2**60]
    ck.write_manifest(m)
    t0 = time.perf_counter()
    rejected(ck.path)
    assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("mutate", [
    lambda m: m.update(format_version=99), lambda m: m.update(format_version=max(fmt.READABLE_VERSIONS) + 1),
    lambda m: m.update(format_version=0), lambda m: m.update(format="other"),
    lambda m: m["checksum"].update(algorithm="md5"), lambda m: m["checksum"].update(block_bytes=1000),
    lambda m: m["tensors"]["f64"].update(checksums=["zz"]), lambda m: m["tensors"]["f64"].update(checksums=[]),
    lambda m: m["tensors"]["f64"].update(file=7), lambda m: m["tensors"]["f64"].update(file=-1),
    lambda m: m.update(aliases={"a": "missing"}), lambda m: m.update(files="x"), lambda m: m.update(tensors=[]),
    lambda m: m["files"].append(dict(m["files"][0])),
])
def test_bad_manifest_fields(ck, mutate):
    m = ck.m0()
    mutate(m)
    ck.write_manifest(m)
    rejected(ck.path, into=_zeros_like_state())


@pytest.mark.parametrize("tree", [
    "unknown-tensor", {"t": "float", "v": "0x1p99999"}, {"t": "size", "v": [2**70]}, {"t": "dtype", "v": "load"},
    {"t": "device", "v": "cuda:99999999999999999999"}, {"t": "bytes", "v": "not base64!"},
    {"t": "dict", "items": [[{"t": "list", "items": []}, {"t": "none"}]]}, json.loads("[" * 50 + "]" * 50),
    {"t": "int", "v": 1.5}, {"t": "list", "items": {}}, {"t": "x" * 10_000},
])
def test_bad_tree(ck, tree):
    m = ck.m0()
    if tree == "unknown-tensor":
        m["tree"]["items"][0][1]["k"] = "missing"
    else:
        m["tree"] = tree
    ck.write_manifest(m)
    rejected(ck.path, into=_zeros_like_state(), file="flashwrite.json", offline=False)


def _zeros_like_state():
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in _state().items()}
    into["nested"] = {"x": torch.zeros(9), "tied": None}
    return into


def test_deeply_nested_json(ck):
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        ck.write_manifest(None, raw)
        rejected(ck.path, file="flashwrite.json")
    ck.reset()
    name = ck.m0()["files"][0]["name"]
    _, n = ck.header(name)
    with open(ck.file(name), "r+b") as fh:
        fh.seek(8)
        fh.write(b"[" * n)
    rejected(ck.path, file=name)


_ALLOC_PROBE = textwrap.dedent("""
    import json, os, resource, shutil, struct, sys
    import torch
    import flashwrite as fw
    from flashwrite import format as fmt
    from flashwrite.errors import CorruptCheckpointError
    base, work = sys.argv[1], sys.argv[2]
    m0 = fmt.decode_manifest_json(open(os.path.join(base, "flashwrite.json")).read())
    name = m0["files"][0]["name"]
    def case(label, mutate=None, stripe=None, manifest_size=None):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        m = json.loads(json.dumps(m0))
        if mutate:
            mutate(m)
        with open(os.path.join(work, "flashwrite.json"), "wb") as fh:
            fh.write(fmt.encode_manifest(m))  # sealed: the bounds checks must refuse, not the checksum
        if manifest_size:
            os.truncate(os.path.join(work, "flashwrite.json"), manifest_size)
        if stripe:
            with open(os.path.join(work, name), "r+b") as fh:
                stripe(fh)
        try:
            fw.load(work)
            print(label, "loaded")
        except CorruptCheckpointError as e:
            print(label, "rejected", type(e).__name__)
        except BaseException as e:
            print(label, "FAILED", type(e).__name__, str(e)[:200])
    def huge_tensor(m):
        t = next(t for t in m["tensors"].values() if t["file"] == 0)
        m["files"][0]["size"] = 2**50
        t["nbytes"], t["dtype"], t["shape"] = 2**49, "uint8", [2**49]
    def huge_pieces(m):
        t = next(t for t in m["tensors"].values() if t["file"] == 0)
        m["files"][0]["size"] = 2**40
        t["nbytes"], t["dtype"], t["shape"], t["checksums"] = 2**39, "uint8", [2**39], ["0" * 16]
    # Everything from here on must fit in 512 MiB more address space than the process has now.
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
    case("huge-file-size", lambda m: m["files"][0].update(size=2**50))
    case("huge-tensor", huge_tensor)
    case("huge-piece-count", huge_pieces)
    case("huge-header-bytes", lambda m: m["files"][0].update(header_bytes=2**40))
    case("huge-header-length", stripe=lambda fh: fh.write(struct.pack("<Q", 2**63)))
    case("huge-manifest", manifest_size=(1 << 30) + 1)
    case("huge-shape", lambda m: m["tensors"][next(iter(m["tensors"]))].update(shape=[2**62] * 64))
    case("control", None)
""")


def test_absurd_numbers_allocate_nothing(ck, tmp_path):
    """Under an address-space limit of +512 MiB, absurd sizes must be rejected by
    the checks, not by running out of memory trying to honour them."""
    r = subprocess.run([sys.executable, "-c", _ALLOC_PROBE, ck.path, str(tmp_path / "work")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines.pop("control") == "loaded", r.stdout
    assert len(lines) == 7, r.stdout
    for label, outcome in lines.items():
        assert outcome.startswith("rejected"), (label, outcome)


# ------------------------------------------------------------------ pickle

class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_no_pickle_unless_asked_on_both_sides(tmp_path):
    class Obj:  # noqa: B903 - any user object
        pass

    with pytest.raises(TypeError, match="allow_pickle"):
        fw.save({"o": Obj()}, tmp_path / "a")
    assert not os.path.exists(tmp_path / "a") and os.listdir(tmp_path) == []
    fw.save({"o": {1, 2}, "t": torch.ones(2)}, tmp_path / "b", allow_pickle=True)
    with pytest.raises(UnsafeCheckpointError):
        fw.load(tmp_path / "b")
    assert fw.load(tmp_path / "b", allow_pickle=True)["o"] == {1, 2}
    mgr = fw.CheckpointManager(tmp_path / "m", every_n_steps=1)
    with pytest.raises(TypeError):
        mgr.maybe_save(1, {"o": {1, 2}})
    mgr.close()
    assert mgr.all_steps() == [] and os.listdir(tmp_path / "m") == []


def test_hostile_pickle_is_never_run(ck, tmp_path):
    marker = tmp_path / "pwned"
    m = ck.m0()
    m["tree"] = {"t": "list", "items": [{"t": "pickle", "v": base64.b64encode(pickle.dumps(_Payload(str(marker))))
                                         .decode()}]}
    ck.write_manifest(m)
    for verify in (True, False):
        with pytest.raises(UnsafeCheckpointError):
            fw.load(ck.path, verify=verify)
    os.rename(ck.path, tmp_path / "step-00000004")
    with pytest.raises(UnsafeCheckpointError):
        fw.CheckpointManager(tmp_path, cleanup=False).restore(4)
    assert not marker.exists()
    # The payload is real: opting in on load runs it.
    fw.load(tmp_path / "step-00000004", allow_pickle=True)
    assert marker.is_dir()


# ------------------------------------------------------------------ fuzzing

FUZZ_COUNTS: dict[str, int] = {}


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("a single case ran for more than 10 s")


def _guarded(fn):
    """Run one fuzz case under a 10 s alarm: a hang fails the test (with its example)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _load_or_flashwrite_error(path, verify, into=None, expected=None):
    """"loaded" or "rejected"; with ``expected``, a load that succeeds must return exactly
    the saved state (values, dtypes, shapes, structure, leaf types): an altered
    checkpoint may be refused, never read as a different state."""
    try:
        got = fw.load(path, verify=verify, into=into)
        if expected is not None:
            assert_same(got, expected)
        return "loaded"
    except CorruptCheckpointError:  # the family: checksum, unsafe, structure
        return "rejected"
    except (KeyError, ValueError) as e:
        # A well-formed checkpoint that does not fit the destination (strict=True):
        # load(into=...)'s documented refusal, raised before anything is copied.
        if into is None or not str(e).strip("'\"").startswith("load(into=...)"):
            raise
        return "rejected"


_INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 9, 40, 4095, 4096, 4097, 8192, 65536, 2**31, 2**32, 2**53, 2**62,
                     2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
_INTERESTING_STRS = ["../x", "../../etc/passwd", "/etc/passwd", "..", ".", "", "a/b", "x" * 300,
                     "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "flashwrite.json",
                     "float32", "float64", "uint8", "bits8", "complex128", "F32", "U8", "pickle", "tensor", "dict",
                     "list", "size", "dtype", "device", "cuda:0", "meta", "0x1p99999", "nan", "f64", "f32",
                     "nested.x", "0000000000000000", "ffffffffffffffff", "xxh3-64", "flashwrite", "__metadata__"]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(_INTERESTING_INTS),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.sampled_from(_INTERESTING_STRS))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.one_of(st.text(max_size=6), st.sampled_from(_INTERESTING_STRS)), c, max_size=4), max_leaves=8)
_DELETE = object()


def _paths(obj, prefix=()):
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _apply(obj, path, value):
    if not path:
        return value if value is not _DELETE else {}
    node = obj
    for p in path[:-1]:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return obj
    last = path[-1]
    try:
        if value is _DELETE:
            del node[last]
        elif isinstance(value, tuple) and value and value[0] == "delta" and isinstance(node[last], int) \
                and not isinstance(node[last], bool):
            node[last] = node[last] + value[1]
        else:
            node[last] = value
    except (KeyError, IndexError, TypeError):
        pass
    return obj


# Mostly scalars (cheap to draw, and most of a manifest's checks are about scalars).
_mutation_value = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.just(_DELETE),
                            st.tuples(st.just("delta"), st.integers(-9000, 9000)))


@pytest.mark.slow  # README's command leaves it out; CI runs it (-m slow)
def test_fuzz_manifest(shmdir):
    """Structured mutations of a real manifest, then a full load (both verify modes).

    As written, an altered manifest must be refused or load as exactly the saved state
    (its checksum covers every value). Re-sealed (the checksum recomputed, as a buggy
    writer or a deliberate editor would), the stripe headers' cross-check must catch
    every change of a tensor's dtype, shape or byte range: such a load must also be
    identical unless the change touched what no header records (the tree, aliases, and
    a dtype stored as raw bytes)."""
    c = Ckpt(os.path.join(shmdir, "ck"))
    base = c.m0()
    paths = _paths(base)
    outcomes = {"loaded": 0, "rejected": 0}
    sealed = {"loaded": 0, "rejected": 0, "compared": 0}

    @settings(max_examples=3500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, len(paths) - 1), _mutation_value), min_size=1, max_size=4),
           st.booleans(), st.integers(0, 9), st.integers(0, 3))
    def case(mutations, verify, mode, reseal):
        m = json.loads(json.dumps(base))
        for i, v in mutations:
            m = _apply(m, paths[i], v)
        try:
            raw = fmt.encode_manifest(m) if reseal == 0 and isinstance(m, dict) else json.dumps(m).encode()
        except (ValueError, TypeError):
            return
        c.write_manifest(None, raw)
        dest = _zeros_like_state() if mode == 0 else None  # fresh: a load may add leaves to it
        if reseal == 0 and isinstance(m, dict):
            unrecorded = any(paths[i][:1] in (("tree",), ("aliases",)) or "dtype" in paths[i] for i, _ in mutations)
            outcome = _guarded(lambda: _load_or_flashwrite_error(c.path, verify, dest,
                                                                 expected=None if unrecorded else c.state))
            sealed[outcome] += 1
            sealed["compared"] += outcome == "loaded" and not unrecorded
            return
        outcomes[_guarded(lambda: _load_or_flashwrite_error(c.path, verify, dest, expected=c.state))] += 1

    case()
    FUZZ_COUNTS["manifest"] = sum(outcomes.values()) + sealed["loaded"] + sealed["rejected"]
    # Every successful load counted as compared was checked against the saved state (or this failed).
    print(f"manifest fuzz: {sum(outcomes.values())} altered manifests as written, {outcomes['loaded']} loaded, "
          f"0 different; {sealed['loaded'] + sealed['rejected']} altered and re-sealed, {sealed['loaded']} loaded, "
          f"{sealed['compared']} of them compared, 0 different")
    assert FUZZ_COUNTS["manifest"] >= 3400 and outcomes["rejected"] > 1000, (outcomes, sealed)


@pytest.mark.slow  # README's command leaves it out; CI runs it (-m slow)
def test_fuzz_stripe_header(shmdir):
    """Mutated safetensors headers (length field, bytes, structure) under a valid manifest."""
    c = Ckpt(os.path.join(shmdir, "ck"))
    name = c.m0()["files"][0]["name"]
    header, n = c.header(name)
    original = c.stripes[name][: 8 + n]
    hpaths = _paths(header)
    outcomes = {"loaded": 0, "rejected": 0}

    @settings(max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.tuples(st.just("length"), st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(
            [0, 7, 8, n - 1, n, n + 1, n + 8, 2**63, 2**64 - 1]))),
        st.tuples(st.just("bytes"), st.lists(st.tuples(st.integers(0, 8 + n - 1), st.binary(min_size=1, max_size=16)),
                                             min_size=1, max_size=4)),
        st.tuples(st.just("json"), st.lists(st.tuples(st.integers(0, len(hpaths) - 1), _mutation_value),
                                            min_size=1, max_size=4)),
    ), st.booleans())
    def case(mutation, verify):
        kind, arg = mutation
        data = bytearray(original)
        if kind == "length":
            data[:8] = struct.pack("<Q", arg)
        elif kind == "bytes":
            for pos, chunk in arg:
                data[pos:pos + len(chunk)] = chunk
            del data[8 + n:]
        else:
            h = json.loads(json.dumps(header))
            for i, v in arg:
                h = _apply(h, hpaths[i], v)
            try:
                body = json.dumps(h).encode()
            except (ValueError, TypeError):
                return
            if len(body) > n:
                return
            data[8:] = body + b" " * (n - len(body))
        assert len(data) == 8 + n
        with open(c.file(name), "r+b") as fh:
            fh.write(data)
        outcomes[_guarded(lambda: _load_or_flashwrite_error(c.path, verify, expected=c.state))] += 1

    case()
    FUZZ_COUNTS["header"] = sum(outcomes.values())
    print(f"stripe header fuzz: {FUZZ_COUNTS['header']} altered headers, {outcomes['loaded']} loaded, 0 different")
    assert FUZZ_COUNTS["header"] >= 2900 and outcomes["rejected"] > 1000, outcomes


_MANIFEST_SHAPED = st.fixed_dictionaries(
    {"format": st.just("flashwrite"), "format_version": st.just(1),
     "checksum": st.just({"algorithm": "xxh3-64", "block_bytes": 4096})},
    optional={"files": _values, "tensors": _values, "aliases": _values, "tree": _values})


@pytest.mark.slow  # README's command leaves it out; CI runs it (-m slow)
def test_fuzz_parse_and_unflatten():
    """One input per case, straight into a parser: the manifest parser (raw bytes, any
    JSON, manifest-shaped JSON), the tree builder, or the stripe header check."""
    seen = {"n": 0}

    @settings(max_examples=4000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.tuples(st.just("manifest"), st.binary(max_size=200)),
        st.tuples(st.just("manifest"), _values.map(lambda v: json.dumps(v).encode())),
        st.tuples(st.just("manifest"), _MANIFEST_SHAPED.map(lambda v: json.dumps(v).encode())),
        st.tuples(st.just("tree"), _values),
        st.tuples(st.just("header"), st.binary(max_size=120)),
        st.tuples(st.just("header"), _values.map(lambda v: struct.pack("<Q", len(json.dumps(v))) +
                                                 json.dumps(v).encode())),
    ))
    def case(item):
        kind, arg = item
        seen["n"] += 1

        def run():
            try:
                if kind == "manifest":
                    fmt.parse_manifest(arg)
                elif kind == "tree":
                    unflatten(arg, lambda k: torch.zeros(1))  # never allow_pickle: random bytes could run
                else:
                    fmt.check_stripe_header(memoryview(arg), fmt.FileEntry("s", 10**6, len(arg)), [])
            except CorruptCheckpointError:
                pass

        _guarded(run)

    case()
    FUZZ_COUNTS["parse"] = seen["n"]
    assert seen["n"] >= 3900


def test_fuzz_total():
    """The fuzz tests above ran at least 10,000 cases together (when run together)."""
    if len(FUZZ_COUNTS) < 3:
        pytest.skip("run with the three fuzz tests")
    print("fuzz cases:", FUZZ_COUNTS, "total", sum(FUZZ_COUNTS.values()))
    assert sum(FUZZ_COUNTS.values()) >= 10_000, FUZZ_COUNTS
