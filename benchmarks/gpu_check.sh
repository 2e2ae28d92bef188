#!/usr/bin/env bash
# One prepared check of the flce CUDA backend on a single GPU machine (written for an H200 with
# torch 2.11 CUDA 13, nvcc 13.0, ncu and compute-sanitizer, no internet). Budget: < 8 minutes.
#
#   1. build for this GPU (TORCH_CUDA_ARCH_LIST=9.0a), ptxas report -> scripts/check_ptxas.py
#   2. the CUDA tests (tests/test_cuda.py), then the rest of the suite
#   3. compute-sanitizer memcheck and racecheck on small shapes (benchmarks/gpu_sanitize.py)
#   4. forward+backward benchmark vs eager / torch.compile / torch's linear_cross_entropy and
#      cuBLAS speed-of-light, plus copy and matmul ceilings (benchmarks/gpu_bench.py)
#
# Logs go to $OUT (default benchmarks/results/); a summary table is printed last. Every step
# runs under a timeout and a failing step does not stop the later ones; exit status 1 if any
# step failed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/results}"
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-470}
PY=${PYTHON:-python}
SANITIZER=${SANITIZER:-compute-sanitizer}
command -v "$SANITIZER" >/dev/null 2>&1 || SANITIZER=/usr/local/cuda/bin/compute-sanitizer
T0=$SECONDS
SUMMARY=()
FAILED=0

# step NAME TIMEOUT_S CMD...: run CMD with its output in $OUT/NAME.log; the timeout is cut to
# what is left of the budget (at least 10 s).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - T0)))
  if ((left < 10)); then
    SUMMARY+=("$(printf '%-14s SKIPPED (budget spent)' "$name")")
    FAILED=1
    return 1
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s)"
  local t=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  tail -n 4 "$OUT/$name.log"
  SUMMARY+=("$(printf '%-14s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - t))")")
  ((rc != 0)) && FAILED=1
  return $rc
}

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  >"$OUT/env.log" 2>&1 || true

export FLCE_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0a" FLCE_PTXAS_VERBOSE=1
# The in-place build puts flce._C into python/flce: import flce from there.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if step build 240 "$PY" setup.py build_ext --inplace; then
  step ptxas 20 "$PY" scripts/check_ptxas.py "$OUT/build.log"
  step test_cuda 120 "$PY" -m pytest -q -rfEs tests/test_cuda.py tests/test_check_ptxas.py
  step test_suite 90 "$PY" -m pytest -q -rfE tests --ignore=tests/test_cuda.py --ignore=tests/test_check_ptxas.py
  step memcheck 60 "$SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
    "$PY" benchmarks/gpu_sanitize.py
  step racecheck 60 "$SANITIZER" --tool racecheck --error-exitcode 1 \
    "$PY" benchmarks/gpu_sanitize.py
  step bench 260 "$PY" benchmarks/gpu_bench.py --out "$OUT"
else
  echo "build failed: see $OUT/build.log"
fi

echo
echo "== summary ($((SECONDS - T0))s, logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
[[ -f "$OUT/table.txt" ]] && cat "$OUT/table.txt"
exit $FAILED
