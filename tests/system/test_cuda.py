"""The GPU half of the data path: the CUDA runtime loaded at run time, D2H staging on
flashwrite's own streams, and loads straight to the GPU.

The first part runs everywhere (no GPU needed): how the loader behaves with no runtime
or a wrong FLASHWRITE_CUDA_RUNTIME (in subprocesses, since the runtime is loaded once
per process), and that the CPU path never touches CUDA. Tests marked ``cuda`` need a
GPU that PyTorch and flashwrite's runtime both see; elsewhere they skip, saying why.
"""

import glob
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fault_util import flip_byte
import flashwrite as fw
from flashwrite import _core
from flashwrite.format import dtypes
from flashwrite.state.flatten import flatten
from flashwrite.layout.plan import plan_files
from flashwrite.format import decode_manifest_json

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


# --------------------------------------------------------------------------- helpers


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 180) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    full_env = {k: v for k, v in os.environ.items() if k != "FLASHWRITE_CUDA_RUNTIME"}
    full_env.update(env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"subprocess failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


_CPU_ROUNDTRIP = """
    import json, tempfile, torch, flashwrite as fw
    from flashwrite.system import cuda as fw_cuda
    maps = lambda: "libcudart" in open("/proc/self/maps").read()
    before = maps()
    sd = {"w": torch.randn(1000, 33), "b": torch.arange(7, dtype=torch.int16), "step": 3}
    with tempfile.TemporaryDirectory() as d:
        fw.save(sd, d + "/ck")
        back = fw.load(d + "/ck")
        into = {"w": torch.zeros(1000, 33), "b": torch.zeros(7, dtype=torch.int16), "step": 0}
        fw.load(d + "/ck", into=into)
    ok = all(torch.equal(back[k], sd[k]) and torch.equal(into[k], sd[k]) for k in ("w", "b"))
    ok = ok and back["step"] == 3 and into["step"] == 3
    asked = fw_cuda.native_info.cache_info().currsize  # did the CPU path ask for CUDA at all?
    mapped_by_us = maps() and not before
    print(json.dumps({"cuda": fw.backend_info(initialize_cuda=True)["cuda"], "roundtrip": ok, "asked": asked,
                      "mapped_by_us": mapped_by_us}))
"""


def _sample(dt: torch.dtype, shape: tuple, device, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dt`` (no kernel of that dtype needed, so exotic dtypes work on GPUs)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtypes.itemsize(dt),), dtype=torch.uint8, generator=g)
    return raw.to(device).view(dt).reshape(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.fixture
def gpu():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU visible to PyTorch (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    info = _core.cuda_info()
    if not info["available"]:
        pytest.skip(f"flashwrite's CUDA runtime is unavailable: {info['reason']}")
    return torch.device("cuda", 0)


# ------------------------------------------------------------- no GPU needed


def test_cuda_info_explains_itself():
    info = fw.backend_info(initialize_cuda=True)["cuda"]
    assert set(info) >= {"available", "reason", "library", "via", "device_count", "runtime_version",
                         "driver_version", "initialized", "skipped"}
    assert info["initialized"] is (info["available"] or info["reason"].startswith(
        ("cudaGetDeviceCount failed", "CUDA runtime loaded but no GPU")))
    if info["available"]:
        assert info["reason"] is None and info["device_count"] >= 1 and info["library"]
    else:
        assert isinstance(info["reason"], str) and info["reason"] and info["device_count"] == 0


def test_wrong_runtime_path_is_a_clear_error_and_cpu_still_works(tmp_path):
    bogus = str(tmp_path / "no-such-dir" / "libcudart.so.12")
    out = _run_python(_CPU_ROUNDTRIP, {"FLASHWRITE_CUDA_RUNTIME": bogus})
    cuda = out["cuda"]
    assert cuda["available"] is False and cuda["device_count"] == 0 and cuda["library"] is None
    # Says which variable, which path, and what the dynamic loader said; nothing else was tried.
    assert cuda["reason"].startswith(f"FLASHWRITE_CUDA_RUNTIME={bogus} could not be loaded: ")
    assert "No such file or directory" in cuda["reason"]
    assert out["roundtrip"] is True


def test_runtime_path_to_a_library_that_is_not_cudart():
    not_cudart = _core.__file__  # a real shared object with none of the CUDA symbols
    out = _run_python(_CPU_ROUNDTRIP, {"FLASHWRITE_CUDA_RUNTIME": not_cudart})
    reason = out["cuda"]["reason"]
    assert out["cuda"]["available"] is False
    assert reason.startswith(f"FLASHWRITE_CUDA_RUNTIME={not_cudart} is not a usable CUDA runtime (missing ")
    assert "cudaGetDeviceCount" in reason and "cudaMemcpyAsync" in reason
    assert out["roundtrip"] is True


def _installed_cudarts() -> list[str]:
    pats = ["/usr/local/cuda*/lib*/libcudart.so.[0-9]*", "/usr/lib/x86_64-linux-gnu/libcudart.so.[0-9]*",
            os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cuda_runtime", "lib", "libcudart.so.*")]
    return sorted({os.path.realpath(p) for pat in pats for p in glob.glob(pat)})


def test_runtime_override_with_a_real_cudart():
    found = _installed_cudarts()
    if not found:
        pytest.skip("no libcudart.so installed on this machine")
    out = _run_python(_CPU_ROUNDTRIP, {"FLASHWRITE_CUDA_RUNTIME": found[0]})
    cuda = out["cuda"]
    assert cuda["library"] == found[0] and cuda["via"] == "FLASHWRITE_CUDA_RUNTIME"
    assert cuda["runtime_version"] > 0
    if not cuda["available"]:
        # e.g. this machine: a runtime but no driver or no GPU.
        assert cuda["reason"].startswith(("cudaGetDeviceCount failed: ", "CUDA runtime loaded but no GPU"))
    assert out["roundtrip"] is True


def test_cpu_path_never_touches_cuda():
    out = _run_python(_CPU_ROUNDTRIP)
    assert out["roundtrip"] is True
    assert out["asked"] == 0, "a CPU-only save/load asked for the CUDA runtime"
    assert out["mapped_by_us"] is False, "a CPU-only save/load mapped libcudart"


def _plan(sd, stripes=2):
    _, tensors, _ = flatten(sd)
    return plan_files(tensors, stripes)


def test_engine_accepts_four_and_five_field_segments(tmp_path):
    from safetensors.torch import load_file
    sd = {"a": torch.randn(300_000), "b": torch.arange(1000, dtype=torch.int64), "c": torch.randn(3, 3)}
    for fields in (4, 5):
        files = _plan(sd)
        segs = [(f.columns.sources[j].data_ptr(), p.nbytes, fi, p.offset, -1)[:fields]
                for fi, f in enumerate(files) for p, j in zip(f.tensors, f.members) if p.nbytes]
        eng = _core.Engine(1 << 20)
        d = tmp_path / str(fields)
        d.mkdir()
        job = eng.start_save([(str(d / f.name), f.header, f.size) for f in files], segs,
                             [f.columns.sources for f in files])
        assert job.wait(60)
        job.rethrow()
        assert job.stats()["device_bytes"] == 0
        assert eng.pool_pinned is False and eng.pin_error is None  # CPU saves never pin
        got = {}
        for f in files:
            got.update(load_file(str(d / f.name)))
        assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_malformed_segments_are_refused(tmp_path):
    files = _plan({"a": torch.randn(10)}, 1)
    eng = _core.Engine(1 << 20)
    spec = [(str(tmp_path / files[0].name), files[0].header, files[0].size)]
    with pytest.raises(ValueError, match="segment"):
        eng.start_save(spec, [(1, 2, 3)], None)
    with pytest.raises(TypeError, match="segment"):
        eng.start_save(spec, [[0, 40, 0, files[0].size - 40]], None)
    assert not os.path.exists(spec[0][0])


def test_gpu_segments_without_a_runtime_fail_before_any_file(tmp_path):
    info = _core.cuda_info()
    if info["available"]:
        pytest.skip("a CUDA runtime with a GPU is present")
    files = _plan({"a": torch.randn(10)}, 1)
    path = str(tmp_path / files[0].name)
    eng = _core.Engine(1 << 20)
    with pytest.raises(RuntimeError, match="needs the CUDA runtime, which is unavailable: ") as e:
        eng.start_save([(path, files[0].header, files[0].size)], [(0x1000, 40, 0, files[0].size - 40, 0)], None)
    assert info["reason"] in str(e.value)
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match="loading tensors to a GPU needs the CUDA runtime"):
        _core.start_load([(path, 4096)], [], placements=[(0, 0, 16, 0, 0x1000)])


# ----------------------------------------------------------------- GPU tests


@pytest.mark.cuda
@pytest.mark.parametrize("dt", dtypes.supported_dtypes(), ids=str)
def test_every_dtype_from_and_to_gpu(gpu, writer, ckdir, dt):
    shapes = {"x": (3, 5, 7), "scalar": (), "empty": (0, 4), "big": (300_001,)}  # big spans chunks
    sd = {k: _sample(dt, s, gpu, seed=i) for i, (k, s) in enumerate(shapes.items())}
    writer.save(sd, ckdir / "gpu")
    back = fw.load(ckdir / "gpu", map_location=None)  # where they were saved from
    cpu = fw.load(ckdir / "gpu")
    for k, v in sd.items():
        assert back[k].device == gpu and _same(back[k], v), k
        assert cpu[k].device.type == "cpu" and _same(cpu[k], v), k
    # A checkpoint of CPU tensors straight to the GPU.
    writer.save({k: _sample(dt, s, "cpu", seed=i) for i, (k, s) in enumerate(shapes.items())}, ckdir / "cpu")
    up = fw.load(ckdir / "cpu", map_location="cuda:0")
    for k, v in sd.items():
        assert up[k].device == gpu and _same(up[k], v), k


@pytest.mark.cuda
@pytest.mark.parametrize("block", [True, False], ids=["block", "wait_staged"])
def test_snapshot_is_ordered_after_queued_work_and_before_later_work(gpu, writer, ckdir, block):
    params = {f"p{i}": torch.zeros(8 << 20, device=gpu) for i in range(4)}  # 4 x 32 MiB
    torch.cuda.synchronize()
    # Queued before the save, and still running when save_async is called: must be in it.
    torch.cuda._sleep(100_000_000)
    for i, p in enumerate(params.values()):
        p.fill_(i + 1)
    fut = writer.save_async(params, ckdir / "ck", block=block)
    if block:
        assert fut.staged
    else:
        assert fut.wait_staged()
    # The next "optimizer step", right after: must not be in it.
    for p in params.values():
        p.mul_(-7.0)
    fut.result()
    back = fw.load(ckdir / "ck", map_location=gpu)
    for i, (k, v) in enumerate(back.items()):
        assert torch.all(v == i + 1), k
    assert fut.stats.pinned


@pytest.mark.cuda
def test_copies_follow_the_callers_current_stream(gpu, writer, ckdir):
    p = torch.zeros(4 << 20, device=gpu)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        p.fill_(3.0)
        fut = writer.save_async({"p": p}, ckdir / "ck")
        p.fill_(5.0)
    fut.result()
    assert torch.all(fw.load(ckdir / "ck")["p"] == 3.0)


@pytest.mark.cuda
def test_block_false_returns_before_the_copies_land(gpu, ckdir):
    w = fw.Writer(stripes=2, chunk_bytes=1 << 20)
    x = torch.randn(64 << 20, device=gpu)  # 256 MiB
    w.save({"x": x}, ckdir / "warm")  # allocates and pins the pool
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the copies cannot start before this ends
    fut = w.save_async({"x": x}, ckdir / "ck", block=False)
    assert not fut.staged
    assert fut.wait_staged()
    assert fut.staged
    fut.result()
    assert torch.equal(fw.load(ckdir / "ck", map_location=gpu)["x"], x)
    w.close()


@pytest.mark.cuda
def test_mixed_cpu_and_gpu_state(gpu, writer, ckdir):
    sd = {
        "model": {"w": torch.randn(1000, 1000, device=gpu), "b": torch.randn(1000, device=gpu).bfloat16()},
        "optim": {"step": 7, "exp_avg": torch.randn(1000, 1000), "lr": 1e-3},
        "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()},
        "ids": [torch.arange(10, device=gpu), torch.arange(5)],
    }
    writer.save(sd, ckdir / "ck")
    back = fw.load(ckdir / "ck", map_location=None)
    flat_src, flat_back = flatten(sd)[1], flatten(back)[1]
    assert [t.key for t in flat_src] == [t.key for t in flat_back]
    for s, b in zip(flat_src, flat_back):
        assert b.tensor.device == s.tensor.device and _same(b.tensor, s.tensor), s.key
    assert back["optim"]["step"] == 7 and back["optim"]["lr"] == 1e-3
    all_gpu = fw.load(ckdir / "ck", map_location={"cpu": "cuda:0"})
    assert all(t.tensor.device == gpu for t in flatten(all_gpu)[1])
    all_cpu = fw.load(ckdir / "ck", map_location="cpu")
    assert all(t.tensor.device.type == "cpu" for t in flatten(all_cpu)[1])


@pytest.mark.cuda
def test_load_into_gpu_tensors_in_place(gpu, writer, ckdir):
    src = {"w": torch.randn(513, 1027, device=gpu), "h": torch.randn(100, device=gpu).bfloat16(),
           "c": torch.randn(10), "n": 3}
    writer.save(src, ckdir / "ck")
    dst = {"w": torch.zeros(513, 1027, device=gpu), "h": torch.zeros(100, device=gpu, dtype=torch.bfloat16),
           "c": torch.zeros(10), "n": 0}
    ptrs = {k: v.data_ptr() for k, v in dst.items() if isinstance(v, torch.Tensor)}
    assert fw.load(ckdir / "ck", into=dst) is dst
    assert {k: v.data_ptr() for k, v in dst.items() if isinstance(v, torch.Tensor)} == ptrs
    for k in ("w", "h", "c"):
        assert torch.equal(dst[k], src[k]), k
    assert dst["n"] == 3
    # Destinations of another dtype or layout: converted / copied on the GPU.
    dst2 = {"w": torch.zeros(1027, 513, device=gpu).t(), "h": torch.zeros(100, device=gpu),
            "c": torch.zeros(10, device=gpu), "n": 0}
    fw.load(ckdir / "ck", into=dst2)
    assert torch.equal(dst2["w"], src["w"]) and torch.equal(dst2["h"], src["h"].float())
    assert torch.equal(dst2["c"].cpu(), src["c"])
    # A shape mismatch is refused before any byte is copied.
    bad = {"w": torch.zeros(2, 2, device=gpu), "h": torch.zeros(100, device=gpu, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="shape"):
        fw.load(ckdir / "ck", into=bad, strict=False)
    assert torch.all(bad["h"] == 0)


@pytest.mark.cuda
def test_load_into_a_gpu_module(gpu, writer, ckdir):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200)).to(gpu)
    b = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200)).to(gpu)
    writer.save(a.state_dict(), ckdir / "ck")
    fw.load(ckdir / "ck", into=b.state_dict())
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    x = torch.randn(4, 300, device=gpu)
    b(x).sum().backward()  # autograd is fine with the in-place fill


