#!/usr/bin/env bash
# One command for a short slot on the lent GPU machine (no network, no registry):
# print what the machine has, install flashwrite from the wheel carried in
# build/gpu-wheel/ (or build it from the tree if the wheel does not fit this Python),
# run benchmarks/gpu_check.py within what is left of 5 minutes, and leave
# gpu_check.json, gpu_check.md and device_run.log in $OUT. Never hangs: every step has a
# timeout, and gpu_check.py has its own watchdog. Exit status: gpu_check's (0 OK,
# 1 a check failed, 3 its budget ran out), 2 when no GPU is visible (the CPU phases
# still run and their JSON is written).
#
#   bash benchmarks/gpu_device_run.sh            # see benchmarks/README.md for the run call
#   GPU_CHECK_ARGS="--gib 2" bash benchmarks/gpu_device_run.sh
set -u
T0=$(date +%s)
TOTAL=${GPU_RUN_TOTAL_S:-295}          # the whole command, start-up to table
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/build/gpu-device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_run.log") 2>&1
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }

echo "== machine ($(date -u +%FT%TZ))"
timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pci.bus_id --format=csv \
  || echo "nvidia-smi: not available (rc $?)"
echo "cores $(nproc); $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
df -h "$REPO" | tail -1
"$PY" --version
timeout 60 "$PY" - <<'PYEOF' || echo "python/torch probe failed (rc $?)"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "is_available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
for m in ("safetensors", "pybind11", "scikit_build_core", "pytest"):
    try:
        print(m, __import__(m).__version__)
    except Exception as e:
        print(m, "missing:", type(e).__name__)
PYEOF
command -v cmake >/dev/null && cmake --version | head -1 || echo "cmake: missing"

echo "== install"
SITE=$REPO/build/gpu-check/site
BUILD_ARGS=--no-build
WHEEL=$(ls "$REPO"/build/gpu-wheel/flashwrite-*.whl 2>/dev/null | head -1)
rm -rf "$SITE"
SITE_OK=0
if [ -n "${GPU_RUN_NO_BUILD:-}" ]; then
  echo "GPU_RUN_NO_BUILD set: using the flashwrite already importable"
elif [ -n "$WHEEL" ] && timeout 60 "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$WHEEL"; then
  echo "installed the carried wheel $(basename "$WHEEL") into $SITE"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  SITE_OK=1
else
  echo "no usable carried wheel (${WHEEL:-none}): gpu_check.py builds from the tree (needs scikit-build-core, pybind11, cmake)"
  BUILD_ARGS=
fi
if [ "$SITE_OK" = 1 ] && ! timeout 60 "$PY" -c "import flashwrite, sys; print('flashwrite', flashwrite.__version__, flashwrite.__file__)"; then
  echo "the carried wheel does not import here: building from the tree"
  BUILD_ARGS=
fi

BUDGET=$(( $(left) - 5 ))
echo "== gpu_check.py (budget ${BUDGET} s)"
if [ "$BUDGET" -lt 30 ]; then
  echo "gpu_device_run: only ${BUDGET} s left, not starting gpu_check.py" >&2
  echo "{\"error\": \"no time left for gpu_check.py (${BUDGET} s)\"}" > "$OUT/gpu_check.json"
  exit 3
fi
# shellcheck disable=SC2086  # BUILD_ARGS and GPU_CHECK_ARGS are word lists
timeout -k 5 $(( BUDGET + 3 )) "$PY" benchmarks/gpu_check.py $BUILD_ARGS --budget "$BUDGET" \
  --dir "$REPO/build/gpu-check/ckpt" --json "$OUT/gpu_check.json" --md "$OUT/gpu_check.md" ${GPU_CHECK_ARGS:-}
rc=$?
rm -rf "$REPO/build/gpu-check/ckpt"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_device_run: gpu_check.py killed by timeout after $(( $(date +%s) - T0 )) s; its JSON so far is in $OUT" >&2
  exit 3
fi
if ! timeout 30 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_device_run: NO GPU visible to PyTorch here: the GPU phases were skipped (see $OUT/gpu_check.json)" >&2
  exit 2
fi
echo "gpu_device_run: gpu_check.py rc=$rc in $(( $(date +%s) - T0 )) s; results in $OUT"
exit "$rc"
