"""flce.build_info(), the arch-list handling of setup.py, and the run-time check
that names a GPU this build has no code for (mocked: no GPU needed)."""
import shutil
import stat
import subprocess

import pytest
import torch

import flce
from flce import _build


def test_build_info_describes_this_build():
    info = flce.build_info()
    for key in ("version", "torch", "torch_cuda", "cuda", "arch_list", "sass", "ptx",
                "cuda_sources", "cuda_backend", "torch_runtime", "build_system"):
        assert key in info, key
    assert info["build_system"] == "setuptools", "no _build_info.py was generated"
    assert info["version"].split("+")[0] == flce.__version__
    assert info["torch"] == torch.__version__ == info["torch_runtime"]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert info["cuda_backend"] == (has("flce::forward", "CUDA") or has("flce::partial_stats",
                                                                        "CUDA"))
    if info["cuda"] is None:  # CPU-only build
        assert info["arch_list"] == "" and info["sass"] == [] and not info["cuda_backend"]
    else:
        archs = _build.parse_arch_list(info["arch_list"], "none")
        assert info["sass"] == [a.sm for a in archs]
        assert info["ptx"] == [a.compute for a in archs if a.ptx]


@pytest.mark.parametrize("text, policy, want", [
    ("9.0a", "newest", "9.0a+PTX"),
    ("9.0a", "none", "9.0a"),
    ("10.0;8.0 9.0a,8.0", "newest", "8.0;9.0a;10.0+PTX"),
    ("8.0;9.0a;10.0", "all", "8.0+PTX;9.0a+PTX;10.0+PTX"),
    ("8.0+PTX;9.0a;12.0", "newest", "8.0+PTX;9.0a;12.0"),  # an explicit +PTX overrides
    ("8.6;8.9;12.0f;10.3", "none", "8.6;8.9;10.3;12.0f"),
    ("12.0+ptx", "none", "12.0+PTX"),
])
def test_parse_arch_list_normalizes(text, policy, want):
    assert _build.format_arch_list(_build.parse_arch_list(text, policy)) == want


@pytest.mark.parametrize("text, needle", [
    ("sm_90", "not an arch name"), ("Hopper", "not an arch name"), ("9.0b", "not an arch name"),
    ("8.0a", "from 9.0 on"), ("9.0f", "from 10.0 on"), ("", "empty"), (" ; ", "empty"),
])
def test_parse_arch_list_rejects(text, needle):
    with pytest.raises(_build.ArchError, match=needle):
        _build.parse_arch_list(text)


def test_gencode_flags_sass_for_each_ptx_for_newest():
    flags = _build.gencode_flags(_build.parse_arch_list("8.0;9.0a;10.0"))
    assert flags == ["-gencode=arch=compute_80,code=sm_80",
                     "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_100,code=sm_100",
                     "-gencode=arch=compute_100,code=compute_100"]


def _fake_nvcc(tmp_path, codes, computes, release="12.4"):
    path = tmp_path / "nvcc"
    path.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release {release}, V{release}.1";;
  --list-gpu-code) printf '%s\\n' {' '.join(codes)};;
  --list-gpu-arch) printf '%s\\n' {' '.join(computes)};;
