"""What the build carries (issue 36 item 3, issue 37 item 2): the nfs:// client is
always built (libnfs's headers are vendored, the library is loaded at run time), and
backend_info() / `flashwrite info` say whether nfs:// is usable here and why not; the
io_uring backend needs no system liburing (the vendored copy is built when none is
found), and backend_info() names the liburing the build links."""

import ctypes.util
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import flashwrite
from flashwrite import _core

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/house/ -> the repository
MISSING = "/nonexistent/libnfs-flashwrite-test.so.99"


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_the_nfs_client_is_built_in():
    nfs = flashwrite.backend_info()["nfs"]
    assert nfs["compiled"] is True, nfs
    assert nfs["headers"] == "libnfs 4.0.0", nfs  # third_party/libnfs, what the client is written against
    assert hasattr(_core, "NfsClient")


@pytest.mark.skipif(ctypes.util.find_library("nfs") is None, reason="libnfs is not installed here")
def test_nfs_is_usable_where_libnfs_is_installed():
    nfs = flashwrite.backend_info()["nfs"]
    assert nfs["usable"] is True and nfs["reason"] is None, nfs
    # FLASHWRITE_LIBNFS names the library (CI runs the nfs-marked tests once against libnfs
    # 5.0.2 built by tools/build_libnfs.sh): that one is loaded, or else the system's.
    named = os.environ.get("FLASHWRITE_LIBNFS")
    if named:
        assert nfs["library"] == named, nfs
    else:
        assert re.fullmatch(r"libnfs\.so(\.\d+)?", nfs["library"]), nfs


def test_backend_info_says_why_nfs_is_unusable_without_libnfs():
    # FLASHWRITE_LIBNFS names the library to load: a name that is not there stands in
    # for a machine without libnfs.
    r = _child("""
        import json, flashwrite
        print(json.dumps(flashwrite.backend_info()["nfs"]))
    """, FLASHWRITE_LIBNFS=MISSING)
    assert r.returncode == 0, r.stderr
    nfs = json.loads(r.stdout)
    assert nfs["compiled"] is True and nfs["usable"] is False and nfs["library"] is None, nfs
    # The loader's own words (which file, why), and what to do about it.
    assert MISSING in nfs["reason"] and "No such file" in nfs["reason"], nfs
    assert "install" in nfs["reason"], nfs


