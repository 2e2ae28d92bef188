#!/usr/bin/env bash
# One prepared check of the flce CUDA backend on a single GPU machine (written for the lent H200:
# its image's python3 with torch 2.11 CUDA 13, nvcc 13.0, compute-sanitizer, no internet).
# Budget: BUDGET_S (default 540 s). In order of value, so that a cut-off run still says most:
#
#   1. build for this GPU (TORCH_CUDA_ARCH_LIST=9.0a), ptxas report -> scripts/check_ptxas.py
#   2. the CUDA tests (tests/test_cuda.py: both paths), the fused logits path (its CUTLASS GEMM
#      against its stand-in, tests/test_fused_logits.py) and a training step under
#      torch.cuda.set_sync_debug_mode("error") (no host sync)
#   3. forward+backward benchmark of the single pass and the recompute path vs 3 and 4 cuBLAS
#      GEMMs, eager, compiled, Liger / CCE / quack / torch's linear_cross_entropy where installed,
#      plus copy and matmul ceilings (benchmarks/gpu_bench.py); cross-entropy on given logits
#      (benchmarks/bench_ce.py); both append gpu.jsonl records to $OUT/gpu_records.jsonl, which
#      the session copies into benchmarks/results/gpu.jsonl
#   4. the device-parametrized suite on "cuda" (accuracy at margins 0-200 and N = 65536, options,
#      RL outputs, single pass)
#   5. the GPU against the host emulation on the same inputs (benchmarks/gpu_vs_emulation.py)
#   6. compute-sanitizer memcheck and racecheck on small shapes (benchmarks/gpu_sanitize.py;
#      the fused path's memcheck: benchmarks/gpu_fused_check.py --small)
#
# Peers' wheels (pure Python + Triton) travel in .whl/ (ignored by git: name it in the device
# tool's carry) and are installed into /tmp/site when present; so does the nvidia-cutlass wheel,
# whose headers the fused logits GEMM needs (the device has no registry):
#   pip download --no-deps -d .whl -r requirements-cutlass.txt
# Without it the build leaves the GEMM out and benchmarks/gpu_fused_check.py fails. Logs are written to a scratch folder and packed after every step into
# $OUT/gpu_logs.tgz (the device tool returns at most 8 files); $OUT/table.txt and
# $OUT/summary.txt beside it. Every step runs under a timeout and a failing step does not stop
# the later ones; exit status 1 if any step failed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/results}"
LOGS=$(mktemp -d)
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-$(command -v python3 || command -v python)}
SANITIZER=${SANITIZER:-compute-sanitizer}
command -v "$SANITIZER" >/dev/null 2>&1 || SANITIZER=/usr/local/cuda/bin/compute-sanitizer
T0=$SECONDS
SUMMARY=()
FAILED=0

# step NAME TIMEOUT_S CMD...: run CMD with its output in $LOGS/NAME.log, print its last lines
# (and its errors if it failed), pack the logs; the timeout is cut to what is left of the budget
# (at least 10 s).
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
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  tail -n 12 "$LOGS/$name.log"
  ((rc != 0)) && grep -m 20 -E "error|Error|FAILED" "$LOGS/$name.log"
  SUMMARY+=("$(printf '%-14s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - t))")")
  ((rc != 0)) && FAILED=1
  pack
  return $rc
}

pack() {
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
  tar -czf "$OUT/gpu_logs.tgz.tmp" -C "$LOGS" . && mv "$OUT/gpu_logs.tgz.tmp" "$OUT/gpu_logs.tgz"
}

