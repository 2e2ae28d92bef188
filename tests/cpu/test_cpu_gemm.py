"""The CPU backend's two tile-GEMM paths (csrc/cpu/tile_gemm.h): oneDNN's micro-kernels and the
BLAS torch links. A process uses one (flce.build_info()["cpu_gemm"]); the whole suite runs on
that one, and the other runs a selection of the option, accuracy and determinism tests in a
child process (FLCE_CPU_GEMM), so that both are tested on every machine where both run."""
import os
import subprocess
import sys

import pytest
import torch

import flce

# (children run from the suite's root, tests/, so that the paths below name its files)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("blas", "onednn")
SMALL_CALL = ("import torch, flce; "
              "print(flce.linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), "
              "torch.tensor([0, 2])).item()); print(flce.build_info()['cpu_gemm'])")


def _child(path, args, timeout=600):
    env = dict(os.environ, FLCE_CPU_GEMM=path)
    return subprocess.run([sys.executable, *args], env=env, cwd=HERE, capture_output=True,
                          text=True, timeout=timeout)


def _path_in_child(path):
    r = _child(path, ["-c", SMALL_CALL])
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1], r.stderr


def test_build_info_names_the_path():
    assert flce.build_info()["cpu_gemm"] in PATHS


@pytest.mark.parametrize("path", PATHS)
def test_env_selects_the_path(path):
    got, err = _path_in_child(path)
    if path == "onednn" and got == "blas":
        # torch's oneDNN micro-kernels do not run here (no AVX-512, or a torch without them):
        # flce says so and keeps the BLAS path.
        assert "FLCE_CPU_GEMM=onednn" in err
        pytest.skip("oneDNN micro-kernels unavailable on this CPU / torch build")
    assert got == path


def test_env_rejects_an_unknown_path():
    r = _child("mkl", ["-c", SMALL_CALL])
    assert r.returncode != 0
    assert "FLCE_CPU_GEMM must be 'blas' or 'onednn'" in r.stderr


