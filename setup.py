"""Build flce and its extension module flce._C.

Environment:
  FLCE_CUDA=0|1           force the CPU-only (CppExtension) or CUDA (CUDAExtension) build.
                          Unset: CUDA when a CUDA toolkit (nvcc) and a CUDA build of torch are
                          found. A visible GPU is never required.
  TORCH_CUDA_ARCH_LIST    architectures to compile, e.g. "9.0a" or "8.0;9.0a;10.0+PTX".
                          Unset: DEFAULT_ARCH_LIST below.
  CUDA_HOME               the toolkit; else the directory of `nvcc` on PATH, else /usr/local/cuda.
  MAX_JOBS                parallel compile jobs (ninja), as for every torch extension.
  FLCE_PTXAS_VERBOSE=1    pass -Xptxas -v (registers and spills per kernel, used by CI).
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# Ampere, Hopper (wgmma/TMA need the "a" target), Blackwell datacenter and consumer; PTX of the
# newest so that later GPUs can JIT it.
DEFAULT_ARCH_LIST = "8.0;9.0a;10.0;12.0+PTX"


def _find_cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        cand = os.path.dirname(os.path.dirname(real))
        if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
            return cand
    for cand in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME when imported.
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _want_cuda():
    flag = os.environ.get("FLCE_CUDA", "").strip()
    if flag in ("0", "1"):
        if flag == "1":
            if torch.version.cuda is None:
                sys.exit("FLCE_CUDA=1 but this torch is a CPU build (torch.version.cuda is None)")
            if _cuda_home is None:
                sys.exit("FLCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME")
        return flag == "1"
    if flag:
        sys.exit(f"FLCE_CUDA must be 0 or 1, got {flag!r}")
    return torch.version.cuda is not None and _cuda_home is not None


def _nvidia_wheel_includes():
    # CUDA builds of torch from PyPI ship some toolkit headers (cusparse.h, ...) in nvidia wheels
    # rather than in the system toolkit; torch's headers include them.
    out = []
    for path in sys.path:
        out += glob.glob(os.path.join(path, "nvidia", "cu*", "include"))
        out += glob.glob(os.path.join(path, "nvidia", "*", "include"))
    return sorted(set(p for p in out if os.path.isdir(p)))


use_cuda = _want_cuda()
if use_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
# No -ffast-math anywhere: the Kahan compensation and NaN propagation need IEEE arithmetic.
# -fno-trapping-math (as torch itself builds) only lets the vectorizer if-convert the epilogue.
cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]
define_macros = []
ext_kwargs = {}

if use_cuda:
    sources += sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    include_dirs += _nvidia_wheel_includes()
    nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    if os.environ.get("FLCE_PTXAS_VERBOSE") == "1":
        nvcc_flags += ["-Xptxas=-v"]
    define_macros.append(("FLCE_WITH_CUDA", "1"))
    ext = CUDAExtension(
        "flce._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        py_limited_api=True,
        **ext_kwargs,
    )
else:
    ext = CppExtension(
        "flce._C",
        sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        py_limited_api=True,
        **ext_kwargs,
    )

setup(
    name="flce",
    version="0.1.0",
    description="Fused, collapse-safe linear cross-entropy for large-vocabulary language models",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.9",
    install_requires=["torch>=2.6"],
)
