"""The CUDA backend on the CPU: builds and loads the test-only module ``flce_cuda_host``.

It is the torch binding of the CUDA backend (csrc/cuda/*.cpp, compiled with
FLCE_CUDA_HOST) together with the unchanged kernels of csrc/cuda/*.cu compiled as host C++ and
run by the host SIMT runtime (tools/cuda_host/: each CUDA thread a fiber), serving CPU tensors under the op namespace ``flce_cuda_host``, whose schemas are
flce's. Inside ``routed()`` the whole API runs the CUDA launch
sequence: chunk loops, workspaces (NaN-poisoned), scales, target checks, and at::mm standing in
for cuBLAS.

``load()`` builds it once per source state under ``build/cuda_host/`` (torch's JIT extension
builder, ninja) and registers its fake kernels and autograd. The build needs the CUDA headers
(cuda_runtime.h, cuda_bf16.h), not a GPU; without them ``load()`` raises ``Unavailable``
(``load_or_skip()``: a test skips, or fails under FLCE_REQUIRE_CUDA_HOST=1).
FLCE_CUDA_HOST_RACECHECK=1 builds the kernels with the shared-memory race detector;
FLCE_CUDA_HOST_MUTANT=PATH builds it with one launch-sequence file (csrc/cuda/NAME.cpp) replaced by
PATH, a mutated copy (tests/cuda/test_driver_mutations.py). FLCE_CUDA_HOST_CMAKE_BUILD=DIR (CI: the
C++ tests' CMake build directory) takes the kernel and runtime objects from that build, where they
are up to date, instead of compiling them again.
"""
import contextlib
import fcntl
import functools
import glob
import hashlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "flce_cuda_host"
TOOLS = os.path.join(ROOT, "tools", "cuda_host")


class Unavailable(RuntimeError):
    """The emulated CUDA backend cannot be built here (no CUDA headers)."""


def _build_info():
    import runpy

    return runpy.run_path(os.path.join(ROOT, "tools", "cuda_host", "build_info.py"))


def _binding_sources():
    """The binding's launch sequences (csrc/cuda/*.cpp but the GPU's device_cuda.cpp), the
    host's device facilities and module, and the argument checks every backend shares."""
    src = os.path.join(ROOT, "csrc")
    cuda = sorted(p for p in glob.glob(os.path.join(src, "cuda", "*.cpp"))
                  if os.path.basename(p) != "device_cuda.cpp")
    return [os.path.join(src, "checks.cpp")] + cuda + [
        os.path.join(TOOLS, "binding", "device_host.cpp"),
        os.path.join(TOOLS, "binding", "module.cpp")]


def _digest(paths):
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def _seed(built, build_dir):
    """A new build directory as a copy of a finished one (timestamps and ninja's log kept): ninja
    then recompiles only what differs (a compile command, a source) and relinks."""
    if os.path.isdir(build_dir) or not os.path.isfile(os.path.join(built, f"{NAMESPACE}.so")):
        return
    import shutil

    # torch's build lock is not copied: a copy taken during a build would wait on it forever.
    shutil.copytree(built, build_dir, symlinks=True, ignore=shutil.ignore_patterns("lock"))


@functools.lru_cache(maxsize=None)
def load():
    """Build (if needed) and import flce_cuda_host; returns ``torch.ops.flce_cuda_host``."""
    bi = _build_info()
    config = "racecheck" if os.environ.get("FLCE_CUDA_HOST_RACECHECK") == "1" else "plain"
    try:
        info = bi["build_info"](config)
    except FileNotFoundError as e:
        raise Unavailable(str(e)) from None
    binding = _binding_sources()
    sources = [p for top in ("csrc", TOOLS) for ext in ("*.h", "*.cuh")
               for p in glob.glob(os.path.join(ROOT, top, "**", ext), recursive=True)] + binding + \
        info["kernel_sources"] + info["runtime_sources"]
    # One build directory per source state: the kernels' and runtime's objects are rebuilt by
    # their own timestamps only, and ninja does not see header changes through them.
    digest = _digest(sources)
    build_dir = os.path.join(ROOT, "build", "cuda_host", f"{config}-{digest}")
    # The binding is compiled with the same flags in every configuration (racecheck instruments
    # the kernels alone): a racecheck build starts from a copy of the plain one, if there is one,
    # and compiles its kernels and links.
    seed = os.path.join(ROOT, "build", "cuda_host", f"plain-{digest}")
    mutant = os.environ.get("FLCE_CUDA_HOST_MUTANT")
    if mutant:
        # A planted bug (tests/cuda/test_driver_mutations.py): one launch-sequence file replaced by a
        # mutated copy. The module is built in a copy of the clean build directory, so that
        # ninja recompiles that file alone.
        mutant = os.path.abspath(mutant)
        name = os.path.basename(mutant)
        binding = [mutant if os.path.basename(b) == name else b for b in binding]
        seed = build_dir
        build_dir = f"{build_dir}-mutant-{_digest([mutant])}"
    # One process builds a directory at a time (pytest-xdist's workers share the builds): the
    # others wait on its lock, then find it built; a copy is taken under the copied one's lock.
    with _locked(build_dir):
        if seed != build_dir:
            with _locked(seed):
                _seed(seed, build_dir)
        os.makedirs(build_dir, exist_ok=True)
        return _build_and_import(bi, info, binding, build_dir, _cmake_objects(config))


