#!/usr/bin/env bash
# The prepared check of flce's CUDA backend on one lent GPU (H100 / H200: the image's python3
# with torch 2.11 and CUDA 13, nvcc 13.0, ncu, compute-sanitizer, no package index), in two
# phases of at most BUDGET_S (default 300 s) each, so that both and a rerun fit in one 15-minute
# lease. docs/profiling.md ("The GPU check") has the same commands and what to do with the files.
#
#   bash benchmarks/gpu/check.sh headline         # run a phase (on the GPU machine)
#   bash benchmarks/gpu/check.sh rest
#   bash benchmarks/gpu/check.sh headline --plan  # its steps and limits; exit 1 if over budget
#
# From a session, with the device tool (the sha substituted here: the device has no .git):
#   run  command: FLCE_COMMIT=<git rev-parse --short HEAD> bash benchmarks/gpu/check.sh headline
#        carry: [".whl"]                 timeout_s: 330
#   then, from the headline's files: mkdir -p .gpu_build && tar -xzf FILES_AT/flce_build.tgz
#        -C .gpu_build (the build, so that rest need not rebuild on a fresh machine)
#   run  command: FLCE_COMMIT=<sha> bash benchmarks/gpu/check.sh rest
#        carry: [".whl", ".gpu_build"]   timeout_s: 330
#
# .whl/ (ignored by git) holds the wheels the device cannot download, for Python 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl liger-kernel==0.8.5 cut-cross-entropy==25.1.1
# (quack's CuTe DSL wheel, 92 MB, is over what a call can carry.)
#
# Each phase's steps and limits, and the files it leaves in $OUT (default
# benchmarks/results/gpu-RUN, RUN = date-PHASE; at most 8, what the device tool returns), are in
# docs/profiling.md's table. Every step runs in its own process under its own limit (cut to what
# is left of the budget), its output in its own log (packed into gpu_logs.tgz after each step);
# a step that fails or times out is reported in summary.txt and the next one runs. Exit status 1
# if any step failed, timed out or was skipped.
#
# Dry runs (no GPU): PYTHON=a stand-in interpreter and stub nvcc / ncu / compute-sanitizer /
# nvidia-smi on PATH; FLCE_GPU_DRY_RUN=1 makes the record writers stand-ins too;
# GPU_CHECK_MAX_LIMIT=S caps every step's limit at S seconds; WHEELS=DIR replaces .whl/.
set -uo pipefail

PHASE=${1:-}
PLAN_ONLY=0
[[ ${2:-} == --plan ]] && PLAN_ONLY=1
case $PHASE in
  headline | rest) ;;
  *)
    echo "usage: bash benchmarks/gpu/check.sh headline|rest [--plan]" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")/../.." || exit 2
BUDGET_S=${BUDGET_S:-300}

# Each phase's steps, in the order they run, NAME:LIMIT_S. The limits add up to at most the
# budget; rest's exclude its contingent build (REST_CONTINGENT: only where no build of the
# headline is found).
HEADLINE_PLAN=(env:5 wheels:10 build:115 ptxas:5 check:30 bench:40 test_cuda:30 record_tests:5
  profile:10)
REST_PLAN=(env:5 wheels:10 build_reuse:10 bench_large:40 bench_ce:25 fp64_cost:15 test_suite:40
  record_tests:5 no_sync:10 target_modes:15 memcheck:25 racecheck:20 ncu_rows:15 nvtx:20
  cpu_bf16:30)
REST_CONTINGENT=(build:115)

declare -A LIMIT=()
if [[ $PHASE == headline ]]; then
  PLAN=("${HEADLINE_PLAN[@]}")
  CONTINGENT=()
else
  PLAN=("${REST_PLAN[@]}")
  CONTINGENT=("${REST_CONTINGENT[@]}")
