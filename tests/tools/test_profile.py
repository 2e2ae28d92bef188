"""benchmarks/profile_step.py on CPU: the trace holds exactly the profiled steps, with flce's ops."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_profile():
    spec = importlib.util.spec_from_file_location("flce_profile_script",
                                                  os.path.join(ROOT, "benchmarks", "profile_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_trace_has_exactly_the_profiled_steps(tmp_path, capsys):
    prof = _load_profile()
    trace = tmp_path / "trace.json"
    args = prof.parse_args(["--device", "cpu", "--n", "64", "--v", "300", "--d", "32", "--dtype",
                            "fp32", "--warmup", "2", "--steps", "3", "--torch-profiler",
                            str(trace), "--peak-tflops", "1"])
    med = prof.run(args)
    assert med > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e.get("name") for e in events if e.get("ph") == "X"]
    assert names.count("profile::step") == 3, "warm-up steps leaked into the trace, or steps lost"
    assert names.count("profile::forward") == 3 and names.count("profile::backward") == 3
    # Which flce ops a step runs depends on the path (forward + backward, or the fused
    # sum_and_grad + scale_grad); every step runs the same ones.
    flce_ops = {n for n in names if n.startswith("flce::")}
    assert flce_ops, "no flce op in the trace"
    for op in flce_ops:
        assert names.count(op) % 3 == 0, (op, names.count(op))
    out = capsys.readouterr().out
    assert "3 profiled steps after 2 warm-up" in out
    assert "4 GEMMs of 2NVD" in out and "stored exp (3 GEMMs)" in out


def test_forward_only_counts_one_gemm(capsys):
    prof = _load_profile()
    prof.run(prof.parse_args(["--device", "cpu", "--n", "16", "--v", "100", "--d", "8",
                              "--dtype", "fp32", "--warmup", "0", "--steps", "1",
                              "--forward-only", "--impl", "torch"]))
    out = capsys.readouterr().out
    assert "1 GEMMs of 2NVD" in out and "forward" in out


@pytest.mark.parametrize("bad", [["--n", "0"], ["--steps", "0"], ["--ignore-frac", "1.5"],
                                 ["--dtype", "fp64"]])
def test_bad_arguments_are_rejected(bad):
    prof = _load_profile()
    with pytest.raises(SystemExit):
        prof.parse_args(["--device", "cpu", *bad])


def test_nvtx_check_compare(tmp_path):
    """benchmarks/gpu/nvtx_check.py's reading of ncu --csv reports (the GPU check's NVTX
    step)."""
    spec = importlib.util.spec_from_file_location(
        "nvtx_check", os.path.join(ROOT, "benchmarks", "gpu", "nvtx_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'

    def report(name, kernels):
        path = tmp_path / name
        path.write_text("==PROF== Connected to process\n" + head + "".join(
            f'"{i}","{k}","gpu__time_duration.sum","ns","100"\n' for i, k in enumerate(kernels)))
        return str(path)

    ours = ["void flce::cuda::row_stats_kernel<float>(...)", "void flce::cuda::combine_kernel<1>()"]
    every = report("all.csv", ours + ["nvjet_tst_gemm", "elementwise_kernel"])
    inside = report("in.csv", ours + ["nvjet_tst_gemm"])
    assert mod.compare(every, inside, report("off.csv", [])) == 0
    assert mod.compare(every, report("in2.csv", ours[:1]), report("off2.csv", [])) == 1
    assert mod.compare(every, inside, report("off3.csv", ours[:1])) == 1
