"""Which already-loaded CUDA runtime flashwrite binds (issue 37 item 6): PyTorch's, found
through libtorch_cuda's own handle, not the first mapping named libcudart.so, which may
be another framework's (CuPy, JAX) loaded before torch. Stand-ins: two copies of
tests/fake_cudart.cpp under libcudart names and a libtorch_cuda.so linked to one of them."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cxx(*args):
    subprocess.run([*args], check=True, capture_output=True, timeout=300)


@pytest.mark.slow  # README suite budget (issue 36): the slow job in CI runs it
def test_torch_runtime_is_found_through_libtorch_cuda(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler to build the stand-in CUDA runtimes")
    torch_dir, other_dir = tmp_path / "torch", tmp_path / "other"
    torch_dir.mkdir()
    other_dir.mkdir()
    src = os.path.join(_TESTS, "fake_cudart.cpp")
    _cxx(cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o",
         str(torch_dir / "libcudart.so.12"), src, "-lpthread")
    _cxx(cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcudart.so.11.0", "-o",
         str(other_dir / "libcudart.so.11.0"), src, "-lpthread")
    (tmp_path / "tc.cpp").write_text('extern "C" int cudaGetDeviceCount(int*);\n'
                                     'extern "C" int torch_cuda_probe() { int n = 0; cudaGetDeviceCount(&n); return n; }\n')
    _cxx(cxx, "-shared", "-fPIC", "-o", str(torch_dir / "libtorch_cuda.so"), str(tmp_path / "tc.cpp"),
         f"-L{torch_dir}", "-l:libcudart.so.12", "-Wl,-rpath,$ORIGIN")
    code = textwrap.dedent(f"""
        import ctypes, json
        ctypes.CDLL({str(other_dir / "libcudart.so.11.0")!r})  # another framework's runtime, first
        ctypes.CDLL({str(torch_dir / "libtorch_cuda.so")!r})   # then torch's, through libtorch_cuda
        import flashwrite as fw
        print(json.dumps(fw.backend_info(initialize_cuda=True)["cuda"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "FLASHWRITE_CUDA_RUNTIME" and not k.startswith("FAKE_CUDART")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["library"] == str(torch_dir / "libcudart.so.12") and info["via"] == "already loaded", info
