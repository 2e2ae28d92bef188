"""Which GPU code flce is compiled for, and whether it runs on a given GPU.

One parser of TORCH_CUDA_ARCH_LIST for every consumer: setup.py loads this file by path at build
time (so it imports only the standard library at module level), and
``flce.linear_cross_entropy`` calls :func:`check_cuda_device` at run time. The build writes
``python/flce/_build_info.py`` (``INFO = {...}``) with :func:`write_build_info`;
:func:`build_info` reads it back.

Arch names: ``MAJOR.MINOR`` with an optional ``a`` (arch-specific features: wgmma/TMA on 9.0a,
tcgen05 on 10.0a; the cubin runs on exactly that capability) or ``f`` (family-specific, CUDA 12.9+:
runs on the same major version from that minor up) and an optional ``+PTX`` (also embed PTX that
the driver can JIT for newer GPUs). SASS is built for every entry; PTX for the entries marked
``+PTX``, or when none is marked, by FLCE_PTX: ``newest`` (default: the highest entry), ``none``
or ``all``.
"""
import dataclasses
import functools
import os
import re
import subprocess

# Ampere, Hopper (wgmma/TMA need the "a" target), Blackwell datacenter and consumer; PTX of the
# newest so that later GPUs can JIT it.
DEFAULT_ARCH_LIST = "8.0;9.0a;10.0;12.0+PTX"
PTX_POLICIES = ("newest", "none", "all")
DOC = "docs/build.md"

_ARCH_RE = re.compile(r"^(\d+)\.(\d)([af]?)(\+ptx)?$", re.IGNORECASE)
_LOCAL_RE = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")


class ArchError(ValueError):
    """A TORCH_CUDA_ARCH_LIST that cannot be built."""


@dataclasses.dataclass(frozen=True, order=True)
class Arch:
    major: int
    minor: int
    suffix: str = ""  # "", "a" (arch-specific) or "f" (family-specific)
    ptx: bool = dataclasses.field(default=False, compare=False)

    @property
    def name(self):
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def sm(self):
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def compute(self):
        return f"compute_{self.major}{self.minor}{self.suffix}"

    def __str__(self):
        return self.name + ("+PTX" if self.ptx else "")

    def sass_runs_on(self, cap):
        # A cubin runs on its own major version from its minor up; an "a" cubin on exactly its
        # capability. ("f" cubins follow the plain rule within the family.)
        if self.suffix == "a":
            return tuple(cap) == (self.major, self.minor)
        return cap[0] == self.major and cap[1] >= self.minor

    def ptx_runs_on(self, cap):
        # Plain PTX JITs forward to every newer capability; "a"/"f" PTX only where its SASS would.
        if not self.ptx:
            return False
        if self.suffix:
            return self.sass_runs_on(cap)
        return tuple(cap) >= (self.major, self.minor)


def parse_arch_list(text, ptx_policy="newest"):
    """``"8.0;9.0a;10.0+PTX"`` -> sorted, de-duplicated ``[Arch]`` with the PTX policy applied."""
    if ptx_policy not in PTX_POLICIES:
        raise ArchError(f"FLCE_PTX must be one of {PTX_POLICIES}, got {ptx_policy!r}")
    entries = [e for e in re.split(r"[;,\s]+", text or "") if e]
    if not entries:
        raise ArchError(f"TORCH_CUDA_ARCH_LIST is empty; give e.g. {DEFAULT_ARCH_LIST!r}")
    found = {}
    for entry in entries:
        m = _ARCH_RE.match(entry)
        if m is None:
            raise ArchError(
                f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not an arch name: use MAJOR.MINOR with an "
                "optional 'a' or 'f' suffix and '+PTX', e.g. 8.0, 8.6, 8.9, 9.0a, 10.0, 12.0+PTX "
                f"(see {DOC})")
        major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3).lower()
        if suffix == "a" and major < 9:
            raise ArchError(f"TORCH_CUDA_ARCH_LIST entry {entry!r}: arch-specific 'a' targets "
                            "exist from 9.0 on (9.0a, 10.0a, ...)")
        if suffix == "f" and major < 10:
            raise ArchError(f"TORCH_CUDA_ARCH_LIST entry {entry!r}: family 'f' targets exist "
                            "from 10.0 on (10.0f, 12.0f, ...)")
        arch = Arch(major, minor, suffix, bool(m.group(4)))
        found[arch] = arch if arch not in found else Arch(major, minor, suffix,
                                                          arch.ptx or found[arch].ptx)
    archs = sorted(found)
    if not any(a.ptx for a in archs):
        if ptx_policy == "all":
            archs = [dataclasses.replace(a, ptx=True) for a in archs]
        elif ptx_policy == "newest":
            archs[-1] = dataclasses.replace(archs[-1], ptx=True)
    return archs


