#!/usr/bin/env bash
# Build a CUDA wheel of flce for one arch list, install it into a fresh virtual environment,
# import it, run a CPU smoke test, and check the wheel's device code against the list.
#
#   scripts/ci_wheel.sh                       # TORCH_CUDA_ARCH_LIST="8.0;9.0a;10.0"
#   TORCH_CUDA_ARCH_LIST="9.0a" scripts/ci_wheel.sh
#   FLCE_CUDA=0 scripts/ci_wheel.sh           # the CPU-only wheel (no device code allowed)
#   FLCE_CUDA=0 FLCE_CI_EDITABLE=1 scripts/ci_wheel.sh
#                                             # no wheel: `pip install --no-build-isolation -e`
#                                             # of the source copy, then the same smoke test
#
# Environment: TORCH_CUDA_ARCH_LIST, FLCE_PTX, FLCE_CI_WHEEL (check this wheel, skip the build),
# FLCE_CI_EDITABLE=1 (the editable install instead of a wheel), CUDA_HOME (default
# /usr/local/cuda-13.0 when it exists), MAX_JOBS (default: the core count), PYTHON (default
# python3), FLCE_CI_WORK (a scratch directory, default mktemp; kept on failure for inspection),
# FLCE_CI_KEEP=1 (keep it anyway).
# The build runs in a copy of the tracked sources, so the checkout's own build (and its
# python/flce/_build_info.py) is left alone. Exit status non-zero on any failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
export FLCE_CUDA=${FLCE_CUDA:-1}
[[ "${FLCE_CPU_ONLY:-0}" == 1 ]] && FLCE_CUDA=0
unset FLCE_CPU_ONLY
if [[ $FLCE_CUDA == 1 ]]; then
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0a;10.0"}
  EXPECT_ARCHS=$TORCH_CUDA_ARCH_LIST
else
  unset TORCH_CUDA_ARCH_LIST
  EXPECT_ARCHS=""  # a CPU-only wheel: no device code
fi
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda-13.0/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda-13.0
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
WORK=${FLCE_CI_WORK:-$(mktemp -d -t flce-ci-wheel.XXXXXX)}
mkdir -p "$WORK"
T0=$(date +%s)
step() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
cleanup() {
  local rc=$?
  if [[ $rc -eq 0 && "${FLCE_CI_KEEP:-0}" != 1 && -z "${FLCE_CI_WORK:-}" ]]; then
    rm -rf "$WORK"
  else
    echo "ci_wheel: scratch directory kept: $WORK"
  fi
  echo "ci_wheel: $([[ $rc -eq 0 ]] && echo PASSED || echo "FAILED (exit $rc)") in $(( $(date +%s) - T0 ))s"
}
trap cleanup EXIT

EDITABLE=${FLCE_CI_EDITABLE:-0}
if [[ -n "${FLCE_CI_WHEEL:-}" ]]; then
  [[ $EDITABLE == 1 ]] && { echo "FLCE_CI_WHEEL and FLCE_CI_EDITABLE=1 exclude each other"; exit 2; }
  WHEEL=$(readlink -f "$FLCE_CI_WHEEL")
  N_CU=$("$PY" -c "import sys, zipfile; i = {}; exec(zipfile.ZipFile(sys.argv[1]).read('flce/_build_info.py'), i); print(i['INFO']['cuda_sources'])" "$WHEEL")
  step "checking the given wheel $(basename "$WHEEL") ($N_CU CUDA sources): no build"
