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

HERE = os.path.dirname(os.path.abspath(__file__))
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
                      "test_options.py", "test_accuracy.py", "test_single_pass.py",
                      "test_cpu_determinism.py",
                      "-k", "not cuda"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads /proc/cpuinfo")
def test_cpu_amx_follows_the_cpu_and_the_isa_caps():
    """build_info()["cpu_amx"] (which picks bf16's CPU training path, flce/api.py) is the
    kernel's amx_bf16 flag, and False in a process whose MKL and oneDNN stop at AVX2 (as
    benchmarks/bench.py --isa avx2 runs them)."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    caps = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    if not any(os.environ.get(v) for v in caps):
        assert flce.build_info()["cpu_amx"] == ("amx_bf16" in flags)
    for var in caps:
        env = dict(os.environ, **{var: "AVX2"})
        r = subprocess.run([sys.executable, "-c",
                            "import flce; print(flce.build_info()['cpu_amx'])"],
                           env=env, cwd=HERE, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == "False", (var, r.stdout)