{ nvidia-smi; nvidia-smi -q | grep -iE "driver version|product name|clocks|power limit"; } \
  >"$LOGS/nvidia-smi.log" 2>&1 || true
{ "$PY" -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))"; nvcc --version; nproc;
  lscpu | head -20; } >"$LOGS/env.log" 2>&1 || true
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$LOGS/wheels.log" 2>&1 || true
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The image's default CXX (/opt/gcc) put libstdc++'s stream code into the extension, and the
# first C++ error message holding a number crashed the process (2026-12-04): build with the
# system compiler where there is one (tests/test_build_info.py checks the extension).
if [[ "${CXX:-}" == /opt/gcc/* && -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
{ echo "CC=${CC:-} CXX=${CXX:-}"; "${CXX:-g++}" --version; } >>"$LOGS/env.log" 2>&1 || true
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('cutlass_library') is None)"; then
  SUMMARY+=("cutlass        MISSING: no fused logits GEMM in this build (nvidia-cutlass wheel in .whl/)")
  FAILED=1
fi
export FLCE_CUDA=1 TORCH_CUDA_ARCH_LIST="9.0a" FLCE_PTXAS_VERBOSE=1
# The in-place build puts flce._C into python/flce: import flce from there.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if step build 180 "$PY" setup.py build_ext --inplace; then
  step ptxas 15 "$PY" scripts/check_ptxas.py "$LOGS/build.log"
  # A bad target: every check mode in its own process (for a native backtrace of a crash:
  # cuda-gdb -batch -ex run -ex bt --args python3 benchmarks/gpu_target_check.py).
  step target_modes 60 bash -c "for m in 0 sync 1; do FLCE_CHECK_TARGETS=\$m $PY \
    benchmarks/gpu_target_check.py none; echo rc=\$?; done; FLCE_CHECK_TARGETS=1 $PY \
    benchmarks/gpu_target_check.py mean; echo rc=\$?"
  step test_cuda 120 "$PY" -m pytest -q -rfEs -k "not cuda-host" --junitxml="$LOGS/junit_cuda.xml" \
    tests/test_cuda.py \
    tests/test_check_ptxas.py tests/test_build_info.py::test_extension_uses_the_process_libstdcxx
  # The fused logits path (opt-in, issue 25): which epilogue ran, the CUTLASS GEMM against its
  # stand-in on the same inputs, and its tests on "cuda" (against the path's float64 ideal).
  # Benchmarked below only if this passed (a kernel that hangs would take the bench with it).
  export FLCE_BENCH_FUSED=0
  step fused 120 bash -c "$PY benchmarks/gpu_fused_check.py && FLCE_CUDA_FUSED_LOGITS=1 $PY -m \
    pytest -q -rfE -k 'not cuda-host' --junitxml=$LOGS/junit_fused.xml tests/test_fused_logits.py" \
    && FLCE_BENCH_FUSED=1
  step no_sync 30 "$PY" -c "
import os, torch, flce
x = torch.randn(4096, 1024, device='cuda', dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(32768, 1024, device='cuda', dtype=torch.bfloat16, requires_grad=True)
t = torch.randint(0, 32768, (4096,), device='cuda')
# the single pass, and the fused logits path once its check passed
for fused in ('0', '1') if '$FLCE_BENCH_FUSED' == '1' else ('0',):
    os.environ['FLCE_CUDA_FUSED_LOGITS'] = fused
    flce.linear_cross_entropy(x, w, t).backward()   # warm-up (allocations, handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    for _ in range(3):
        flce.linear_cross_entropy(x, w, t).backward()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(f'training steps without a host sync (FLCE_CUDA_FUSED_LOGITS={fused}): ok')"
  step bench 170 "$PY" benchmarks/gpu_bench.py --out "$LOGS" --compile \
    --record "$OUT/gpu_records.jsonl" ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"}
  [[ -f "$LOGS/table.txt" ]] && cp "$LOGS/table.txt" "$OUT/table.txt"
  # The cost of fp32 gradients in float64 (FLCE_CUDA_FP32_GRAD=fp64, issue 27) against the SGEMM
  # path, same run, and its accuracy at N = 65536 (the fp32 tests' shape).
  step fp32_grad 60 "$PY" -c "
import os, time, torch, flce
def step(x, w, t):
    x.grad = w.grad = None
    flce.linear_cross_entropy(x, w, t).backward()
def timed(x, w, t):
    for _ in range(2): step(x, w, t)
    torch.cuda.synchronize(); ts = []
    for _ in range(5):
        a = time.perf_counter(); step(x, w, t); torch.cuda.synchronize(); ts.append(time.perf_counter() - a)
    return 1e3 * sorted(ts)[2]
g = torch.Generator().manual_seed(0)
for n, v, d in ((16384, 32768, 1024), (4096, 128256, 4096)):
    x = (torch.randn(n, d, generator=g) / d ** 0.25).cuda().requires_grad_()
    w = (torch.randn(v, d, generator=g) / d ** 0.25).cuda().requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).cuda()
    out = {}
    for mode in ('fp32', 'fp64'):
        os.environ['FLCE_CUDA_FP32_GRAD'] = mode
        out[mode] = timed(x, w, t)
    print(f'fp32 single pass N={n} V={v} D={d}: SGEMM grads {out[\"fp32\"]:.2f} ms, '
          f'fp64 grads {out[\"fp64\"]:.2f} ms ({out[\"fp64\"] / out[\"fp32\"]:.2f}x)')
    del x, w, t; torch.cuda.empty_cache()
"
  step fp32_accuracy 90 env FLCE_CUDA_FP32_GRAD=fp64 "$PY" -m pytest -q -rfE \
    tests/test_accuracy.py -k "long_sequence and cuda-fp32"
  # Cross-entropy on given logits (flce.cross_entropy) against eager / compiled / Liger and the
  # bytes' floor: the seed's TorchTitan shapes (one rank of TP = 2, and TP = 1).
  step bench_ce 90 "$PY" benchmarks/bench_ce.py --device cuda --shapes 16384x64128,16384x128256 \
    --dtypes bf16 --impls flce,flce_inplace,eager,compiled,native,liger --repeats 10 \
    --record "$OUT/gpu_records.jsonl"
  # Where the single pass's time goes at the anchor shape (kernel table; trace in the logs).
  step profile 45 "$PY" benchmarks/profile_step.py --n 4096 --v 128256 --d 4096 --warmup 2 \
    --steps 3 --peak-tflops 790 --torch-profiler "$LOGS/trace_4096x128256x4096.json" \
    --memory-snapshot "$LOGS/memory_4096x128256x4096.pickle"
  # The same for the fused logits path, once its check passed (its kernels' share of the step).
  [[ $FLCE_BENCH_FUSED == 1 ]] && step profile_fused 45 env FLCE_CUDA_FUSED_LOGITS=1 "$PY" \
    benchmarks/profile_step.py --n 4096 --v 128256 --d 4096 --warmup 2 --steps 3 \
    --peak-tflops 790 --memory-snapshot "$LOGS/memory_fused_4096x128256x4096.pickle"
  # Every flce kernel inside a flce:: NVTX range, none with FLCE_NVTX=0 (ncu: nsys is absent).
  NCU=${NCU:-ncu}
  command -v "$NCU" >/dev/null 2>&1 || NCU=/usr/local/cuda/bin/ncu
  NCU_T="$NCU --clock-control none --csv --metrics gpu__time_duration.sum"
  step nvtx 90 bash -c "$NCU_T $PY benchmarks/nvtx_check.py > $LOGS/ncu_all.csv &&
    $NCU_T --nvtx --nvtx-include 'regex:flce::.*/' $PY benchmarks/nvtx_check.py \
      > $LOGS/ncu_in_ranges.csv &&
    FLCE_NVTX=0 $NCU_T --nvtx --nvtx-include 'regex:flce::.*/' $PY benchmarks/nvtx_check.py \
      > $LOGS/ncu_off.csv &&
    $PY benchmarks/nvtx_check.py --compare $LOGS/ncu_all.csv $LOGS/ncu_in_ranges.csv \
      $LOGS/ncu_off.csv"
  # The row kernels' counters at the anchor shape (DRAM throughput, issue slots, stalls).
  step ncu_rows 60 "$NCU" --clock-control none --kernel-name regex:row_ --launch-skip 8 \
    --launch-count 4 --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis "$PY" benchmarks/profile_step.py --n 4096 --v 128256 \
    --d 4096 --warmup 1 --steps 1
  step vs_emulation 90 "$PY" benchmarks/gpu_vs_emulation.py
  step memcheck 60 "$SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
    "$PY" benchmarks/gpu_sanitize.py
  step racecheck 60 "$SANITIZER" --tool racecheck --error-exitcode 1 \
    "$PY" benchmarks/gpu_sanitize.py
  step fused_memcheck 60 "$SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
    "$PY" benchmarks/gpu_fused_check.py --small
  step accuracy 90 "$PY" benchmarks/gpu_accuracy.py
  # The device-parametrized suites on the GPU (the cpu and cuda-host cases run in CI).
  step test_suite 120 "$PY" -m pytest -q -rfE --durations=10 tests -m "not cuda_host" -k cuda \
    --ignore=tests/test_cuda.py --ignore=tests/test_check_ptxas.py \
    --ignore=tests/test_parallel_cuda.py --junitxml="$LOGS/junit_suite.xml"
  # The tests' record (benchmarks/results/gpu.jsonl's "gpu_tests"), from both pytest steps.
  step record_tests 30 "$PY" benchmarks/gpu_tests_record.py "$OUT/gpu_records.jsonl" \
    "$LOGS/junit_cuda.xml" "$LOGS/junit_suite.xml" "$LOGS/junit_fused.xml"
else
  echo "build failed: see build.log in $OUT/gpu_logs.tgz"
fi

pack
echo
echo "== summary ($((SECONDS - T0))s, logs in $OUT/gpu_logs.tgz)"
printf '%s\n' "${SUMMARY[@]}"
[[ -f "$OUT/table.txt" ]] && cat "$OUT/table.txt"
exit $FAILED
