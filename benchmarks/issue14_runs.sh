#!/usr/bin/env bash
# Every CPU run that docs/benchmarks.md records for issue 14, in one go: the reference shape
# (N=4096, V=32768, D=512), fp32 and bf16, native and emulated AVX2 (bench.py --isa avx2), quiet
# and with one busy process per core (--load), each child bounded by --timeout; then the small
# shape of the issue (N=1024, V=8192, D=256) quiet, loaded, and loaded with one thread. First-call
# times are in every table (first (s), /time). CSVs and the full log go to $OUT (default
# benchmarks/results/issue14-<date>/). Start it on a quiet machine (it prints the load average
# and warns above 0.5): the loaded runs make their own load, the quiet ones need none.
#
#     bash benchmarks/issue14_runs.sh            # about 30 min on the 2-core CI machine
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-benchmarks/results/issue14-$(date -u +%Y%m%d-%H%M)}
LOAD=${LOAD:-$(nproc)}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

echo "== $(date -u) $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname)"
uptime
if awk '{exit !($1 > 0.5)}' /proc/loadavg; then
  echo "WARNING: load average $(cut -d' ' -f1 /proc/loadavg) > 0.5: the quiet runs will not be quiet"
fi
"$PY" -c "import torch, flce; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability(), 'threads', torch.get_num_threads()); print(flce.build_info())"
grep -m1 'model name' /proc/cpuinfo; nproc

run() {  # run NAME ARGS...: one bench.py comparison, its CSV under $OUT
  local name=$1; shift
  echo; echo "== $name: bench.py $*"; uptime
  "$PY" benchmarks/bench.py --timeout 1200 --csv "$OUT/$name.csv" "$@" ||
    echo "bench.py failed: $name"
}

# flce's default path, and its training paths forced as peers: fp32 defaults to the recompute
# path (chunked torch's memory), bf16 to the single pass, or to the recompute path where its
# GEMMs run on AMX (flce.build_info()["cpu_amx"]). Eager bf16 on an AVX2 CPU takes ~3 min a step
# (186.8 s on the Zen 4, docs/benchmarks.md): those runs leave it out.
for isa in native avx2; do
  for dtype in fp32 bf16; do
    reps=5 peers=eager,chunked,flce-single
    [ "$dtype" = bf16 ] && reps=3 peers=eager,chunked,flce-single,flce-recompute
    [ "$dtype-$isa" = bf16-avx2 ] && peers=chunked,flce-single,flce-recompute
    run "${isa}-${dtype}-quiet" --peers "$peers" --isa "$isa" --dtype "$dtype" --repeats "$reps"
    run "${isa}-${dtype}-load${LOAD}" --peers "$peers" --isa "$isa" --dtype "$dtype" \
      --repeats "$reps" --load "$LOAD"
  done
done

for isa in native avx2; do
  small=(-N 1024 -V 8192 -D 256 --repeats 9 --isa "$isa" --peers eager,chunked)
  run "${isa}-small-quiet" "${small[@]}"
  run "${isa}-small-load${LOAD}" "${small[@]}" --load "$LOAD"
  run "${isa}-small-load${LOAD}-1thread" "${small[@]}" --load "$LOAD" --threads 1
done
echo; echo "== done $(date -u)"; uptime