esac
""")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    _build.nvcc_capabilities.cache_clear()
    return str(path)


def test_validate_for_nvcc_names_what_cannot_be_built(tmp_path):
    nvcc = _fake_nvcc(tmp_path, ["sm_75", "sm_80", "sm_86", "sm_90"],
                      ["compute_75", "compute_80", "compute_86", "compute_90"])
    assert _build.validate_for_nvcc(_build.parse_arch_list("8.0;9.0a"), nvcc) == "12.4"
    with pytest.raises(_build.ArchError) as e:
        _build.validate_for_nvcc(_build.parse_arch_list("7.0;9.0a;10.0"), nvcc)
    msg = str(e.value)
    assert "7.0 (sm_70)" in msg and "10.0 (sm_100)" in msg and "9.0a" not in msg.split(
        "cannot build")[1].split("This toolkit")[0]
    assert "nvcc 12.4" in msg and "builds: 7.5 8.0 8.6 9.0" in msg
    with pytest.raises(_build.ArchError, match="family targets need CUDA 12.9"):
        _build.validate_for_nvcc(_build.parse_arch_list("9.0f".replace("9", "10")), _fake_nvcc(
            tmp_path, ["sm_100"], ["compute_100"], release="12.8"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_validate_against_the_real_nvcc():
    nvcc = shutil.which("nvcc")
    _build.nvcc_capabilities.cache_clear()
    version, codes, _ = _build.nvcc_capabilities(nvcc)
    assert "sm_90" in codes  # every toolkit flce supports builds Hopper
    _build.validate_for_nvcc(_build.parse_arch_list("9.0a"), nvcc)
    with pytest.raises(_build.ArchError, match="cannot build 3.5"):
        _build.validate_for_nvcc(_build.parse_arch_list("3.5;9.0a"), nvcc)


@pytest.mark.parametrize("arch, cap, sass, ptx", [
    ("8.0", (8, 0), True, True), ("8.0", (8, 6), True, True), ("8.0", (8, 9), True, True),
    ("8.0", (9, 0), False, True), ("8.6", (8, 0), False, False),
    ("9.0a", (9, 0), True, True), ("9.0a", (10, 0), False, False),
    ("10.0", (10, 3), True, True), ("10.0", (12, 0), False, True),
    ("10.0f", (10, 3), True, True), ("10.0f", (12, 0), False, False),
    ("12.0", (12, 1), True, True),
])
def test_which_code_runs_on_which_gpu(arch, cap, sass, ptx):
    a = _build.parse_arch_list(arch + "+PTX")[0]
    assert a.sass_runs_on(cap) == sass
    assert a.ptx_runs_on(cap) == ptx


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of a chosen capability, and a build of a chosen arch list."""
    calls = []
    state = {"cap": (9, 0), "name": "NVIDIA H100 80GB HBM3", "arch_list": "9.0a+PTX",
             "kernels": True}
    monkeypatch.setattr(_build, "_checked", {})

    def capability(index):
        calls.append(index)
        return state["cap"]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: state["name"])
    monkeypatch.setattr(_build, "_has_cuda_kernels", lambda: state["kernels"])
    monkeypatch.setattr(_build, "_info", lambda: {"arch_list": state["arch_list"],
                                                  "cuda_sources": 2})
    state["calls"] = calls
    return state


def test_mismatched_gpu_raises_a_clear_error(fake_gpu):
    fake_gpu.update(cap=(8, 6), name="NVIDIA GeForce RTX 3090", arch_list="9.0a;10.0+PTX")
    with pytest.raises(RuntimeError) as e:
        _build.check_cuda_device(torch.device("cuda", 1))
    msg = str(e.value)
    for part in ("cuda:1", "NVIDIA GeForce RTX 3090", "compute capability 8.6",
                 "TORCH_CUDA_ARCH_LIST='9.0a;10.0+PTX'", "sm_90a, sm_100", "compute_100",
                 'rebuild for it: TORCH_CUDA_ARCH_LIST="8.6"', "docs/build.md"):
        assert part in msg, (part, msg)
    assert "no kernel image" not in msg


@pytest.mark.parametrize("cap, arch_list, ok", [
    ((9, 0), "9.0a", True), ((8, 9), "8.0;9.0a", True), ((12, 0), "8.0;10.0+PTX", True),
    ((12, 0), "9.0a;10.0", False), ((10, 0), "9.0a+PTX", False), ((7, 5), "8.0+PTX", False),
])
def test_device_check_accepts_exactly_the_runnable_gpus(fake_gpu, cap, arch_list, ok):
    fake_gpu.update(cap=cap, arch_list=arch_list)
    if ok:
        _build.check_cuda_device(torch.device("cuda", 0))
    else:
        with pytest.raises(RuntimeError, match=f"capability {cap[0]}.{cap[1]}"):
            _build.check_cuda_device(torch.device("cuda", 0))


