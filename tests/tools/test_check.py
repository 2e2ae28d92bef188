"""`python -m flce.check`, the self-check a user runs after installing flce: on the CPU at its
smallest shapes (the hidden --tiny), so that its code path runs in CI on every commit. One run as
a user runs it (exit 0, every path named, the tables, the records), one with a bug planted in
flce (exit 1 and the wrong paths named, the right ones still passing), and its correctness part
on the host emulation of the CUDA backend (the paths and tolerances a GPU gets)."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import flce

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(flce.__file__)))


def _run(args, tmp_path, script=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PYTHON_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS="1")
    cmd = [sys.executable] + (["-c", script] if script else ["-m", "flce.check"]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(tmp_path))


def test_check_quick_on_cpu(tmp_path):
    out_path = tmp_path / "records.jsonl"
    out_path.write_text('{"op": "an older record"}\n')  # appended to, not replaced
    partial = tmp_path / "partial.json"
    proc = _run(["--quick", "--tiny", "--device", "cpu", "--out", str(out_path), "--partial",
                 str(partial)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "FAIL" not in out
    for path in ("train default fp32", "train single_pass=True fp32",
                 "train recompute (single_pass=False) bf16", "forward only (no grad) bf16",
                 "probability targets fp32", "cross_entropy in place (inplace_backward) bf16",
                 "vocab-parallel (1 rank) train, single pass", "vocab-parallel (1 rank) DTensor weight",
                 "option softcap, single_pass=False", "collapse margins 0-100 bf16, single pass"):
        assert f"ok    {path}  (" in out, path
    assert "correctness: all paths right" in out
    # the tables: the floor, flce and eager with their ratios, the peers' reason
    assert "linear_cross_entropy  N=256 V=4096 D=128  float32" in out
    assert "cross_entropy  N=512 V=4096  float32" in out
    assert "method" in out and "x floor" in out
    assert re.search(r"\(floor: the 3 GEMMs on (torch\.mm|flce tile GEMM)\)", out)
    assert "liger" in out and "measured on CUDA only" in out
    lines = out_path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == {"op": "an older record"}
    ce, lce = (json.loads(line) for line in lines[1:])
    assert lce["complete"] and ce["complete"] and not partial.exists()
    for rec in (lce, ce):
        assert rec["date"] and rec["device"] and rec["torch"] and rec["threads"] >= 1
        assert "commit" in rec and rec["correctness"] == "passed"
        assert rec["build"]["version"] == flce.build_info()["version"]
        assert rec["dtype"] == "float32" and rec["source"] == "python -m flce.check --quick"
    assert (lce["op"], lce["n"], lce["v"], lce["d"]) == ("linear_cross_entropy", 256, 4096, 128)
    assert {"gemm3", "flce", "eager", "gemm1", "fwd_flce"} <= set(lce["ms"])
    # the floor: the faster of the CPU's two GEMM engines, both timed
    assert all(v > 0 for v in lce["ms"].values())
    assert set(lce["gemm3_engines"]) == {"torch.mm", "flce tile GEMM"}
    assert lce["gemm3_engine"] == min(lce["gemm3_engines"], key=lce["gemm3_engines"].get)
    assert lce["vs_floor"]["gemm3"] == 1.0 and lce["vs_floor"]["flce"] > 0
    assert set(lce["skipped"]) == {"liger", "cce"}
    assert (ce["op"], ce["n"], ce["v"]) == ("cross_entropy", 512, 4096)
    assert {"bytes", "flce", "eager"} <= set(ce["ms"]) and ce["copy_gb_s"] > 0


def test_partial_record_after_each_measurement(tmp_path):
    """--partial: what a caller that must cut the run keeps (benchmarks/gpu/check.sh)."""
    from flce import check

    path = tmp_path / "partial.json"
    rec = check.Record(str(path), {"device": "d"}, op="linear_cross_entropy", n=8)
    rec.attempt("flce", lambda: (2.0, 1.0, 3.0, 2 ** 29))
    first = json.loads(path.read_text())
    assert first["complete"] is False and first["device"] == "d" and first["n"] == 8
    assert (first["ms"], first["ms_range"], first["peak_gib"]) == (
        {"flce": 2.0}, {"flce": [1.0, 3.0]}, {"flce": 0.5})
    rec.attempt("eager", lambda: 1 / 0)  # a failure is kept too, and not raised
    assert json.loads(path.read_text())["skipped"] == {"eager": "ZeroDivisionError: division by zero"}


# The single pass's gradients scaled by 1 + 1e-3 on their way out of its backward
# (flce._ops.scale_deferred): a bug far below what a training run would show, far above fp32's
# floor.
PLANTED = textwrap.dedent("""
    import runpy, sys
    import flce._ops as ops
    clean = ops.scale_deferred
    def planted(*args, **kwargs):
        return [g if g is None else g * (1 + 1e-3) for g in clean(*args, **kwargs)]
    ops.scale_deferred = planted
    sys.argv = ["python -m flce.check"] + sys.argv[1:]
    runpy.run_module("flce.check", run_name="__main__", alter_sys=True)