def test_a_libnfs_without_the_rpc_calls_says_which_libnfs_is_needed(tmp_path):
    """libnfs 6 and 7 renamed the RPC calls the client uses: a library that loads but lacks
    them (here one built with none of them) is refused with the versions that work."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in library")
    src, lib = tmp_path / "other.c", tmp_path / "libnfs.so.16"
    src.write_text("int nfs_some_other_call(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    r = _child("""
        import json, torch, flashwrite
        print(json.dumps(flashwrite.backend_info()["nfs"]))
        try:
            flashwrite.save({"w": torch.zeros(4)}, "nfs://127.0.0.1/export/ck")
        except flashwrite.UnsupportedTargetError as e:
            print("REFUSED", e)
    """, FLASHWRITE_LIBNFS=str(lib))
    assert r.returncode == 0, r.stderr
    nfs = json.loads(r.stdout.splitlines()[0])
    assert nfs["usable"] is False and "libnfs 4 or 5 is needed" in nfs["reason"] and str(lib) in nfs["reason"], nfs
    assert "REFUSED" in r.stdout and "libnfs 4 or 5 is needed" in r.stdout, r.stdout


def test_flashwrite_info_prints_the_nfs_and_liburing_lines():
    r = subprocess.run([sys.executable, "-m", "flashwrite", "info"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FLASHWRITE_LIBNFS": MISSING})
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "usable=False" in lines["nfs"] and MISSING in lines["nfs"], r.stdout
    if _core.io_uring_compiled():
        assert re.search(r"source=(system|vendored), version=\d+\.\d+", lines["liburing"]), r.stdout


def test_a_save_to_nfs_without_libnfs_says_why():
    r = _child("""
        import torch, flashwrite
        try:
            flashwrite.save({"w": torch.zeros(4)}, "nfs://127.0.0.1/export/ck")
        except flashwrite.UnsupportedTargetError as e:
            print("REFUSED", e)
    """, FLASHWRITE_LIBNFS=MISSING)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("REFUSED") and MISSING in r.stdout, r.stdout


def test_backend_info_names_the_liburing_the_build_links():
    info = flashwrite.backend_info()
    if not info["io_uring_compiled"]:
        assert info["liburing"] is None
        pytest.skip("built without io_uring (FLASHWRITE_IO_URING=OFF)")
    lib = info["liburing"]
    assert lib["source"] in ("system", "vendored"), lib
    assert re.fullmatch(r"\d+\.\d+", lib["version"]), lib
    if lib["source"] == "vendored":
        assert lib["version"] == "2.15", lib  # third_party/liburing


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_the_vendored_liburing_builds_and_does_io(tmp_path):
    """third_party/liburing built as the extension's build does (its CMakeLists.txt),
    linked into a small program that writes and reads back a file through a ring."""
    (tmp_path / "CMakeLists.txt").write_text(textwrap.dedent(f"""
        cmake_minimum_required(VERSION 3.18)
        project(probe LANGUAGES C)
        add_subdirectory("{ROOT / 'third_party' / 'liburing'}" liburing)
        add_executable(probe probe.c)
        target_link_libraries(probe PRIVATE fw_liburing)
    """))
    (tmp_path / "probe.c").write_text(textwrap.dedent("""
        #include <fcntl.h>
        #include <stdio.h>
        #include <string.h>
        #include <unistd.h>
        #include <liburing.h>
        static int one(struct io_uring* ring) {
          struct io_uring_cqe* cqe;
          io_uring_submit(ring);
          if (io_uring_wait_cqe(ring, &cqe) < 0) return -1;
          int res = cqe->res;
          io_uring_cqe_seen(ring, cqe);
          return res;
        }
        int main(int argc, char** argv) {
          struct io_uring ring;
          int rc = io_uring_queue_init(4, &ring, 0);
          if (rc < 0) { printf("SETUP %d\\n", -rc); return 0; }
          int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0644);
          char out[] = "flashwrite through a vendored ring", in[64] = {0};
          io_uring_prep_write(io_uring_get_sqe(&ring), fd, out, sizeof out, 0);
          int w = one(&ring);
          io_uring_prep_read(io_uring_get_sqe(&ring), fd, in, sizeof in, 0);
          int r = one(&ring);
          printf("VERSION %d.%d WROTE %d READ %d SAME %d\\n", io_uring_major_version(), io_uring_minor_version(),
                 w, r, r == (int)sizeof out && memcmp(in, out, sizeof out) == 0);
          io_uring_queue_exit(&ring);
          return 0;
        }
    """))
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(build)], check=True, capture_output=True, timeout=300)
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, capture_output=True, timeout=600)
    out = subprocess.run([str(build / "probe"), str(tmp_path / "f")], capture_output=True, text=True, timeout=60).stdout
    if out.startswith("SETUP"):
        pytest.skip(f"no io_uring here (errno {out.split()[1]}); the library built and linked")
    assert out.split() == ["VERSION", "2.15", "WROTE", "35", "READ", "35", "SAME", "1"], out


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 XXH3 is x86-64's")
def test_checksums_run_the_avx2_xxh3_where_the_cpu_has_it():
    # The release wheel is built with zig, whose __builtin_cpu_supports said no on every CPU:
    # its checksums ran the scalar XXH3 (issue 45 item 1). The kernel's flags say what the CPU has.
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    assert _core.checksum_path() == ("avx2" if "avx2" in flags else "scalar")  # the kernel lists avx2 only where usable