def test_mkldnn_disabled_takes_the_blas_path():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 6, generator=g), torch.randn(7, 6, generator=g)
    t = torch.tensor([0, 3, 6, 1, 2])
    with torch.backends.mkldnn.flags(enabled=False):
        assert flce.build_info()["cpu_gemm"] == "blas"
        xg = x.clone().requires_grad_()
        loss = flce.linear_cross_entropy(xg, w, t)
        loss.backward()
    x64 = x.double().requires_grad_()
    ref = flce.reference.linear_cross_entropy(x64, w.double(), t)
    ref.backward()
    assert torch.allclose(loss.double(), ref, rtol=1e-6)
    assert torch.allclose(xg.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", PATHS)
def test_other_path_passes_option_and_accuracy_tests(path):
    if path == flce.build_info()["cpu_gemm"]:
        pytest.skip(f"{path} is this process's path: the whole suite runs on it")
    if path == "onednn" and _path_in_child(path)[0] != "onednn":
        pytest.skip("oneDNN micro-kernels unavailable on this CPU / torch build")
    r = _child(path, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                      "api/test_options.py", "api/test_accuracy.py", "api/test_single_pass.py",
                      "api/test_bf16_grad.py", "cpu/test_cpu_determinism.py",
                      "-k", "not cuda"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


def _cpuinfo():
    """(vendor, flags) of the first CPU in /proc/cpuinfo."""
    vendor, flags = "", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
            if key.strip() == "flags":
                flags = value.split()
                break
    return vendor, flags


def _bf16_facts(env):
    r = subprocess.run([sys.executable, "-c",
                        "import flce; i = flce.build_info(); "
                        "print(i['cpu_amx'], i['cpu_bf16_native'])"],
                       env=env, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    amx, native = r.stdout.split()[-2:]
    return amx == "True", native == "True"


@pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"),
                    reason="reads x86 flags from /proc/cpuinfo")
def test_cpu_bf16_facts_follow_the_cpu_and_the_isa_caps():
    """build_info()["cpu_amx"] (which picks bf16's CPU training path, flce/api.py) is the
    kernel's amx_bf16 flag, and False in a process whose MKL or oneDNN stops below AMX (as
    benchmarks/run.py linear --isa avx2 runs them; cpu_bf16_native decides whether the backward
    rounds bf16 gradient tiles once by default, csrc/cpu/tile_gemm.h bf16_grad). On the blas path,
    build_info()["cpu_bf16_native"] holds only where MKL multiplies bf16 natively: an Intel CPU
    with AVX512-BF16 or AMX-BF16, and MKL not held below AVX512_E3, its first level with bf16
    (AVX512 and AVX512_E1/E2 have none)."""
    vendor, flags = _cpuinfo()
    amx_cpu = "amx_bf16" in flags
    mkl_bf16_cpu = vendor == "GenuineIntel" and (amx_cpu or "avx512_bf16" in flags)
    caps = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    base = {k: v for k, v in os.environ.items() if k not in caps}
    # (MKL's cap, oneDNN's cap) -> (cpu_amx, cpu_bf16_native on the blas path)
    cases = {
        (None, None): (amx_cpu, mkl_bf16_cpu),
        ("AVX2", None): (False, False),
        (None, "AVX2"): (False, mkl_bf16_cpu),
        ("AVX512", None): (False, False),
        ("AVX512_E2", None): (False, False),
        ("AVX512_E3", None): (False, mkl_bf16_cpu),
        ("AVX512_E4", None): (amx_cpu, mkl_bf16_cpu),
    }
    for (mkl, onednn), expected in cases.items():
        env = dict(base, FLCE_CPU_GEMM="blas")
        if mkl:
            env["MKL_ENABLE_INSTRUCTIONS"] = mkl
        if onednn:
            env["ONEDNN_MAX_CPU_ISA"] = onednn
        assert _bf16_facts(env) == expected, (mkl, onednn)


# Caps that lower the bf16 GEMMs a step (docs/environment.md), and what build_info says below
# them: AMX held off for MKL and oneDNN (bf16 GEMMs on AVX512-BF16 at most, or widened to fp32),
# and an AVX2-only CPU as benchmarks/run.py linear --isa avx2 emulates it (no native bf16).
CAPS = {
    "no-amx": ({"MKL_ENABLE_INSTRUCTIONS": "AVX512_E3", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
               "cpu_amx"),
    "no-native-bf16": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                        "ONEDNN_MAX_CPU_ISA": "AVX2"}, "cpu_bf16_native"),
}
FACTS = ("cpu_amx", "cpu_bf16_native", "cpu_bf16_grad", "cpu_bf16_grad_exact")


@pytest.mark.parametrize("cap", list(CAPS))
def test_bf16_below_each_cap_follows_the_rule_and_passes_the_bf16_tests(cap):
    """The bf16 gradient rule (csrc/cpu/tile_gemm.h bf16_grad) on the CPUs this one can stand
    in for: with AMX held off (AVX512-BF16 alone, the common training CPU: rounded by default,
    widened when exact) and with native bf16 held off (widened either way), each child reports
    its rule in build_info and runs the bf16 option, accuracy, single-pass and exact_bf16_grad
    tests. Skipped where this CPU already lacks what the cap holds off: the whole suite runs
    there as it is."""
    env_cap, fact = CAPS[cap]
    if not flce.build_info()[fact]:
        pytest.skip(f"{fact} is already False here: the whole suite runs that way")
    env = dict(os.environ, **env_cap)
    r = subprocess.run([sys.executable, "-c", "import flce; i = flce.build_info(); "
                        f"print(*(i[k] for k in {FACTS!r}))"],
                       env=env, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    amx, native, grad, grad_exact = r.stdout.split()[-4:]
    assert (amx, grad_exact) == ("False", "widened")
    assert (native, grad) == (("True", "rounded") if cap == "no-amx" else ("False", "widened"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "api/test_options.py", "api/test_accuracy.py", "api/test_single_pass.py",
                        "api/test_bf16_grad.py",
                        "-k", "(bfloat16 or bf16 or dtype1) and not cuda"],
                       env=env, cwd=HERE, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


@pytest.mark.parametrize("trans", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_benchmark_gemm_op(dtype, trans):
    """flce::cpu_tile_gemm, the tile-GEMM engine as benchmarks/_peers.py times it for the floor:
    op(a) @ op(b) in fp32 on odd shapes (an odd k pads bf16 pairs; rows and columns cut across
    workers and 64-wide blocks), within fp32 accumulation's error of the float64 product, and
    a clear error for operands that do not fit."""
    ta, tb = trans
    m, n, k = 300, 203, 131
    g = torch.Generator().manual_seed(7)
    a = torch.randn((k, m) if ta else (m, k), generator=g).to(dtype)
    b = torch.randn((n, k) if tb else (k, n), generator=g).to(dtype)
    c = torch.ops.flce.cpu_tile_gemm(a, b, trans_a=ta, trans_b=tb)
    ref = (a.double().T if ta else a.double()) @ (b.double().T if tb else b.double())
    assert c.dtype == torch.float32 and c.shape == (m, n)
    # 16-bit products are exact in fp32: only the sum rounds, ~sqrt(k) eps_fp32 relative
    assert ((c.double() - ref).norm() / ref.norm()).item() < 2e-6
    with pytest.raises(ValueError, match=r"op\(a\) is \[300, 131\] but op\(b\) is"):
        torch.ops.flce.cpu_tile_gemm(a, (b[:, :-1] if tb else b[:-1]).contiguous(), trans_a=ta,
                                     trans_b=tb)
