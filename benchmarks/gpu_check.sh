#!/usr/bin/env bash
# One prepared check of the flce CUDA backend on a single GPU machine (written for an H200 with
# torch 2.14 CUDA 13, nvcc 13.0, ncu and compute-sanitizer, no internet). Budget: 9 minutes.
#
#   1. build for this GPU (TORCH_CUDA_ARCH_LIST=9.0a), ptxas report -> scripts/check_ptxas.py
#   2. the CUDA tests (tests/test_cuda.py: both paths), then the rest of the suite
#   3. the GPU against the host emulation on the same inputs (benchmarks/gpu_vs_emulation.py)
#      and a training step under torch.cuda.set_sync_debug_mode("error") (no host sync)
#   4. compute-sanitizer memcheck and racecheck on small shapes (benchmarks/gpu_sanitize.py)
#   5. forward+backward benchmark of the single pass and the recompute path vs 3 and 4 cuBLAS
#      GEMMs, quack / Liger where installed, eager and torch's linear_cross_entropy, plus copy
#      and matmul ceilings (benchmarks/gpu_bench.py)
#
# Logs go to $OUT (default benchmarks/results/); a summary table is printed last. Every step
# runs under a timeout and a failing step does not stop the later ones; exit status 1 if any
# step failed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/results}"
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
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
if step build 180 "$PY" setup.py build_ext --inplace; then
  step ptxas 15 "$PY" scripts/check_ptxas.py "$OUT/build.log"
  step test_cuda 100 "$PY" -m pytest -q -rfEs -k "not cuda-host" tests/test_cuda.py \
    tests/test_check_ptxas.py
  step no_sync 30 "$PY" -c "
import torch, flce
x = torch.randn(4096, 1024, device='cuda', dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(32768, 1024, device='cuda', dtype=torch.bfloat16, requires_grad=True)
t = torch.randint(0, 32768, (4096,), device='cuda')
flce.linear_cross_entropy(x, w, t).backward()   # warm-up (allocations, handles)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode('error')
for _ in range(3):
    flce.linear_cross_entropy(x, w, t).backward()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
print('training steps without a host sync: ok')"
  # the speed numbers first: the rest of the budget goes to the slower checks
  step bench 200 "$PY" benchmarks/gpu_bench.py --out "$OUT"
  step vs_emulation 90 "$PY" benchmarks/gpu_vs_emulation.py
  step memcheck 45 "$SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
    "$PY" benchmarks/gpu_sanitize.py
  step racecheck 45 "$SANITIZER" --tool racecheck --error-exitcode 1 \
    "$PY" benchmarks/gpu_sanitize.py
  step test_suite 60 "$PY" -m pytest -q -rfE tests -k "not cuda-host" -x \
    --ignore=tests/test_cuda.py --ignore=tests/test_check_ptxas.py
else
  echo "build failed: see $OUT/build.log"
fi

echo
echo "== summary ($((SECONDS - T0))s, logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
[[ -f "$OUT/table.txt" ]] && cat "$OUT/table.txt"
exit $FAILED