@pytest.mark.cuda
def test_damaged_chunk_never_reaches_the_gpu(gpu, ckdir):
    w = fw.Writer(stripes=1, chunk_bytes=1 << 20)
    w.save({"a": torch.ones(4 << 20, device=gpu)}, ckdir / "ck")  # 16 MiB
    w.close()
    m = decode_manifest_json((ckdir / "ck" / "flashwrite.json").read_text())
    e = m["tensors"]["a"]
    stripe = ckdir / "ck" / m["files"][e["file"]]["name"]
    at = e["offset"] + (9 << 20) + 123  # inside the second 8 MiB read chunk
    flip_byte(stripe, at, 0x40)
    dst = {"a": torch.zeros(4 << 20, device=gpu)}
    with pytest.raises(fw.ChecksumMismatchError, match="'a'"):
        fw.load(ckdir / "ck", into=dst)
    assert dst["a"][(at - e["offset"]) // 4].item() == 0.0
    with pytest.raises(fw.ChecksumMismatchError):
        fw.load(ckdir / "ck", map_location=gpu)


@pytest.mark.cuda
def test_bounded_pool_many_chunks_and_small_tensors(gpu, ckdir):
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 50_000, (300,), generator=g).tolist() + [3_000_001, 1 << 22]
    sd = {f"t{i}": torch.randn(n, generator=g).to(gpu) for i, n in enumerate(sizes)}
    sd["host"] = torch.randn(777_777)
    with fw.Writer(stripes=3, chunk_bytes=1 << 20, max_staging_bytes=4 << 20) as w:
        st = w.save(sd, ckdir / "ck")
        assert w.pool_bytes <= 4 << 20 and st.pinned
    fw.verify(ckdir / "ck")
    back = fw.load(ckdir / "ck", map_location=None)
    for k, v in sd.items():
        assert back[k].device == v.device and torch.equal(back[k], v), k