def test_build_without_cuda_kernels_says_so(fake_gpu):
    fake_gpu.update(kernels=False)
    with pytest.raises(RuntimeError, match="has no CUDA kernels.*rebuild for it: "
                       'TORCH_CUDA_ARCH_LIST="9.0a"'):
        _build.check_cuda_device(torch.device("cuda", 0))


def test_device_check_is_cached_per_device(fake_gpu):
    for _ in range(3):
        _build.check_cuda_device(torch.device("cuda", 0))
        _build.check_cuda_device(torch.device("cuda", 2))
    assert fake_gpu["calls"] == [0, 2]


class _OnFakeGpu(torch.Tensor):
    """A CPU tensor that claims to live on cuda:0, to reach the hook without a GPU."""
    is_cuda = property(lambda self: True)
    device = property(lambda self: torch.device("cuda", 0))


def test_linear_cross_entropy_runs_the_check_for_cuda_tensors(fake_gpu):
    fake_gpu.update(cap=(8, 0), name="NVIDIA A100-SXM4-80GB", arch_list="9.0a;10.0")
    x = torch.randn(4, 8).as_subclass(_OnFakeGpu)
    w = torch.randn(16, 8).as_subclass(_OnFakeGpu)
    t = torch.randint(0, 16, (4,)).as_subclass(_OnFakeGpu)
    with pytest.raises(RuntimeError, match="NVIDIA A100-SXM4-80GB with compute capability 8.0"):
        flce.linear_cross_entropy(x, w, t)


def test_cpu_tensors_skip_the_check(monkeypatch):
    def fail(device):
        raise AssertionError("CPU tensors must not query a GPU")
    monkeypatch.setattr(_build, "check_cuda_device", fail)
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    flce.linear_cross_entropy(x, w, torch.randint(0, 16, (4,)))


def test_local_version_label(monkeypatch):
    archs = _build.parse_arch_list("8.0;9.0a;10.0")
    monkeypatch.delenv("FLCE_LOCAL_VERSION", raising=False)
    assert _build.local_version(archs, "13.0") == "cu130.sm80.sm90a.sm100"
    assert _build.local_version([], None) == "cpu"
    monkeypatch.setenv("FLCE_LOCAL_VERSION", "")
    assert _build.local_version(archs, "13.0") == ""
    monkeypatch.setenv("FLCE_LOCAL_VERSION", "cu130.h100")
    assert _build.local_version(archs, "13.0") == "cu130.h100"
    monkeypatch.setenv("FLCE_LOCAL_VERSION", "cu130+sm90")
    with pytest.raises(_build.ArchError, match="PEP 440"):
        _build.local_version(archs, "13.0")


def test_extension_uses_the_process_libstdcxx():
    """flce._C must not carry its own copy of libstdc++'s iostreams: a GPU image's default C++
    compiler (/opt/gcc, CXX) put them into the extension, and the first C++ error message
    holding a number (a bad target's IndexError) crashed the process inside that copy's
    std::ostream::_M_insert<long>. Checked where the extension keeps its symbol table."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on this machine")
    path = flce._ops._C.__file__
    out = subprocess.run([nm, "-C", "--defined-only", path], capture_output=True, text=True,
                         check=True).stdout
    # (Inline header functions, such as clones of operator<<(ostream&, const char*), are
    # normal; the library's own members are not.)
    own = [line for line in out.splitlines()
           if "::_M_insert<" in line or "std::locale::" in line or "std::num_put<" in line
           or "std::codecvt<" in line]
    assert not own, f"{path} defines libstdc++'s stream code: {own[:4]}"