@contextlib.contextmanager
def _locked(build_dir):
    os.makedirs(os.path.dirname(build_dir), exist_ok=True)
    with open(f"{build_dir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cmake_objects(config):
    """The runtime and kernel objects of ``config`` in the CMake build FLCE_CUDA_HOST_CMAKE_BUILD
    names (tests/cuda_host/CMakeLists.txt compiles them with build_info.py's flags), or None
    where there is none to take: a build of another source tree, CMake's own flags not only an
    optimization level (build_info's -O, later on the command line, wins) and -DNDEBUG (the
    kernels and runtime have no assert), another compiler than the one this build links with,
    or an object older than a file its compiler's dependency list (OBJECT.d) names."""
    import json
    import shutil

    build = os.environ.get("FLCE_CUDA_HOST_CMAKE_BUILD")
    if not build:
        return None
    try:
        with open(os.path.join(build, "tests", "cuda_host", "mutation_build.json")) as f:
            cfg = json.load(f)
        objects = [o for key in ("runtime_objects", "kernel_objects")
                   for o in cfg[key][config].split(";") if o]
        ours = shutil.which(os.environ.get("CXX", "c++"))
        if (not objects or ours is None
                or os.path.realpath(cfg["source_root"]) != os.path.realpath(ROOT)
                or os.path.realpath(ours) != os.path.realpath(cfg["compiler"])
                or not set(cfg["cxx_flags"].split()) <= {"-O1", "-O2", "-O3", "-DNDEBUG"}):
            return None
        for obj in objects:
            with open(obj + ".d") as f:  # "OBJECT: SOURCE HEADER ..." (make syntax)
                text = f.read().replace("\\\n", " ")
            deps = [d.rstrip(":") for d in text.split(":", 1)[1].split()]
            if not deps or os.path.getmtime(obj) < max(map(os.path.getmtime, deps)):
                return None
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return objects


def _build_and_import(bi, info, binding, build_dir, objects=None):
    from torch.utils import cpp_extension

    import flce._ops

    config = info["config"]
    # The kernels and the runtime as build_info.py compiles them (one flag list for every build
    # of the emulation; racecheck: the kernels instrumented for the race detector, no libtsan),
    # unless the C++ tests' CMake build has them (_cmake_objects).
    if objects is None:
        objects = bi["compile_objects"](build_dir, config,
                                        jobs=int(os.environ.get("MAX_JOBS", "2")))
    flags = ([f"-D{d}" for d in info["defines"]] + [f"-I{i}" for i in info["include_dirs"]]
             + [f for f in info["cflags"] if f not in ("-Wall", "-Wextra")]
             + ["-fno-math-errno", "-fno-trapping-math"])
    # ninja relinks on a changed link command, not on newer objects in extra_ldflags: a module
    # older than its kernel objects (recompiled after a touched source, or a copied build) is
    # removed so that it is linked again, never run with other kernels than those built here.
    module = os.path.join(build_dir, f"{NAMESPACE}.so")
    if os.path.exists(module) and os.path.getmtime(module) < max(map(os.path.getmtime, objects)):
        os.remove(module)
    # The ninja of this interpreter's environment (requirements-build.txt's) before any other on
    # PATH: a build directory is copied with its ninja log (_seed), and another ninja version
    # hashes commands differently, so it would recompile every file of the copy.
    _prefer_own_ninja()
    flags += _precompiled_torch_headers(flags)
    cpp_extension.load(
        name=NAMESPACE, sources=binding, extra_cflags=flags,
        # -Bsymbolic: the runtime's own cudaGetLastError & co. must not bind to the libcudart
        # that torch loaded.
        extra_ldflags=objects + info["ldflags"] + ["-Wl,-Bsymbolic"], build_directory=build_dir,
        with_cuda=False, verbose=os.environ.get("FLCE_CUDA_HOST_VERBOSE") == "1")
    if os.path.getmtime(module) < max(map(os.path.getmtime, objects)):
        raise RuntimeError(f"{module} is older than its kernel objects: not relinked")
    if not getattr(load, "_registered", False):
        flce._ops.register(NAMESPACE, lambda t: True)
        load._registered = True
    return getattr(torch.ops, NAMESPACE)


# The torch headers the binding files include: parsing them is ~9 s of each file's ~11 s compile.
PCH_HEADERS = ("ATen/ATen.h", "ATen/core/dispatch/Dispatcher.h", "torch/library.h")


def _precompiled_torch_headers(flags):
    """``-include`` of PCH_HEADERS precompiled by GCC (a directory under build/cuda_host/ per
    compile command, shared by every build, mutant and racecheck copy) for the binding files'
    flags ``flags``, or [] where none can be made. The header is compiled with the binding files'
    own command, read from torch's JIT builder's ninja file of an empty probe module; where GCC
    finds the precompiled header invalid for a file it parses the headers itself (-Winvalid-pch
    says so), so the build is the same either way, only slower."""
    import shlex
    import subprocess

    from torch.utils import cpp_extension

    probe_dir = os.path.join(ROOT, "build", "cuda_host",
                             f"pch-probe-{_digest_text(repr(flags) + torch.__version__)}")
    try:
        with _locked(probe_dir):
            os.makedirs(probe_dir, exist_ok=True)
            empty = os.path.join(probe_dir, "empty.cpp")
            if not os.path.exists(empty):
                open(empty, "w").close()
            cpp_extension.load(name="flce_pch_probe", sources=[empty], extra_cflags=flags,
                               build_directory=probe_dir, with_cuda=False,
                               is_python_module=False, verbose=False)
            cmd = shlex.split(subprocess.run(["ninja", "-t", "commands", "empty.o"], cwd=probe_dir,
                                             check=True, capture_output=True,
                                             text=True).stdout.strip().splitlines()[-1])
    except (OSError, RuntimeError, subprocess.CalledProcessError, IndexError):
        return []
    # (GCC's precompiled headers: its --version names the Free Software Foundation, clang's not)
    if "-c" not in cmd or "-o" not in cmd or "Free Software" not in _compiler_version(cmd[0]):
        return []
    cmd = [f"-DTORCH_EXTENSION_NAME={NAMESPACE}" if a == "-DTORCH_EXTENSION_NAME=flce_pch_probe"
           else a for a in cmd]
    for opt in ("-MF", "-c", "-o"):  # (-MMD -MF dep, -c source, -o object)
        i = cmd.index(opt) if opt in cmd else None
        if i is not None:
            del cmd[i:i + 2]
    cmd = [a for a in cmd if a != "-MMD"]
    # (GCC does not check a precompiled header against the headers it was made of: the key holds
    # torch's version and its headers' install time besides the command)
    aten = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
    stamp = os.path.getmtime(aten) if os.path.exists(aten) else 0
    key = f"{shlex.join(cmd)} {torch.__version__} {stamp}"
    pch_dir = os.path.join(ROOT, "build", "cuda_host", f"pch-{_digest_text(key)}")
    header = os.path.join(pch_dir, "torch_headers.h")
    with _locked(pch_dir):
        if not os.path.exists(header + ".gch"):
            os.makedirs(pch_dir, exist_ok=True)
            with open(header, "w") as f:
                f.write("".join(f"#include <{h}>\n" for h in PCH_HEADERS))
            p = subprocess.run(cmd + ["-x", "c++-header", header, "-o", header + ".gch.tmp"],
                               capture_output=True, text=True)
            if p.returncode != 0:
                return []
            os.replace(header + ".gch.tmp", header + ".gch")
    return ["-Winvalid-pch", "-include", header]


def _compiler_version(cxx):
    import subprocess

    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def _digest_text(text):
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _prefer_own_ninja():
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if os.path.isfile(os.path.join(bindir, "ninja")) and (not path or path[0] != bindir):
        os.environ["PATH"] = os.pathsep.join([bindir] + [p for p in path if p != bindir])


def load_or_skip():
    """load() for a test: where the emulation cannot be built here, skip the test, or (CI:
    FLCE_REQUIRE_CUDA_HOST=1) fail it."""
    import pytest

    try:
        return load()
    except Unavailable as e:
        if os.environ.get("FLCE_REQUIRE_CUDA_HOST") == "1":
            raise
        pytest.skip(f"host-emulated CUDA backend unavailable: {e}")


@contextlib.contextmanager
def routed():
    """The API's ops served by the emulated CUDA backend (built and loaded first) for the block:
    flce._ops.ops, the op namespace every entry point calls, and flce._ops.is_cuda_backend, the
    backend test of its path choices (every tensor then counts as the CUDA backend's), are
    replaced, and restored after. Yields the emulated namespace."""
    import flce._ops

    emulated = load()
    saved = flce._ops.ops, flce._ops.is_cuda_backend
    flce._ops.ops = emulated
    flce._ops.is_cuda_backend = lambda t: True
    try:
        yield emulated
    finally:
        flce._ops.ops, flce._ops.is_cuda_backend = saved