else
  step "copy tracked sources of $ROOT to $WORK/src"
  rm -rf "$WORK/src" && mkdir -p "$WORK/src"
  if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    # Tracked and untracked-but-not-ignored files: what the next commit would hold.
    # (--ignore-failed-read: a tracked file deleted in the checkout is skipped.)
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | \
      tar --null --ignore-failed-read -cf - -T - 2>/dev/null) | tar -xf - -C "$WORK/src"
  else
    tar -C "$ROOT" --exclude=./build --exclude=./dist --exclude='*.so' -cf - . | tar -xf - -C "$WORK/src"
  fi
  shopt -s nullglob
  CU_FILES=("$WORK"/src/csrc/cuda/*.cu)
  N_CU=${#CU_FILES[@]}
  echo "   $N_CU CUDA source(s) in csrc/cuda"
fi
if [[ -z "${FLCE_CI_WHEEL:-}" && $EDITABLE != 1 ]]; then
  step "build the wheel: FLCE_CUDA=$FLCE_CUDA TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-}"
  B0=$(date +%s)
  "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WORK/dist" "$WORK/src" \
    > "$WORK/build.log" 2>&1 || { tail -50 "$WORK/build.log"; echo "FAIL: wheel build"; exit 1; }
  WHEEL=$(ls "$WORK"/dist/flce-*.whl)
  echo "   built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB) in $(( $(date +%s) - B0 ))s"
fi

rm -rf "$WORK/venv"
VPY="$WORK/venv/bin/python"
if [[ $EDITABLE == 1 ]]; then
  # A new venv as a user makes one: its own pip, then torch (which pulls in the newest
  # setuptools) and requirements-build.txt (wheel among them): the combination under which,
  # before pyproject.toml, pip chose the legacy `setup.py develop`, which setuptools >= 80 runs
  # as a pip install in an isolated environment without torch. (Borrowing torch through a .pth,
  # as for the wheel below, hides that failure: the tree without pyproject.toml installs there.)
  TORCH_REQ=${FLCE_TORCH:-torch==$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")}
  step "new virtual environment with its own pip; $TORCH_REQ and requirements-build.txt"
  "$PY" -m venv "$WORK/venv"
  "$VPY" -m pip install -q "$TORCH_REQ" -r "$WORK/src/requirements-build.txt" \
    > "$WORK/venv.log" 2>&1 || { tail -50 "$WORK/venv.log"; echo "FAIL: venv setup"; exit 1; }
  step "editable install with $("$VPY" -m pip --version | cut -d' ' -f1-2), setuptools $("$VPY" -c 'import setuptools; print(setuptools.__version__)') (FLCE_CUDA=$FLCE_CUDA)"
  "$VPY" -m pip install --no-build-isolation -e "$WORK/src" > "$WORK/build.log" 2>&1 || {
    tail -50 "$WORK/build.log"; echo "FAIL: pip install --no-build-isolation -e"; exit 1; }
  FROM="$WORK/src/python/flce"
else
  step "fresh virtual environment (system site-packages for torch) and install"
  # Without its own pip (3 s instead of 15 s; the system pip installs into it with --python).
  "$PY" -m venv --without-pip --system-site-packages "$WORK/venv"
  # When $PY is itself a venv (CI's .venv), --system-site-packages reaches only the base
  # interpreter: a .pth appends $PY's own site-packages (after the new venv's, so the wheel
  # installed here wins over any flce there).
  "$PY" -c "import site; print(''.join(f'import site; site.addsitedir({p!r})\n' for p in site.getsitepackages()))" > \
    "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_flce_ci_parent.pth"
  VPIP=("$PY" -m pip --python "$VPY")
  # No deps: torch comes from the system; the wheel's torch pin is checked below.
  # --ignore-installed: the parent environment may already hold this flce (pip sees it through
  # the .pth above) and must not satisfy the install.
  "${VPIP[@]}" install -q --no-index --no-deps --ignore-installed "$WHEEL"
  FROM=$("$VPY" -c "import sys; print(sys.prefix)")
fi

step "import and CPU smoke test (from outside the source tree)"
(cd "$WORK" && "$VPY" - "$EXPECT_ARCHS" "${FLCE_PTX:-newest}" "$N_CU" "$ROOT" "$FROM" <<'EOF'
import os, runpy, sys
import torch
import flce
arch_list, ptx, root, where = sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]
n_cu = int(sys.argv[3])
assert flce.__file__.startswith(where), f"imported {flce.__file__}, not the one installed in {where}"
import importlib.metadata as md
pins = [r for r in md.requires("flce") if r.replace(" ", "").startswith("torch")]
mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
print("   requires:", pins, "- installed torch", torch.__version__)
assert pins == [f"torch=={mm}.*"], f"the wheel must pin the torch it was built with: {pins}"
info = flce.build_info()
print("   build_info:", info)
b = runpy.run_path(os.path.join(root, "python", "flce", "_build.py"))
assert info["torch"] == torch.__version__, info
if arch_list:
    want = b["format_arch_list"](b["parse_arch_list"](arch_list, ptx))
    assert info["arch_list"] == want, (info["arch_list"], want)
    assert info["cuda"] and info["cuda_sources"] == n_cu, (info, n_cu)
    assert info["cuda_backend"] == bool(n_cu), "CUDA kernels registered iff .cu files were built"
else:
    assert info["cuda"] is None and info["arch_list"] == "" and not info["cuda_backend"], info
torch.manual_seed(0)
n, v, d = 37, 1001, 24
x = torch.randn(n, d, requires_grad=True)
w = torch.randn(v, d, requires_grad=True)
t = torch.randint(0, v, (n,))
t[3] = -100
loss = flce.linear_cross_entropy(x, w, t)
loss.backward()
x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
ref = flce.reference.linear_cross_entropy(x64, w64, t)
ref.backward()
for name, got, want_t in (("loss", loss, ref), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad)):
    err = ((got.double() - want_t).abs().max() / want_t.abs().max()).item()
    print(f"   {name}: max error / max |ref| = {err:.2e}")
    assert err < 1e-5, f"{name} is off: {err}"
EOF
)

[[ $EDITABLE == 1 ]] && exit 0
step "device code in the wheel vs the arch list"
if [[ $FLCE_CUDA == 1 && $N_CU -gt 0 ]] && ! "$VPY" -c "
import runpy, sys; sys.exit(runpy.run_path('$ROOT/scripts/check_wheel.py', run_name='x')['find_cuobjdump']() is None)"; then
  echo "   no cuobjdump found: pip install nvidia-cuda-cuobjdump into the venv"
  "${VPIP[@]}" install -q nvidia-cuda-cuobjdump
fi
"$VPY" "$ROOT/scripts/check_wheel.py" "$WHEEL" --arch-list "$EXPECT_ARCHS" \
  --ptx "${FLCE_PTX:-newest}"