""")


def test_check_names_a_wrong_path(tmp_path):
    proc = _run(["--tiny", "--device", "cpu", "--only", "correctness"], tmp_path,
                script=PLANTED)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-4000:]
    for path in ("train single_pass=True fp32", "option z_loss, single_pass=True",
                 "vocab-parallel (1 rank) train, single pass"):
        assert f"FAIL  {path}: grad input: an element " in out, path
    assert "FAIL  collapse margins 0-100 fp32, single pass: margin 0: target gradient " in out
    # the paths that do not take the single pass are still right
    for path in ("train recompute (single_pass=False) fp32", "forward only (no grad) fp32",
                 "option z_loss, single_pass=False", "cross_entropy fp32"):
        assert f"ok    {path}  (" in out, path
    assert "WRONG on this device: " in proc.stderr and "train single_pass=True fp32" in proc.stderr


def test_check_names_a_wrong_distillation(monkeypatch):
    """Distillation 1e-4 relatively off (loss and gradients) fails each of the check's
    distillation paths, the collapse sweep included, and only those."""
    from flce import check

    right = flce.linear_distillation
    monkeypatch.setattr(flce, "linear_distillation", lambda *a, **k: right(*a, **k) * (1 + 1e-4))
    cases = check.paths("cpu", (24, 259, 32))
    distill = [(n, f) for n, f in cases if n.startswith("distillation")]
    assert len(distill) == 3
    for name, fn in distill:
        with pytest.raises(check.Wrong, match="loss: an element"):
            fn()
    with pytest.raises(check.Wrong, match="margin 0: loss relative error"):
        check.run_distill_collapse("cpu", [0, 50], 16, 64, False, beta=0.1)
    monkeypatch.setattr(flce, "linear_distillation", right)
    for name, fn in distill:
        fn()
    check.run_distill_collapse("cpu", [0, 50], 16, 64, False, beta=0.1)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cuda-host",
                                                 marks=pytest.mark.cuda_host)])
def test_check_on_the_cuda_backend(device, capsys):
    """The check's CUDA paths (the 16-bit gradient tiles' tolerances, the opt-ins, the row
    chunks) on the CUDA backend's launch sequence and kernels, host-emulated (conftest.py routes
    the ops): what the check will hold a GPU to, held to the same code here."""
    from flce import check

    failed = check.correctness(device, quick=True, tiny=True)
    out = capsys.readouterr().out
    assert failed == [], out[-4000:]
    for path in ("train fp32, FLCE_CUDA_OPT_IN=fp64_grad", "probability targets bf16 "
                 "(FLCE_CUDA_OPT_IN=distributions)", "train bf16, row chunks (small "
                 "FLCE_CUDA_WORKSPACE_MB)", "distillation jsd fp32, teacher gradients "
                 "(FLCE_CUDA_OPT_IN=distill)", "distillation collapse margins 0-100 fp32, jsd, "
                 "one class (FLCE_CUDA_OPT_IN=distill)"):
        assert f"ok    {path}  (" in out, path
    assert "exact_bf16_grad" not in out  # the CUDA backend has no exact mode
