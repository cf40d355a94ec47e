# The release wheel's toolchain: zig's clang, targeting glibc 2.28 (RHEL/Rocky 8) with
# its own libc, kernel headers and a static libc++, so that _core needs nothing newer
# than manylinux_2_28 (issue 45). tools/build_wheels.sh installs zig from PyPI (the
# ziglang package) and passes this file; the gcc build stays the development build.
#   FW_ZIG: the zig binary (default: zig on PATH)
#   FW_ZIG_TARGET: the zig target triple (default: x86_64-linux-gnu.2.28)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR x86_64)
set(_fw_zig "${CMAKE_CURRENT_LIST_DIR}")
set(CMAKE_C_COMPILER "${_fw_zig}/zig-cc")
set(CMAKE_CXX_COMPILER "${_fw_zig}/zig-c++")
set(CMAKE_AR "${_fw_zig}/zig-ar" CACHE FILEPATH "" FORCE)
set(CMAKE_RANLIB "${_fw_zig}/zig-ranlib" CACHE FILEPATH "" FORCE)
# Never the build machine's headers or libraries: liburing is built from
# third_party/liburing with zig's kernel headers, xxHash is third_party's.
set(FLASHWRITE_LIBURING "VENDORED" CACHE STRING "" FORCE)
set(XXHASH_INCLUDE_DIR "${_fw_zig}/../../third_party/xxhash" CACHE PATH "" FORCE)
