"""The stand-in CUDA runtime (fake_cudart.cpp), built once per session for the tests that
drive the native engine's GPU path on a machine without a GPU."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def fake_cudart(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler to build the stand-in CUDA runtime")
    out = str(tmp_path_factory.mktemp("fakecudart") / "libfakecudart.so")
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "fake_cudart.cpp"),
                    "-lpthread"], check=True, capture_output=True, timeout=300)
    return out
