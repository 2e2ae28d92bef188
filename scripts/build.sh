# Sourced after env.sh: builds the flce wheel into dist/ (CUDA kernels when a CUDA toolkit and a
# CUDA build of torch are present, see setup.py) and installs it into the environment.
rm -rf dist
python -m build --wheel --no-isolation --outdir dist . > build.log 2>&1 || { tail -50 build.log; exit 1; }
python -m pip install -q --force-reinstall --no-deps dist/flce-*.whl