def format_arch_list(archs):
    return ";".join(str(a) for a in archs)


def gencode_flags(archs):
    """nvcc flags: SASS for every arch, PTX for those marked."""
    flags = [f"-gencode=arch={a.compute},code={a.sm}" for a in archs]
    flags += [f"-gencode=arch={a.compute},code={a.compute}" for a in archs if a.ptx]
    return flags


@functools.lru_cache(maxsize=None)
def nvcc_capabilities(nvcc):
    """(version string, set of sm_XY, set of compute_XY) that this nvcc can build."""
    def run(*args):
        try:
            out = subprocess.run([nvcc, *args], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise ArchError(f"cannot run {nvcc} {' '.join(args)}: {e}") from e
        return out.stdout
    m = re.search(r"release (\d+\.\d+)", run("--version"))
    version = m.group(1) if m else "unknown"
    return version, frozenset(run("--list-gpu-code").split()), frozenset(
        run("--list-gpu-arch").split())


def validate_for_nvcc(archs, nvcc):
    """Raise ArchError naming every arch this nvcc cannot build, before anything compiles."""
    version, codes, computes = nvcc_capabilities(nvcc)
    base = lambda a: f"{a.major}{a.minor}"  # noqa: E731  nvcc lists sm_90, not sm_90a
    bad = []
    for a in archs:
        if a.sm not in codes and f"sm_{base(a)}" not in codes:
            bad.append(f"{a.name} ({a.sm})")
        elif a.ptx and a.compute not in computes and f"compute_{base(a)}" not in computes:
            bad.append(f"{a.name}+PTX ({a.compute})")
        elif a.suffix == "f" and _version_tuple(version) < (12, 9):
            bad.append(f"{a.name} (family targets need CUDA 12.9+)")
    if bad:
        buildable = " ".join(sorted((f"{c[3:-1]}.{c[-1]}" for c in codes if c[3:].isdigit()),
                                    key=lambda s: tuple(map(int, s.split(".")))))
        raise ArchError(
            f"TORCH_CUDA_ARCH_LIST={format_arch_list(archs)!r}: nvcc {version} ({nvcc}) cannot "
            f"build {', '.join(bad)}. This toolkit builds: {buildable} (each also with 'a' from "
            "9.0 on and '+PTX'). Drop the entry, or use a CUDA toolkit that supports it "
            f"(see {DOC}).")
    return version


def _version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2]) or (0, 0)


def local_version(archs, cuda_version):
    """PEP 440 local label: FLCE_LOCAL_VERSION if set ("" for none), else cuXYZ.smAB... or cpu."""
    env = os.environ.get("FLCE_LOCAL_VERSION")
    if env is not None:
        if env and not _LOCAL_RE.match(env):
            raise ArchError(f"FLCE_LOCAL_VERSION={env!r} is not a PEP 440 local label "
                            "(lowercase letters, digits and dots, e.g. cu130.sm90a)")
        return env
    if not archs:
        return "cpu"
    cu = "cu" + "".join(cuda_version.split(".")[:2]) if cuda_version else "cu"
    return ".".join([cu] + [a.sm.replace("_", "") for a in archs])


def write_build_info(path, **fields):
    """Write the build's facts as a module (python/flce/_build_info.py) so that wheels carry them."""
    body = "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(fields.items()))
    text = ('"""Written by setup.py; do not edit, not tracked by git."""\n'
            f"INFO = {{\n{body}}}\n")
    old = None
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if old != text:  # an unchanged file keeps its mtime, so incremental builds stay incremental
        with open(path, "w") as f:
            f.write(text)


# ------------------------------------------------------------------------------------------------
# Run time (these import torch and the built flce._build_info).
# ------------------------------------------------------------------------------------------------
def _info():
    try:
        from ._build_info import INFO
    except ImportError:
        INFO = {"build_system": None}
    return INFO


def _has_cuda_kernels():
    # forward may stay a composite of partial_stats and combine: either one registered for CUDA
    # means the backend is there.
    import torch
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return bool(has("flce::forward", "CUDA") or has("flce::partial_stats", "CUDA"))


