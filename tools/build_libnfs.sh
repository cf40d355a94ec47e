#!/usr/bin/env bash
# Build libnfs 5.0.2 as Debian 13 (trixie) ships it (the libnfs14 package), from Debian's own
# source package, into PREFIX; print the path of the shared library last.
#
#   tools/build_libnfs.sh PREFIX     then: FLASHWRITE_LIBNFS=<printed path> python3 -m pytest -q tests -m nfs
#
# Debian's binary needs glibc 2.38, so it cannot be loaded on older systems as it is; the
# source builds anywhere (CMake; -DCMAKE_POLICY_VERSION_MINIMUM=3.5 for CMake 4). The .dsc and
# tarballs come from deb.debian.org, found in trixie's Sources index and checked against the
# SHA-256 sums it lists, with Debian's patches applied. Needs curl, xz, patch, cmake
# and a C compiler. A PREFIX that already holds the library is reused.
set -euo pipefail
PREFIX="$(realpath -m "${1:?usage: tools/build_libnfs.sh PREFIX}")"
VERSION=5.0.2  # upstream version wanted (Debian's revision, e.g. -1+deb13u1, is whatever trixie has now)
MIRROR="${DEBIAN_MIRROR:-https://deb.debian.org/debian}"
lib="$(find "$PREFIX" -name "libnfs.so.*" -type f 2>/dev/null | sort | tail -n1 || true)"
if [ -n "$lib" ]; then echo "$lib"; exit 0; fi
work="$(mktemp -d /tmp/flashwrite-libnfs.XXXXXX)"
trap 'rm -rf "$work"' EXIT
cd "$work"
curl -fsSL --retry 3 "$MIRROR/dists/trixie/main/source/Sources.xz" -o Sources.xz
# The libnfs stanza: its Version, Directory and the SHA-256 lines of its files.
xz -dc Sources.xz >Sources
awk '/^Package: libnfs$/{p=1} p&&/^$/{exit} p' Sources >stanza
debver="$(awk '/^Version:/{print $2}' stanza)"
case "$debver" in "$VERSION"-*) ;; *) echo "trixie's libnfs is $debver, not $VERSION-*" >&2; exit 1;; esac
dir="$(awk '/^Directory:/{print $2}' stanza)"
awk '/^Checksums-Sha256:/{s=1; next} s&&/^ /{print $1, $3; next} s{exit}' stanza >sums
[ -s sums ] || { echo "no SHA-256 sums for libnfs in trixie's Sources" >&2; exit 1; }
# The two tarballs (the .dsc only lists them, and is not served through every proxy: its
# sums are the index's too); unpacked and patched the way dpkg-source does a "3.0 (quilt)" package.
grep -v '\.dsc$' sums >tarballs
while read -r sum name; do
  curl -fsSL --retry 3 "$MIRROR/$dir/$name" -o "$name"
  echo "$sum  $name" | sha256sum -c --quiet -
done <tarballs
mkdir src
tar -xzf ./*.orig.tar.gz -C src --strip-components=1
tar -xJf ./*.debian.tar.xz -C src
if [ -f src/debian/patches/series ]; then
  grep -v '^\s*#' src/debian/patches/series | while read -r p _; do
    [ -n "$p" ] && patch -d src -p1 -s <"src/debian/patches/$p"
  done
fi
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$PREFIX" \
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DBUILD_SHARED_LIBS=ON -DENABLE_TESTS=OFF -DENABLE_EXAMPLES=OFF \
  -DENABLE_UTILS=OFF -DENABLE_DOCUMENTATION=OFF >build.log 2>&1 || { cat build.log >&2; exit 1; }
cmake --build build -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >>build.log 2>&1 || { tail -50 build.log >&2; exit 1; }
cmake --install build >>build.log 2>&1 || { tail -50 build.log >&2; exit 1; }
lib="$(find "$PREFIX" -name "libnfs.so.*" -type f | sort | tail -n1)"
[ -n "$lib" ] || { echo "no libnfs.so.* under $PREFIX after the build" >&2; exit 1; }
echo "libnfs $debver built from Debian's source package" >&2
echo "$lib"
