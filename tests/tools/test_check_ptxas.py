"""scripts/check_ptxas.py on synthetic ptxas -v logs (runs without a GPU or a CUDA build)."""
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "check_ptxas.py")
KERNEL = "_ZN4flce4cuda45_GLOBAL__N__a1b2c3d4_13_flce_grad_cu_5e8f0a1215row_coef_kernelENS0_13RowCoefParamsE"
OTHER = "_ZN2at6native18elementwise_kernelILi128ELi4EEEviT1_"


def _log(kernel, stack=0, spill_st=0, spill_ld=0, regs=48, arch="sm_80"):
    return (f"ptxas info    : Compiling entry function '{kernel}' for '{arch}'\n"
            f"ptxas info    : Function properties for {kernel}\n"
            f"    {stack} bytes stack frame, {spill_st} bytes spill stores, {spill_ld} bytes spill loads\n"
            f"ptxas info    : Used {regs} registers, used 1 barriers, 496 bytes cmem[0]\n")


def _run(tmp_path, text):
    p = tmp_path / "build.log"
    p.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, str(p)], capture_output=True, text=True)


def test_clean_log_passes(tmp_path):
    r = _run(tmp_path, _log(KERNEL) + _log(KERNEL, arch="sm_90a"))
    assert r.returncode == 0, r.stdout
    assert "row_coef_kernel" in r.stdout and "2 kernel builds" in r.stdout


def test_spills_fail(tmp_path):
    r = _run(tmp_path, _log(KERNEL) + _log(KERNEL, spill_st=8, spill_ld=8, arch="sm_100"))
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "sm_100" in r.stdout


def test_stack_frame_fails(tmp_path):
    assert _run(tmp_path, _log(KERNEL, stack=16)).returncode == 1


def test_other_kernels_ignored_and_empty_log_fails(tmp_path):
    # Non-flce kernels (torch's) are not checked; a log without flce kernels is an error.
    assert _run(tmp_path, _log(OTHER, spill_st=64)).returncode == 1
    assert _run(tmp_path, _log(OTHER, spill_st=64) + _log(KERNEL)).returncode == 0


def test_serialized_wgmma_fails(tmp_path):
    # ptxas's advisory that it serialized an flce kernel's WGMMA pipeline fails the build; the
    # same advisory for another library's kernel does not.
    advisory = ("ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions "
                "are serialized due to wgmma pipeline crossing function boundary at a function "
                "call in the function '{}'\n")
    clean = _log(KERNEL, arch="sm_90a")
    r = _run(tmp_path, clean + advisory.format(KERNEL))
    assert r.returncode == 1 and "C7510" in r.stdout, r.stdout
    assert _run(tmp_path, clean + advisory.format(OTHER)).returncode == 0