def build_info():
    """What this flce was built against and for.

    Keys: ``version`` (with the local label), ``torch`` (the torch built against), ``torch_cuda``
    (that torch's CUDA version), ``cuda`` (the nvcc that compiled flce; None for a CPU-only
    build), ``arch_list`` (the
    normalized TORCH_CUDA_ARCH_LIST compiled; "" for CPU-only), ``sass`` and ``ptx`` (the targets
    embedded), ``cuda_sources`` (CUDA files compiled), ``cuda_backend`` (whether flce's CUDA
    kernels are registered in this process), ``torch_runtime`` (the torch imported now),
    ``build_system``, ``cpu_gemm`` (the CPU backend's tile GEMMs in this process: "onednn",
    oneDNN's micro-kernels, or "blas", the BLAS torch links; see docs/cpu-backend.md),
    ``cpu_amx`` (whether those GEMMs multiply bf16 on AMX, which makes bf16 training take the
    recompute path by default), ``cpu_bf16_native`` (whether they multiply bf16 natively, on
    AMX, AVX512-BF16 or through oneDNN, rather than widened to fp32: where they do, bf16
    gradient tiles are rounded once by default), ``cpu_bf16_grad`` and
    ``cpu_bf16_grad_exact`` (how the CPU backend multiplies bf16 gradient tiles here by default
    and with ``exact_bf16_grad=True``: "rounded", once to bf16, within 1.5x bf16's rounding
    floor; "split" into two bf16 tiles, or "widened" to fp32, both at the floor; see
    docs/numerics.md).
    """
    import torch
    info = dict(_info())
    info["cuda_backend"] = _has_cuda_kernels()
    info["cpu_gemm"] = torch.ops.flce.cpu_gemm_path()
    from . import _ops  # the value read at import, which picks bf16's CPU training path
    info["cpu_amx"] = _ops.CPU_BF16_AMX
    info["cpu_bf16_native"] = torch.ops.flce.cpu_bf16_native()
    info["cpu_bf16_grad"] = torch.ops.flce.cpu_bf16_grad(None)
    info["cpu_bf16_grad_exact"] = torch.ops.flce.cpu_bf16_grad(True)
    info["torch_runtime"] = torch.__version__
    return info


_checked = {}


def _rebuild_hint(cap):
    arch = f"{cap[0]}.{cap[1]}" + ("a" if cap[0] in (9, 10) else "")
    return (f'rebuild for it: TORCH_CUDA_ARCH_LIST="{arch}" FLCE_CUDA=1 pip install '
            f"--no-build-isolation --no-deps . (see {DOC})")


def cuda_device_error(cap, name, device, info, has_kernels):
    """The message for a GPU this build cannot run on, or None when it can."""
    if not has_kernels:
        return (f"flce: the tensors are on {device} ({name}, compute capability "
                f"{cap[0]}.{cap[1]}), but this flce build has no CUDA kernels (arch list "
                f"{info.get('arch_list') or 'none: a CPU-only build'!r}, "
                f"{info.get('cuda_sources', 0)} CUDA sources); {_rebuild_hint(cap)}")
    archs = parse_arch_list(info.get("arch_list") or "", "none") if info.get("arch_list") else []
    if not archs:  # a build without recorded arch facts (an in-place build): trust it
        return None
    if any(a.sass_runs_on(cap) or a.ptx_runs_on(cap) for a in archs):
        return None
    return (f"flce: {device} is an {name} with compute capability {cap[0]}.{cap[1]}, but this "
            f"flce build has GPU code only for TORCH_CUDA_ARCH_LIST={info['arch_list']!r} "
            f"(SASS {', '.join(a.sm for a in archs)}; PTX "
            f"{', '.join(a.compute for a in archs if a.ptx) or 'none'}), none of which runs on "
            f"{cap[0]}.{cap[1]}; {_rebuild_hint(cap)}")


def check_cuda_device(device):
    """Raise a RuntimeError naming the GPU when flce has no code for it (cached per device)."""
    import torch
    if torch.compiler.is_compiling():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    msg = _checked.get(index, False)
    if msg is False:
        cap = tuple(torch.cuda.get_device_capability(index))
        name = torch.cuda.get_device_name(index)
        msg = cuda_device_error(cap, name, f"cuda:{index}", _info(), _has_cuda_kernels())
        _checked[index] = msg
    if msg:
        raise RuntimeError(msg)