@pytest.mark.cuda
def test_pool_pinned_once_and_reused(gpu, ckdir):
    with fw.Writer(stripes=2, chunk_bytes=1 << 20) as w:
        w.save({"x": torch.randn(1 << 20)}, ckdir / "cpu")
        assert not w._engine.pool_pinned  # CPU saves do not pin
        x = torch.randn(1 << 20, device=gpu)
        st = w.save({"x": x}, ckdir / "g1")
        assert st.pinned and w._engine.pin_error is None
        before = w.pool_bytes
        for i in range(3):
            assert w.save({"x": x}, ckdir / f"g{i + 2}").pinned
        assert w.pool_bytes == before


@pytest.mark.cuda
def test_two_gpus(gpu, writer, ckdir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sd = {"a": torch.randn(3 << 20, device="cuda:0"), "b": torch.randn(3 << 20, device="cuda:1"),
          "c": torch.randn(10)}
    writer.save(sd, ckdir / "ck")
    back = fw.load(ckdir / "ck", map_location=None)
    for k, v in sd.items():
        assert back[k].device == v.device and torch.equal(back[k], v), k
    dst = {"a": torch.zeros(3 << 20, device="cuda:1"), "b": torch.zeros(3 << 20, device="cuda:0"),
           "c": torch.zeros(10)}
    fw.load(ckdir / "ck", into=dst)
    for k, v in sd.items():
        assert torch.equal(dst[k].cpu(), v.cpu()), k


@pytest.mark.cuda
def test_fallback_when_the_native_runtime_is_unusable(gpu, tmp_path):
    out = _run_python("""
        import json, tempfile, torch, flashwrite as fw
        sd = {"g": torch.randn(1000, device="cuda:0"), "c": torch.randn(10)}
        with tempfile.TemporaryDirectory() as d:
            fw.save(sd, d + "/ck")
            back = fw.load(d + "/ck", map_location=None)
            dst = {"g": torch.zeros(1000, device="cuda:0"), "c": torch.zeros(10)}
            fw.load(d + "/ck", into=dst)
        ok = all(back[k].device == v.device and torch.equal(back[k], v) and torch.equal(dst[k], v)
                 for k, v in sd.items())
        print(json.dumps({"ok": ok, "cuda": fw.backend_info()["cuda"]}))
    """, {"FLASHWRITE_CUDA_RUNTIME": str(tmp_path / "missing.so")})
    assert out["cuda"]["available"] is False and out["ok"] is True


# ------------------------------------- the native GPU path on a stand-in runtime
#
# tests/fake_cudart.cpp implements the CUDA runtime entry points the shim binds, with
# host memory as "device" memory and worker threads as streams. With it, the native
# D2H/H2D engine (fences, chunked copies, landing callbacks, checksums, slot accounting,
# error paths) runs end to end on any machine. It proves nothing about real GPUs.

HERE = os.path.dirname(os.path.abspath(_TESTS_FILE))


def _fake(fake_cudart, scenario, tmp_path, **env):
    env = {"FLASHWRITE_CUDA_RUNTIME": fake_cudart, **{k: str(v) for k, v in env.items()}}
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDART")}
    full_env.update(env)
    r = subprocess.run([sys.executable, os.path.join(HERE, "fake_cuda_child.py"), scenario, str(tmp_path)],
                       env=full_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{scenario} failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fake_runtime_is_reported_as_loaded(fake_cudart):
    out = _run_python("import json, flashwrite as fw; "
                      "print(json.dumps(fw.backend_info(initialize_cuda=True)['cuda']))",
                      {"FLASHWRITE_CUDA_RUNTIME": fake_cudart})
    assert out == {"available": True, "reason": None, "library": fake_cudart, "via": "FLASHWRITE_CUDA_RUNTIME",
                   "device_count": 1, "runtime_version": 12040, "driver_version": 12040, "initialized": True,
                   "skipped": None}


def test_fake_runtime_d2h_save_matches_the_cpu_path(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "save", tmp_path, FAKE_CUDART_COPY_DELAY_US=200)
    assert out["same_files"] and out["same_checksums"]
    assert out["device_bytes"] == out["expected_device_bytes"]
    assert out["pinned"] is True and out["pin_error"] is None and out["registered"] >= 1


def test_fake_runtime_d2h_is_ordered_after_the_callers_stream(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "order", tmp_path)
    # start_save returned once the fence was in place, well before the queued work ran...
    # (staged_at_return is the proof; the time, from the fence, is what a wait would cost)
    assert out["staged_at_return"] is False and out["returned_s"] < 0.3, out
    # ...staging waited for it, and what the caller queued after staging is not in the file.
    assert out["staged_s"] >= 0.3
    assert out["all_sevens"] is True


def test_fake_runtime_d2h_from_two_devices(fake_cudart, tmp_path):
    assert _fake(fake_cudart, "two_devices", tmp_path, FAKE_CUDART_DEVICES=2)["same_files"] is True


def test_fake_runtime_copy_error_is_raised_and_slots_come_back(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "bounded_and_failing", tmp_path, FAKE_CUDART_FAIL_COPY=3, FAKE_CUDART_COPY_DELAY_US=100)
    # The failed copy, or (the error being sticky) the wait for the copies that another
    # thread reached first: real CUDA reports an asynchronous fault at the next sync too.
    assert out["error"] and ("cudaMemcpyAsync device-to-host" in out["error"]
                             or "cudaEventSynchronize after copies" in out["error"]), out
    assert "cudaErrorIllegalAddress" in out["error"]
    assert out["pool_bytes"] <= 4 << 20
    # cudaErrorIllegalAddress is sticky on CUDA (and on the stand-in): no later save recovers.
    assert out["second_error"] and "cudaErrorIllegalAddress" in out["second_error"], out
    assert "sticky" in out["second_error"] and out["second_s"] < 5, out


def test_fake_runtime_invalid_device_is_a_clear_error(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "bad_device", tmp_path)
    assert out["error"] and "cudaSetDevice (cuda:5)" in out["error"] and "cudaErrorInvalidDevice" in out["error"]


def test_fake_runtime_pinning_failure_is_reported_and_saves_still_work(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "pin_fails", tmp_path, FAKE_CUDART_FAIL_REGISTER=1)
    assert out["pinned"] is False and out["pin_error"].startswith("cudaHostRegister of ")


def _a_pci_device():
    devs = sorted(os.listdir("/sys/bus/pci/devices")) if os.path.isdir("/sys/bus/pci/devices") else []
    if not devs:
        pytest.skip("no PCI device in /sys/bus/pci/devices to stand for the GPU")
    with open(f"/sys/bus/pci/devices/{devs[0]}/numa_node") as f:
        return devs[0].upper(), int(f.read())   # CUDA spells the bus id in capitals


def test_fake_runtime_pool_follows_the_gpus_numa_node(fake_cudart, tmp_path):
    bus, node = _a_pci_device()
    out = _fake(fake_cudart, "numa", tmp_path, FAKE_CUDART_PCI_BUS_ID=bus)
    assert out["node"] == node and out["pinned"] is True and out["error"] is None
    assert out["new_policies"] and set(out["new_policies"]) == {f"prefer:{node}" if node >= 0 else "default"}


def test_staging_numa_node_is_placed_with_mbind(fake_cudart, tmp_path):
    # Forced, as for a process bound to one socket: node 0 exists everywhere.
    out = _fake(fake_cudart, "numa", tmp_path, FLASHWRITE_STAGING_NUMA_NODE=0)
    assert out == {"node": 0, "error": None, "pinned": True, "new_policies": ["prefer:0"]}


def test_bad_staging_numa_node_is_a_clear_error():
    r = subprocess.run([sys.executable, "-c", "from flashwrite import _core; _core.Engine(8 << 20)"],
                       env={**os.environ, "FLASHWRITE_STAGING_NUMA_NODE": "socket0"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "FLASHWRITE_STAGING_NUMA_NODE=socket0: expected a NUMA node number" in r.stderr


def test_fake_runtime_pinning_does_not_hold_the_pool_lock(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "pin_outside_lock", tmp_path, FAKE_CUDART_REGISTER_DELAY_MS=1500)
    assert out["reserve_s"] >= 1.5, out          # the pin hook did run...
    assert out["query_s"] < 0.5, out             # ...while the pool answered at once,
    assert out["during"] == [0, 0], out          # with its slots not yet there and nothing trimmed,
    assert out["after"] == 32 << 20 and out["pinned"] is True and out["trim_after"] == 32 << 20, out


def test_fake_runtime_h2d_load_places_and_keeps_the_rest_on_the_host(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "load", tmp_path, FAKE_CUDART_COPY_DELAY_US=200)
    assert out == {"mismatches": 0, "placed_ok": True, "host_ok": True, "headers_ok": True}


def test_fake_runtime_h2d_and_host_placements_in_one_load(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "load_mixed", tmp_path, FAKE_CUDART_COPY_DELAY_US=200)
    assert out == {"mismatches": 0, "buffers": [False, False], "placed_ok": True, "headers_ok": True}


def test_fake_runtime_h2d_never_copies_a_damaged_chunk(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "load_damaged", tmp_path)
    assert out == {"mismatches": 1, "damaged_chunk_untouched": True, "rest_placed": True}


def test_fake_runtime_h2d_copy_error_is_raised(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "load_failing", tmp_path, FAKE_CUDART_FAIL_COPY=2)
    assert out["error"] and "cudaMemcpyAsync host-to-device" in out["error"]


# ------------------------------------------- issue 27: the GPU path made right for real hardware


def test_fake_runtime_pinning_time_is_in_the_save_stats(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "save", tmp_path)
    first, second = out["pin_s"]
    assert first > 0  # the first GPU save pinned the pool and says how long it took
    assert second == 0  # the next one found it pinned


def test_fake_runtime_refuses_a_save_or_load_inside_a_graph_capture(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "capture_refused", tmp_path)
    for what in ("save", "load"):
        assert "cuda:0 is being captured into a CUDA graph" in out["errors"][what]
        assert "outside torch.cuda.graph()" in out["errors"][what]
    assert out["files"] == [] and out["copies"] == 0 and out["captured"] == 0
    assert out["end_capture"] == 0  # asking did not invalidate the user's capture


def test_fake_runtime_save_beside_a_global_capture_keeps_it_valid(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "capture_concurrent", tmp_path, FAKE_CUDART_COPY_DELAY_US=200)
    assert out["begin"] == 0 and out["error"] is None and out["same_files"] is True
    assert out["end_capture"] == 0  # 901 (cudaErrorStreamCaptureInvalidated) if our threads synced in global mode


def test_fake_runtime_small_tensors_share_copies_and_round_trip(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "small_tensors", tmp_path)
    n = out["tensors"]
    assert out["same_files"] is True and out["load_ok"] is True and out["mismatches"] == 0
    assert out["scattered_copies"] >= n  # one allocation each: one copy each
    # Laid out as in the stripes (cuda.gather): a copy per chunk run, far fewer than tensors.
    assert out["save_copies"] < n / 10
    assert out["load_copies"] < n / 10


def test_fake_runtime_load_bounce_pools_do_not_pile_up(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "bounce_pools", tmp_path)
    # One pinned pool kept at a time (before: one per chunk size for the process's life).
    assert out["registered"] == [1, 1, 1]
    assert out["bounce_bytes"][0] < out["bounce_bytes"][1] < out["bounce_bytes"][2]
    assert out["released"] == out["bounce_bytes"][2] and out["registered_after_release"] == 0


def test_fake_runtime_stale_host_registration_is_not_taken_for_pinning(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "stale_registration", tmp_path)
    assert out["same_base"] == "" and out["registered"] == 1  # dropped and registered again: one registration
    assert "cudaErrorHostMemoryAlreadyRegistered" in out["overlap"] and "overlapping" in out["overlap"]


def test_fake_runtime_backend_info_does_not_initialise_cuda_so_forked_children_can(fake_cudart, tmp_path):
    out = _fake(fake_cudart, "fork_after_info", tmp_path)
    info = out["info"]
    assert info["library"] == fake_cudart and info["initialized"] is False
    assert info["available"] is None and info["device_count"] is None and "not initialised" in info["reason"]
    assert out["child_after_info"] == 0  # the child initialised CUDA itself and saved from the GPU
    assert out["initialized_info"]["initialized"] is True and out["initialized_info"]["device_count"] == 1
    assert out["child_after_init"] != 0  # as with real CUDA: initialised before fork() is unusable after


def test_fake_runtime_search_passes_over_a_runtime_whose_device_count_fails(fake_cudart, tmp_path):
    import shutil
    new, old = tmp_path / "cuda13", tmp_path / "cuda12"
    new.mkdir()
    old.mkdir()
    shutil.copy(fake_cudart, new / "libcudart.so.13")  # too new for the "driver": its device count fails
    shutil.copy(fake_cudart, old / "libcudart.so.12")
    code = "import json; from flashwrite import _core; print(json.dumps(_core.cuda_info()))"
    out = _run_python(code, {"LD_LIBRARY_PATH": f"{new}:{old}", "FAKE_CUDART_NO_DRIVER": str(new)})
    assert out["available"] is True and out["library"] == "libcudart.so.12" and out["via"] == "soname"
    assert out["skipped"].startswith("libcudart.so.13: cudaGetDeviceCount failed: CUDA driver version is insufficient")


def test_gather_lays_small_tensors_out_as_their_stripe_and_keeps_their_order():
    # cuda.gather is device-agnostic; on CPU tensors (marked as on "device 0") it shows the
    # layout the engine then copies with one cudaMemcpyAsync per chunk.
    import ctypes
    from flashwrite.system import cuda as fw_cuda
    g = torch.Generator().manual_seed(3)
    small = [torch.randn(16 * (1 + i % 5), generator=g) for i in range(12)]
    big = torch.randn(40_000, generator=g)  # 160 KB: over the gather limit below
    items, off = [], 4096
    for t in small[:6]:
        items.append((t, t.numel() * 4, 0, off, 0))
        off += t.numel() * 4
    items.append((big, big.numel() * 4, 0, off, 0))
    off += big.numel() * 4
    for t in small[6:9]:
        items.append((t, t.numel() * 4, 0, off, 0))
        off += t.numel() * 4
    items.append((small[9], small[9].numel() * 4, 0, off, 1))  # another device: a run of its own
    items += [(small[10], small[10].numel() * 4, 1, 4096, 0), (small[11], small[11].numel() * 4, 1, 4096 + 64, 0)]
    shuffled = items[::-1]  # the plan's order, whatever it is, is kept
    addresses, buffers = fw_cuda.gather(shuffled, 64 << 10, 64 << 20)
    assert len(addresses) == len(shuffled)
    for (t, n, *_), a in zip(shuffled, addresses):
        assert ctypes.string_at(a, n) == t.numpy().tobytes()
    by_item = {id(it[0]): a for it, a in zip(shuffled, addresses)}
    assert by_item[id(big)] == big.data_ptr()  # large: copied from where it is
    first = [by_item[id(t)] for t in small[:6]]
    assert all(b - a == t.numel() * 4 for a, b, t in zip(first, first[1:], small))  # one run, stripe order
    assert by_item[id(small[10])] + 64 == by_item[id(small[11])]  # the other stripe's run
    assert by_item[id(small[9])] == small[9].data_ptr()  # alone on its device: not gathered
    assert len(buffers) == 3  # small[:6], small[6:9], stripe 1's pair
    # The load side: placements put each run into one buffer, finish() copies it out.
    dst = [torch.zeros_like(t) for t in small[:6]]
    sc = fw_cuda.Scatter([(d, d.numel() * 4, 0, 4096 + sum(x.numel() * 4 for x in small[:i]), 0)
                          for i, d in enumerate(dst)], 64 << 10, 64 << 20)
    assert len(sc.placements) == 1 and sc.placements[0][1:4] == (4096, sum(t.numel() * 4 for t in small[:6]), 0)
    payload = b"".join(t.numpy().tobytes() for t in small[:6])
    ctypes.memmove(sc.placements[0][4], payload, len(payload))
    sc.finish()
    assert all(torch.equal(d, t) for d, t in zip(dst, small[:6]))
