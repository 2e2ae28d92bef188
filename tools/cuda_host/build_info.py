#!/usr/bin/env python3
"""Sources and flags of the flce host SIMT emulation, for any build system.

The emulation compiles the unchanged CUDA kernels (csrc/cuda/*.cu) as host C++ together with the
runtime of tools/cuda_host/host. Three configurations:

  plain      kernels and runtime at -O2
  racecheck  the kernel TUs also with -fsanitize=thread: the instrumentation calls the runtime's
             shared-memory race detector (racecheck.cpp). Link WITHOUT -fsanitize=thread: libtsan
             must not be linked, the runtime supplies the __tsan_* callbacks.
  asan       everything with -fsanitize=address,undefined (link with the same flag)

From Python (e.g. a torch extension's setup):

    import runpy
    bi = runpy.run_path("tools/cuda_host/build_info.py")
    info = bi["build_info"]("racecheck")          # dict, see build_info()
    objects = bi["compile_objects"]("build/emu", "racecheck")   # compiled with g++

CLI: build_info.py json [config]  |  build_info.py cmake   (CMake `set()` lines, all configs;
used by tests/cuda_host/CMakeLists.txt, so CMake and other builds share this one list).
"""
import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
CONFIGS = ("plain", "racecheck", "asan")

RUNTIME_SOURCES = ["runtime.cpp", "racecheck.cpp", "fiber.cpp"]
# The defines torch.utils.cpp_extension gives every .cu file (the nvcc build uses them too).
DEFINES = [
    "FLCE_CUDA_HOST",
    "__CUDA_NO_HALF_OPERATORS__",
    "__CUDA_NO_HALF_CONVERSIONS__",
    "__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "__CUDA_NO_HALF2_OPERATORS__",
]
# -fno-strict-aliasing: GPU code type-puns freely (float4 loads of float arrays, shared memory
# reinterpreted per stage), which nvcc compiles as intended and g++'s type-based alias analysis
# need not. -g1: line tables, for the source locations in error reports.
COMMON_CFLAGS = ["-std=c++20", "-fPIC", "-fno-strict-aliasing", "-g1", "-Wall", "-Wextra",
                 "-Wno-unknown-pragmas"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer"]


def cuda_include_dir():
    """The CUDA toolkit's include directory (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h), or None."""
    candidates = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    candidates += ["/usr/local/cuda"]
    for c in candidates:
        if not c:
            continue
        inc = os.path.join(c, "include")
        if all(os.path.isfile(os.path.join(inc, h))
               for h in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h")):
            return inc
    return None


def build_info(config="plain"):
    """Everything needed to compile and link the emulated kernels plus runtime.

    Keys: runtime_sources, kernel_sources (absolute paths), include_dirs, defines, cflags (all
    TUs), kernel_cflags (the .cu files; includes "-x c++"), runtime_cflags, ldflags, config.
    Code that includes host/runtime.h or device.cuh needs include_dirs and defines.
    """
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    inc = cuda_include_dir()
    if inc is None:
        raise FileNotFoundError("CUDA headers not found (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h):"
                                " set CUDA_HOME")
    host = os.path.join(HERE, "host")
    opt = ["-O1"] if config == "asan" else ["-O2"]
    sanitize = SANITIZE if config == "asan" else []
    return {
        "config": config,
        "runtime_sources": [os.path.join(host, s) for s in RUNTIME_SOURCES],
        # Every kernel file of csrc/cuda (the binding's .cpp files are not).
        "kernel_sources": sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))),
        "include_dirs": [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc"),
                         os.path.join(ROOT, "csrc", "cuda"), HERE, inc],
        "defines": list(DEFINES),
        "cflags": COMMON_CFLAGS + opt,
        "kernel_cflags": ["-x", "c++"] + (["-fsanitize=thread"] if config == "racecheck" else [])
                         + sanitize,
        "runtime_cflags": list(sanitize),
        "ldflags": list(sanitize),
    }


def compile_command(info, source, output, kernel, compiler="g++", extra=()):
    flags = info["cflags"] + (info["kernel_cflags"] if kernel else info["runtime_cflags"])
    return ([compiler] + [f"-D{d}" for d in info["defines"]]
            + [f"-I{i}" for i in info["include_dirs"]] + flags + list(extra)
            + ["-c", source, "-o", output])


def compile_objects(build_dir, config="plain", compiler="g++", jobs=2, extra_cflags=()):
    """Compile runtime and kernels into build_dir/<config>/; returns the object paths (newer
    objects are reused). Link them with info["ldflags"] (never -fsanitize=thread)."""
    info = build_info(config)
    out_dir = os.path.join(build_dir, config)
    os.makedirs(out_dir, exist_ok=True)
    jobs_list = []
    for src in info["runtime_sources"] + info["kernel_sources"]:
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        kernel = src in info["kernel_sources"]
        jobs_list.append((compile_command(info, src, obj, kernel, compiler, extra_cflags), src, obj))

    def run(job):
        cmd, src, obj = job
        if os.path.exists(obj) and os.path.getmtime(obj) >= os.path.getmtime(src):
            return obj
        subprocess.run(cmd, check=True)
        return obj

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        return list(ex.map(run, jobs_list))


def _cmake():
    inc = cuda_include_dir()
    lines = [f"set(FLCE_HOST_CUDA_INCLUDE \"{inc or ''}\")"]
    if inc is None:
        return "\n".join(lines) + "\n"
    q = lambda xs: " ".join('"%s"' % x.replace("\\", "/") for x in xs)  # noqa: E731
    base = build_info("plain")
    lines += [f"set(FLCE_HOST_RUNTIME_SOURCES {q(base['runtime_sources'])})",
              f"set(FLCE_HOST_KERNEL_SOURCES {q(base['kernel_sources'])})",
              f"set(FLCE_HOST_INCLUDE_DIRS {q(base['include_dirs'])})",
              f"set(FLCE_HOST_DEFINES {q(base['defines'])})"]
    for c in CONFIGS:
        info = build_info(c)
        for key in ("cflags", "kernel_cflags", "runtime_cflags", "ldflags"):
            lines.append(f"set(FLCE_HOST_{c.upper()}_{key.upper()} {q(info[key])})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "json"
    if mode == "cmake":
        sys.stdout.write(_cmake())
    elif mode == "json":
        print(json.dumps(build_info(sys.argv[2] if len(sys.argv) > 2 else "plain"), indent=2))
    else:
        sys.exit(f"usage: {sys.argv[0]} json [config] | cmake")
