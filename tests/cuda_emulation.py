"""The CUDA backend on the CPU: builds and loads the test-only module ``flce_cuda_host``.

It is the torch binding of the CUDA backend (csrc/cuda/flce_cuda.cpp, compiled with
FLCE_CUDA_HOST) together with the unchanged kernels of csrc/cuda/*.cu compiled as host C++ and
run by the host SIMT runtime (csrc/cuda/host/: each CUDA thread a fiber, the PTX emulated from
the ISA tables), serving CPU tensors under the op namespace ``flce_cuda_host``, whose schemas are
flce's. With ``flce._ops.routed_to("flce_cuda_host")`` the whole API runs the CUDA launch
sequence: chunk loops, workspaces (NaN-poisoned), scales, target checks, and at::mm standing in
for cuBLAS.

``load()`` builds it once per source state under ``build/cuda_host/`` (torch's JIT extension
builder, ninja) and registers its fake kernels and autograd. The build needs the CUDA headers
(cuda_runtime.h, cuda_bf16.h), not a GPU; without them ``load()`` raises ``Unavailable``.
FLCE_CUDA_HOST_RACECHECK=1 builds the kernels with the shared-memory race detector.
"""
import functools
import glob
import hashlib
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "flce_cuda_host"


class Unavailable(RuntimeError):
    """The emulated CUDA backend cannot be built here (no CUDA headers)."""


def _cuda_include():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    raise Unavailable("no CUDA toolkit headers (cuda_runtime.h): set CUDA_HOME")


def _sources(build_dir):
    """The binding and runtime sources, plus one wrapper per kernel file: a .cpp that includes the
    unchanged .cu, so that the host compiler builds it."""
    src = os.path.join(ROOT, "csrc")
    binding = [os.path.join(src, "checks.cpp"), os.path.join(src, "cuda", "flce_cuda.cpp"),
               os.path.join(src, "cuda", "emulated", "device_host.cpp"),
               os.path.join(src, "cuda", "emulated", "module.cpp")]
    runtime = sorted(glob.glob(os.path.join(src, "cuda", "host", "*.cpp")))
    wrappers = []
    os.makedirs(build_dir, exist_ok=True)
    for cu in sorted(glob.glob(os.path.join(src, "cuda", "*.cu"))):
        path = os.path.join(build_dir, os.path.basename(cu)[:-3] + "_host.cpp")
        text = f'#include "{cu}"\n'
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        wrappers.append(path)
    return binding + runtime, wrappers


def _digest(paths):
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def load():
    """Build (if needed) and import flce_cuda_host; returns ``torch.ops.flce_cuda_host``."""
    from torch.utils import cpp_extension

    import flce._ops

    cuda_inc = _cuda_include()
    racecheck = os.environ.get("FLCE_CUDA_HOST_RACECHECK") == "1"
    base = os.path.join(ROOT, "build", "cuda_host" + ("_racecheck" if racecheck else ""))
    plain, kernels = _sources(base)
    headers = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True) + glob.glob(
        os.path.join(ROOT, "csrc", "**", "*.cuh"), recursive=True) + glob.glob(
        os.path.join(ROOT, "csrc", "cuda", "*.cu"))
    # One build directory per source state: ninja's dependency scan does not see through the
    # wrappers' absolute includes reliably across checkouts.
    build_dir = os.path.join(base, _digest(plain + headers))
    os.makedirs(build_dir, exist_ok=True)
    flags = ["-O2", "-std=c++20", "-DFLCE_CUDA_HOST=1", "-fno-math-errno", "-fno-trapping-math",
             f"-I{cuda_inc}", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
             f"-I{os.path.join(ROOT, 'csrc')}"]
    # The kernels' race detector sees shared-memory accesses through -fsanitize=thread
    # instrumentation whose callbacks the runtime supplies (no libtsan is linked).
    if racecheck:
        kernel_objs = _compile_instrumented(kernels, build_dir, flags)
        sources, extra_ldflags = plain, kernel_objs
    else:
        sources, extra_ldflags = plain + kernels, []
    cpp_extension.load(
        name=NAMESPACE, sources=sources, extra_cflags=flags,
        # -Bsymbolic: the runtime's own cudaGetLastError & co. must not bind to the libcudart
        # that torch loaded.
        extra_ldflags=extra_ldflags + ["-Wl,-Bsymbolic"], build_directory=build_dir,
        with_cuda=False, verbose=os.environ.get("FLCE_CUDA_HOST_VERBOSE") == "1")
    if not getattr(load, "_registered", False):
        flce._ops.register(NAMESPACE, lambda t: True)
        load._registered = True
    return getattr(torch.ops, NAMESPACE)


def _compile_instrumented(kernels, build_dir, flags):
    import subprocess

    from torch.utils import cpp_extension

    objs = []
    for src in kernels:
        obj = os.path.join(build_dir, os.path.basename(src)[:-4] + ".tsan.o")
        if not os.path.exists(obj) or os.path.getmtime(obj) < os.path.getmtime(src):
            cmd = ["c++", "-c", src, "-o", obj, "-fPIC", "-fsanitize=thread"] + flags + [
                f"-I{p}" for p in cpp_extension.include_paths()]
            subprocess.run(cmd, check=True)
        objs.append(obj)
    return objs
