#!/usr/bin/env bash
# Build flce, then run the C++ math tests (ctest) and the Python test suite against the
# installed wheel.
source "$(dirname "$0")/env.sh"
t0=$(date +%s)
phase() { echo "test.sh: $1 at $(( $(date +%s) - t0 )) s"; }
python -m pip install -q -r requirements-test.txt
phase "environment ready"
source scripts/build.sh
phase "wheel built and installed"
if [ -f CMakeLists.txt ] && command -v cmake >/dev/null; then
  cmake -S . -B build-ctest > /dev/null
  cmake --build build-ctest -j 2 > /dev/null
  phase "ctest built"
  # The tests are single-threaded programs, each in its own scratch space: run them side by side.
  (cd build-ctest && ctest --output-on-failure -j "${MAX_JOBS:-$(nproc)}")
  phase "ctest done"
  # The emulated CUDA binding's build (tests/cuda_emulation.py) takes its kernel and runtime
  # objects from this build instead of compiling them again.
  export FLCE_CUDA_HOST_CMAKE_BUILD=$PWD/build-ctest
fi
# A fresh compile cache: inductor's cache outlives runs on one machine and keys on op schemas,
# not on the fake kernels that give output shapes.
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
# Run from outside the source tree so that the installed package, not python/, is imported.
# Two worker processes (pytest-xdist; PYTEST_WORKERS to change): most tests are single-threaded
# Python, and the emulated CUDA backend builds in one worker while the other runs CPU tests.
cd tests && python -m pytest -q -rs -n "${PYTEST_WORKERS:-2}" "$@" .
