"""Build flce and its extension module flce._C.

Environment:
  FLCE_CUDA=0|1           force the CPU-only (CppExtension) or CUDA (CUDAExtension) build.
                          Unset: CUDA when a CUDA toolkit (nvcc) and a CUDA build of torch are
                          found. A visible GPU is never required.
  FLCE_CPU_ONLY=1         alias of FLCE_CUDA=0.
  TORCH_CUDA_ARCH_LIST    architectures to compile, e.g. "9.0a" or "8.0;9.0a;10.0+PTX"; checked
                          against `nvcc --list-gpu-code` before anything compiles.
                          Unset: DEFAULT_ARCH_LIST in python/flce/_build.py.
  FLCE_PTX                newest (default) | none | all: which arches also get PTX when no entry
                          of the list says +PTX.
  FLCE_LOCAL_VERSION      the wheel's PEP 440 local label; unset: cu130.sm80.sm90a... or cpu;
                          empty: none.
  CUDA_HOME               the toolkit; else the directory of `nvcc` on PATH, else /usr/local/cuda.
  MAX_JOBS                parallel compile jobs (ninja); unset: min(cores, GiB of RAM / 3).
  FLCE_NVCC_THREADS       nvcc --threads (arches of one .cu compiled in parallel); unset: the
                          cores MAX_JOBS leaves idle when there are fewer .cu files than jobs.
  FLCE_PTXAS_VERBOSE=1    pass -Xptxas -v (registers and spills per kernel, used by CI).
  FLCE_DEBUG_INFO=1       keep the host code's debug info (Python's -g); default -g0.
See docs/build.md.
"""
import glob
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _load_build_helpers():
    # By path: importing the flce package would need the extension this script is about to build.
    spec = importlib.util.spec_from_file_location("_flce_build", os.path.join(ROOT, "python",
                                                                               "flce", "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_build = _load_build_helpers()


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

try:
    import torch  # noqa: E402
except ModuleNotFoundError:
    # pip's isolated build environment (pip install . without --no-build-isolation) has no torch.
    sys.exit("error: torch is not importable in this build environment (an isolated build?). "
             "flce compiles against the torch it will run with: install torch first, then build "
             "without isolation: pip install --no-build-isolation [-e] .  or  "
             "python -m build --no-isolation")
from torch.utils import cpp_extension  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _want_cuda():
    flag = os.environ.get("FLCE_CUDA", "").strip()
    if os.environ.get("FLCE_CPU_ONLY", "").strip() == "1":
        if flag == "1":
            sys.exit("FLCE_CPU_ONLY=1 contradicts FLCE_CUDA=1")
        flag = "0"
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


def _cublas_link_args():
    # dev::gemm (csrc/cuda/device_cuda.cpp) calls cuBLAS on torch's handle. The library is the
    # one torch loads (pip's CUDA torch keeps it in the nvidia wheels, without an unversioned
    # libcublas.so symlink): link it by its file name.
    dirs = [os.path.join(_cuda_home, "lib64")] if _cuda_home else []
    for path in sys.path:
        dirs += glob.glob(os.path.join(path, "nvidia", "cu*", "lib"))
        dirs += glob.glob(os.path.join(path, "nvidia", "cublas", "lib"))
    for d in dirs:
        libs = sorted(glob.glob(os.path.join(d, "libcublas.so*")), key=len)
        if libs:
            return [f"-L{d}", f"-l:{os.path.basename(libs[0])}"]
    sys.exit("error: FLCE_CUDA build: libcublas not found in the CUDA toolkit or the nvidia wheels")


def _default_max_jobs():
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8
    # nvcc with several -gencode targets peaks at 2-3 GiB per job.
    return max(1, min(os.cpu_count() or 1, int(mem_gib // 3)))


use_cuda = _want_cuda()
os.environ.setdefault("MAX_JOBS", str(_default_max_jobs()))

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
# No -ffast-math anywhere: the Kahan compensation and NaN propagation need IEEE arithmetic.
# -fno-trapping-math (as torch itself builds) only lets the vectorizer if-convert the epilogue.
# -fopenmp: ATen's at::parallel_for is a header template that runs serially unless the caller
# is compiled with OpenMP (torch's CPU build parallelizes with OpenMP); the module then needs
# libgomp.so.1, which is the one libtorch_cpu has already loaded.
cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# -g0 after the -g of Python's own CFLAGS: debug info for torch's templates about doubles each
# C++ unit's compile time and makes the module several times larger, for line numbers that only
# a developer's debugger reads (FLCE_DEBUG_INFO=1 keeps them). Symbols stay in backtraces.
if os.environ.get("FLCE_DEBUG_INFO") != "1":
    cxx_flags.append("-g0")
define_macros = []
ext_kwargs = {"extra_link_args": ["-fopenmp"]}

# abi3: the module uses the stable ABI only (its ops are registered with the dispatcher, not
# bound to Python). BuildExtension defines Py_LIMITED_API for a py_limited_api extension at the
# oldest CPython that torch supports (cpp_extension.min_supported_cpython, 3.10 for torch 2.14),
# after any flag of ours; the wheel's tag names that version.
_limited_api = int(getattr(cpp_extension, "min_supported_cpython", "0x03090000"), 16)
if not hasattr(cpp_extension, "min_supported_cpython"):  # an older torch defines none
    cxx_flags.append(f"-DPy_LIMITED_API={_limited_api:#010x}")
abi_tag = f"cp{_limited_api >> 24}{(_limited_api >> 16) & 0xff}"

archs, cuda_version, cu_sources = [], None, []
if use_cuda:
    try:
        archs = _build.parse_arch_list(
            os.environ.get("TORCH_CUDA_ARCH_LIST") or _build.DEFAULT_ARCH_LIST,
            os.environ.get("FLCE_PTX", "newest"))
        cuda_version = _build.validate_for_nvcc(archs, os.path.join(_cuda_home, "bin", "nvcc"))
    except _build.ArchError as e:
        sys.exit(f"error: {e}")
    cu_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + cu_sources
    include_dirs += _nvidia_wheel_includes()
    nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    # Our own -gencode flags: torch.utils.cpp_extension then adds none of its own (its list
    # rejects names such as 10.0f and never adds PTX unless asked).
    nvcc_flags += _build.gencode_flags(archs)
    # (nvcc prints each target's ptxas report whole: FLCE_PTXAS_VERBOSE's log reads the same
    # with parallel targets)
    threads = os.environ.get("FLCE_NVCC_THREADS") or str(
        max(1, min(len(archs), int(os.environ["MAX_JOBS"]) // max(1, len(cu_sources)))))
    nvcc_flags += [f"--threads={threads}"]
    if os.environ.get("FLCE_PTXAS_VERBOSE") == "1":
        nvcc_flags += ["-Xptxas=-v"]
    define_macros.append(("FLCE_WITH_CUDA", "1"))
    ext_kwargs["extra_link_args"] = ext_kwargs["extra_link_args"] + _cublas_link_args()
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

try:
    local = _build.local_version(archs, cuda_version)
except _build.ArchError as e:
    sys.exit(f"error: {e}")
version = VERSION + (f"+{local}" if local else "")
_torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
_build.write_build_info(
    os.path.join(ROOT, "python", "flce", "_build_info.py"),
    version=version, torch=torch.__version__, torch_cuda=torch.version.cuda, cuda=cuda_version,
    arch_list=_build.format_arch_list(archs), sass=[a.sm for a in archs],
    ptx=[a.compute for a in archs if a.ptx], cuda_sources=len(cu_sources),
    build_system="setuptools")

# The static metadata (name, description, Python versions) is in pyproject.toml; these two are
# its `dynamic` fields.
setup(
    version=version,
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": abi_tag}},
    # The extension links torch's C++ ABI, which changes between minor releases.
    install_requires=[f"torch=={_torch_mm}.*"],
)
