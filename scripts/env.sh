# Sourced by scripts/demo.sh and scripts/test.sh: a virtual environment with torch, numpy and the
# build tools (requirements-build.txt), created on first use. FLCE_VENV (default .venv) picks its
# place; FLCE_TORCH the torch requirement (default torch==2.14.1: a CUDA 13.0 build, which also
# runs on CPU-only machines and lets flce build its CUDA kernels wherever nvcc is found).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FLCE_VENV=${FLCE_VENV:-.venv}
FLCE_TORCH=${FLCE_TORCH:-torch==2.14.1}
if [ ! -x "$FLCE_VENV/bin/python" ]; then
  python3 -m venv "$FLCE_VENV"
fi
# shellcheck disable=SC1091
source "$FLCE_VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "$FLCE_TORCH"
fi
python -m pip install -q -r requirements-build.txt