fi
TOTAL=0
for entry in "${PLAN[@]}"; do
  LIMIT[${entry%%:*}]=${entry##*:}
  TOTAL=$((TOTAL + ${entry##*:}))
done
for entry in "${CONTINGENT[@]}"; do
  LIMIT[${entry%%:*}]=${entry##*:}
done

if ((PLAN_ONLY)); then
  for entry in "${PLAN[@]}"; do
    printf '%-16s %4s\n' "${entry%%:*}" "${entry##*:}"
  done
  for entry in "${CONTINGENT[@]}"; do
    printf '%-16s %4s  contingent (not in the total)\n' "${entry%%:*}" "${entry##*:}"
  done
  printf 'total %s s, budget %s s\n' "$TOTAL" "$BUDGET_S"
  ((TOTAL <= BUDGET_S))
  exit
fi

LOGS=$(mktemp -d)
PY=${PYTHON:-$(command -v python3 || command -v python)}
SANITIZER=${SANITIZER:-compute-sanitizer}
command -v "$SANITIZER" >/dev/null 2>&1 || SANITIZER=/usr/local/cuda/bin/compute-sanitizer
NCU=${NCU:-ncu}
command -v "$NCU" >/dev/null 2>&1 || NCU=/usr/local/cuda/bin/ncu
# The records' commit and run: the device gets no .git (set FLCE_COMMIT where the call is made).
FLCE_COMMIT=${FLCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
FLCE_RUN=${FLCE_RUN:-$(date -u +%Y%m%dT%H%M%SZ)-$PHASE}
export FLCE_COMMIT FLCE_RUN
# (the device tool empties its $OUT before each call; elsewhere each run gets its own folder)
OUT=${OUT:-$PWD/benchmarks/results/gpu-$FLCE_RUN}
mkdir -p "$OUT"
RECORDS=$OUT/gpu_records.jsonl
PARTIAL=$OUT/gpu_records.partial
T0=$SECONDS
SUMMARY=()
FAILED=0

note() { SUMMARY+=("$*"); }

pack() {
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
  tar -czf "$OUT/gpu_logs.tgz.tmp" -C "$LOGS" . 2>/dev/null &&
    mv "$OUT/gpu_logs.tgz.tmp" "$OUT/gpu_logs.tgz"
}

# step NAME CMD...: run CMD in its own process under NAME's limit (cut to what is left of the
# budget, and to GPU_CHECK_MAX_LIMIT where set), its output in $LOGS/NAME.log; print its last
# lines; put its exit status in the summary; keep the record a cut step was writing; pack.
# OPTIONAL=1 step ...: a failure is reported but does not fail the run.
step() {
  local name=$1
  shift
  local limit=${LIMIT[$name]:-}
  if [[ -z $limit ]]; then
    echo "benchmarks/gpu/check.sh: step $name is in no plan of phase $PHASE" >&2
    exit 3
  fi
  local left=$((BUDGET_S - (SECONDS - T0)))
  if ((left < 5)); then
    note "$(printf '%-16s SKIPPED (budget spent)' "$name")"
    FAILED=1
    pack
    return 1
  fi
  ((limit > left)) && limit=$left
  if [[ -n ${GPU_CHECK_MAX_LIMIT:-} ]] && ((limit > GPU_CHECK_MAX_LIMIT)); then
    limit=$GPU_CHECK_MAX_LIMIT
  fi
  echo "== $name (limit ${limit}s)"
  local t=$SECONDS rc=0 status
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  tail -n 8 "$LOGS/$name.log"
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT at ${limit}s" ;;
    *) status=FAILED ;;
  esac
  if ((rc != 0)); then
    grep -m 12 -E "error|Error|FAIL" "$LOGS/$name.log"
    [[ ${OPTIONAL:-0} == 1 ]] || FAILED=1
  fi
  if [[ -f $PARTIAL ]]; then # the step died while measuring: keep what it had measured
    cat "$PARTIAL" >>"$RECORDS" && rm -f "$PARTIAL"
    status+=", its unfinished record kept (complete: false)"
  fi
  note "$(printf '%-16s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t))" "$status")"
  pack
  return $rc
}

# The build for this GPU.
build() {
  step build "$PY" setup.py build_ext --inplace || return 1
  BUILD_LOG=$LOGS/build.log
  # The build for a later rest call on a fresh machine (.gpu_build/, see the header).
  if ! (cd python/flce && tar -czf "$OUT/flce_build.tgz" _C*.so _build_info.py) 2>/dev/null; then
    rm -f "$OUT/flce_build.tgz"
    note "NOTE: the build could not be packed into flce_build.tgz"
  fi
  return 0
}

# ---- set-up ----
export PYTHONUNBUFFERED=1
# The image's default CXX (/opt/gcc) put libstdc++'s stream code into the extension, and the
# first C++ error message holding a number crashed the process (2026-12-04): build with the
# system compiler where there is one (tests/tools/test_build_info.py checks the extension).
if [[ ${CXX:-} == /opt/gcc/* && -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
[[ -n $FLCE_COMMIT ]] || note "NOTE: commit unknown (no FLCE_COMMIT, no git): records say null"
# shellcheck disable=SC2016 # (the bash -c script expands its own arguments)
step env bash -c 'set -e; nvidia-smi; "$1" -c "import sys, torch
print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
torch.cuda.get_device_properties(0))"; nvcc --version
{ nvidia-smi -q | grep -iE "driver version|product name|clocks|power limit"; nproc
  lscpu | head -20; echo "CC=${CC:-} CXX=${CXX:-}"; "${CXX:-g++}" --version; } || true' _ "$PY"
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  step wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$WHEELS"/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  note "$(printf '%-16s none in %s/: no Liger or CCE' wheels "$WHEELS")"
fi
export FLCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} FLCE_PTXAS_VERBOSE=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The in-place build puts flce._C into python/flce: import flce from there.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
BUILD_LOG=

finish() {
  pack
  echo
  echo "== summary: $PHASE, $((SECONDS - T0)) s of $BUDGET_S, commit ${FLCE_COMMIT:-?}," \
    "run $FLCE_RUN; files in $OUT"
  printf '%s\n' "${SUMMARY[@]}"
  [[ -f $RECORDS ]] && echo "records: $(wc -l <"$RECORDS") in $RECORDS"
  [[ -f "$OUT/table.txt" ]] && cat "$OUT/table.txt"
  exit $FAILED
}

if [[ $PHASE == headline ]]; then
  if ! build; then
    note "no build: nothing else can run (build.log in gpu_logs.tgz)"
    FAILED=1
    finish
  fi
  step ptxas "$PY" scripts/check_ptxas.py "$BUILD_LOG"
  # flce.check: correctness and the records, each in its own process (a fault in a path that
  # never ran on a GPU must not cost the records); its tables into table.txt.
  step check "$PY" -m flce.check --quick --only correctness
  step bench "$PY" -m flce.check --quick --only speed --out "$RECORDS" --partial "$PARTIAL"
  sed -n '/^\(linear_\)\{0,1\}cross_entropy  N=/,/^(floor/p' "$LOGS/bench.log" >>"$OUT/table.txt"
  step test_cuda "$PY" -m pytest -q -rfEs -p no:cacheprovider -k "not cuda-host" \
    --junitxml="$LOGS/junit_cuda.xml" tests/cuda/test_cuda.py tests/tools/test_check_ptxas.py \
    tests/tools/test_build_info.py::test_extension_uses_the_process_libstdcxx
  step record_tests "$PY" benchmarks/gpu/tests_record.py "$RECORDS" "$LOGS/junit_cuda.xml"
  step profile "$PY" benchmarks/profile_step.py --n 4096 --v 128256 --d 4096 --warmup 2 \
    --steps 1 --torch-profiler "$LOGS/trace_4096x128256x4096.json" \
    --memory-snapshot "$OUT/memory_snapshot.pickle"
  finish
fi

# ---- rest ----
if [[ -d .gpu_build ]] && compgen -G ".gpu_build/_C*.so" >/dev/null; then
  cp .gpu_build/_C*.so .gpu_build/_build_info.py python/flce/
fi
if ! OPTIONAL=1 step build_reuse "$PY" -c "import flce, sys
i = flce.build_info(); print(i); sys.exit(0 if i['cuda_backend'] else 1)"; then
  note "NOTE: no CUDA build of flce here (neither kept nor carried in .gpu_build/): building;" \
    "the last steps will be cut by the budget"
  if ! build; then
    note "no build: nothing else can run (build.log in gpu_logs.tgz)"
    FAILED=1
    finish
  fi
fi
step bench_large "$PY" -m flce.check --only speed --repeats 5 \
  --shapes "16384,128256,4096;4096,256000,4096;16384,256000,4096" \
  --out "$RECORDS" --partial "$PARTIAL"
sed -n '/^linear_cross_entropy  N=/,/^(floor/p' "$LOGS/bench_large.log" >>"$OUT/table.txt"
step bench_ce "$PY" benchmarks/run.py ce --device cuda --shapes 16384x64128 --dtypes bf16 \
  --impls flce,eager,liger,flce_inplace,compiled --repeats 10 --timeout 60 --record "$RECORDS" \
  --partial "$PARTIAL"
step fp64_cost "$PY" benchmarks/gpu/fp64_cost.py --repeats 3 --record "$RECORDS"
# The device-parametrized suites on "cuda", without the files that ran on their own above.
step test_suite "$PY" -m pytest -q -rfE -p no:cacheprovider --durations=10 tests \
  -m "not cuda_host" -k cuda --ignore=tests/cuda/test_cuda.py \
  --ignore=tests/tools/test_check_ptxas.py --ignore=tests/parallel/test_parallel_cuda.py \
  --ignore=tests/tools/test_gpu_check.py --ignore=tests/cuda/test_driver_mutations.py \
  --junitxml="$LOGS/junit_suite.xml"
step record_tests "$PY" benchmarks/gpu/tests_record.py "$RECORDS" "$LOGS/junit_suite.xml"
# Training steps without a host sync.
step no_sync "$PY" -c "import sys, torch
sys.path.insert(0, 'python'); import flce
g = torch.Generator(device='cuda').manual_seed(0)
x = torch.randn(4096, 1024, device='cuda', generator=g).bfloat16().requires_grad_()
w = torch.randn(32768, 1024, device='cuda', generator=g).div(32).bfloat16().requires_grad_()
t = torch.randint(0, 32768, (4096,), device='cuda', generator=g)
flce.linear_cross_entropy(x, w, t).backward()  # warm-up: allocations, handles
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode('error')
for _ in range(3):
    flce.linear_cross_entropy(x, w, t).backward()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
print('training steps without a host sync: ok')"
# A bad target in every check mode, each in its own process; any failing process fails the step.
# shellcheck disable=SC2016 # (the bash -c script expands its own arguments)
step target_modes bash -c 'rc=0
for m in 0 sync 1; do FLCE_CHECK_TARGETS=$m "$1" benchmarks/gpu/target_check.py none || rc=1; done
FLCE_CHECK_TARGETS=1 "$1" benchmarks/gpu/target_check.py mean || rc=1
exit $rc' _ "$PY"
step memcheck "$SANITIZER" --tool memcheck --error-exitcode 1 --leak-check no \
  "$PY" benchmarks/gpu/sanitize.py
step racecheck "$SANITIZER" --tool racecheck --error-exitcode 1 "$PY" benchmarks/gpu/sanitize.py
# The row kernels' counters at the anchor shape (DRAM throughput, issue slots, stalls).
step ncu_rows "$NCU" --clock-control none --kernel-name regex:row_ --launch-skip 4 \
  --launch-count 2 --section SpeedOfLight --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis "$PY" benchmarks/profile_step.py --n 4096 --v 128256 \
  --d 4096 --warmup 1 --steps 1
# Every flce kernel inside a flce:: NVTX range (ncu: nsys is absent).
# shellcheck disable=SC2016 # (the bash -c script expands its own arguments)
step nvtx bash -c 'set -e; n=("$1" --clock-control none --csv --metrics gpu__time_duration.sum)
"${n[@]}" "$2" benchmarks/gpu/nvtx_check.py >"$3/ncu_all.csv"
"${n[@]}" --nvtx --nvtx-include "regex:flce::.*/" "$2" benchmarks/gpu/nvtx_check.py \
  >"$3/ncu_in.csv"
"$2" benchmarks/gpu/nvtx_check.py --compare "$3/ncu_all.csv" "$3/ncu_in.csv"' \
  _ "$NCU" "$PY" "$LOGS"
# The host CPU's bf16 training step (AMX on the lent machines' Xeons: docs/cpu-backend.md's AMX
# predictions become a record).
OPTIONAL=1 step cpu_bf16 "$PY" -m flce.check --device cpu --only speed --dtype bf16 \
  --shapes 4096,32768,512 --out "$RECORDS" --partial "$PARTIAL"
finish
