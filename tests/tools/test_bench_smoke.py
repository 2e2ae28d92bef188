"""Smoke tests of the benchmark entry point (benchmarks/run.py) and benchmarks/demo.py at tiny
shapes, so that they cannot rot. They check the output's structure, the progress lines, the
records and the collapse the demo shows, never speed."""
import csv
import io
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench  # noqa: E402
import demo  # noqa: E402
import run  # noqa: E402
from _records import Progress  # noqa: E402

EXPECTED_COLUMNS = ["impl", "device", "dtype", "N", "V", "D", "threads", "repeats", "status",
                    "time_median_s", "time_min_s", "time_max_s", "peak_mem_mb", "peak_total_mb",
                    "time_vs_flce", "mem_vs_flce", "loss", "acc_margin", "loss_rel_err",
                    "time_first_s", "first_vs_median", "load", "loadavg_before", "loadavg_after",
                    "isa", "cpu_gemm", "cpu", "rounds"]


def test_run_linear_end_to_end(tmp_path):
    """`run.py linear` as a user runs it: progress lines per child, the table, a CSV, and one
    record per configuration appended to the --record file."""
    csv_path, rec_path = tmp_path / "out.csv", tmp_path / "records.jsonl"
    rec_path.write_text('{"op": "an older record", "date": "x"}\n')  # appended to, not replaced
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "run.py"), "linear", "--device", "cpu",
         "--shapes", "64x512x32", "--repeats", "2", "--peers", "chunked", "--acc-V", "512",
         "--acc-D", "16", "--csv", str(csv_path), "--record", str(rec_path)],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # A line as each child starts and ends, counted, with the elapsed time; an ETA while some
    # are left.
    assert "[1/2 0:00:" in out and "cpu fp32 N=64 V=512 D=32: flce ..." in out
    assert "cpu fp32 N=64 V=512 D=32: chunked: " in out and "(ETA 0:" in out
    assert "rel.err" in out and f"record appended to {rec_path}" in out
    lines = rec_path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["op"] == "an older record"
    rec = json.loads(lines[1])
    assert rec["op"] == "linear_cross_entropy" and rec["device"] and rec["date"]
    assert "commit" in rec and rec["torch"] and rec["threads"] >= 1
    assert (rec["dtype"], rec["n"], rec["v"], rec["d"]) == ("float32", 64, 512, 32)
    assert set(rec["ms"]) == {"flce", "chunked"} and all(t > 0 for t in rec["ms"].values())
    assert rec["loss_rel_err_m40"]["chunked"] == 1.0 and rec["loss_rel_err_m40"]["flce"] < 1e-3
    assert rec["source"].startswith("benchmarks/run.py linear --device cpu")
    with open(csv_path, newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == EXPECTED_COLUMNS
        rows = {r["impl"]: r for r in reader}
    # Two children only (each imports torch); the demo test runs the eager peer.
    assert list(rows) == ["flce", "chunked"]
    for r in rows.values():
        assert r["status"] == "ok", r
        assert float(r["time_min_s"]) <= float(r["time_median_s"]) <= float(r["time_max_s"])
        assert float(r["time_first_s"]) > 0 and r["isa"] and r["cpu"]
        assert 0 <= float(r["peak_mem_mb"]) < float(r["peak_total_mb"])
        assert math.isfinite(float(r["time_vs_flce"])) and math.isfinite(float(r["mem_vs_flce"]))
        assert abs(float(r["acc_margin"]) - 40) < 0.1
        # Every implementation computes the same loss on the same random batch.
        assert float(r["loss"]) == pytest.approx(float(rows["flce"]["loss"]), rel=1e-4)
    assert float(rows["flce"]["time_vs_flce"]) == 1.0
    assert rows["flce"]["cpu_gemm"] in ("blas", "onednn") and rows["chunked"]["cpu_gemm"] == ""
    # At margin 40 the usual formula returns exactly 0 (relative error 1); flce does not.
    assert float(rows["flce"]["loss_rel_err"]) < 1e-3
    assert float(rows["chunked"]["loss_rel_err"]) == 1.0


def test_run_ce_end_to_end(tmp_path):
    """`run.py ce`: a child process per implementation, its progress lines, the table, and the
    configuration's record appended (complete, its partial file gone)."""
    rec_path = tmp_path / "records.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "run.py"), "ce", "--device", "cpu", "--shapes",
         "64x512", "--dtypes", "fp32", "--impls", "flce,eager", "--repeats", "1", "--warmup",
         "1", "--record", str(rec_path)], capture_output=True, text=True, timeout=600,
        cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/2 0:00:" in proc.stdout and "cpu [64, 512] fp32: eager: " in proc.stdout
    assert "margin-40 err" in proc.stdout
    (rec,) = [json.loads(line) for line in rec_path.read_text().splitlines()]
    assert (rec["op"], rec["n"], rec["v"], rec["dtype"], rec["complete"]) == (
        "cross_entropy", 64, 512, "float32", True)
    assert rec["threads"] >= 1 and rec["device"] and not rec["errors"]
    assert set(rec["ms"]) == {"flce", "eager", "bytes"} and all(t > 0 for t in rec["ms"].values())
    assert rec["margin40_rel_err"]["eager"] == 1.0 and rec["margin40_rel_err"]["flce"] < 1e-3
    assert not os.path.exists(f"{rec_path}.partial")


def test_run_distill_end_to_end(tmp_path):
    """`run.py distill`: flce.linear_distillation first, its peers and the 5-GEMM floors on the
    same student and teacher (every divergence's loss equal to flce's), and the
    ``linear_distillation`` record."""
    rec_path = tmp_path / "records.jsonl"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "run.py"), "distill", "--device", "cpu", "-N",
         "48", "-V", "384", "-D", "16", "--repeats", "1", "--peers", "eager-jsd,gemm5",
         "--record", str(rec_path)], capture_output=True, text=True, timeout=600,
        cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "flce benchmark, distillation: flce-jsd, eager-jsd, gemm5, gemm5-flce" in out
    assert "the step's 5 GEMMs" in out and "rel.err" not in out
    (rec,) = [json.loads(line) for line in rec_path.read_text().splitlines()]
    assert (rec["op"], rec["n"], rec["v"], rec["d"], rec["beta"]) == (
        "linear_distillation", 48, 384, 16, 0.5)
    assert set(rec["ms"]) == {"flce-jsd", "eager-jsd", "gemm5", "gemm5-flce"}
    assert set(rec["peak_gib"]) == {"flce-jsd", "eager-jsd"} and rec["grad_gib"] > 0
    assert rec["floor"] in ("gemm5", "gemm5-flce") and "skipped" not in rec
    assert rec["source"].startswith("benchmarks/run.py distill --device cpu")
    losses = {ln.split()[0]: float(ln.split()[-1]) for ln in out.splitlines()
              if ln.split()[:1] in (["flce-jsd"], ["eager-jsd"])}
    assert losses["flce-jsd"] > 0.01
    assert losses["flce-jsd"] == pytest.approx(losses["eager-jsd"], rel=1e-4)


def test_distill_peers_agree():
    """Every distillation implementation of the benchmark computes the same loss and student
    gradient on one batch (the floors: the GEMMs' gradients on both engines)."""
    import torch

    x, w, t = bench._peers.random_batch(32, 256, 16, torch.float32, "cpu")
    names = [n for n in bench._peers.DISTILL if bench._peers.available(n) is None]
    got = {}
    for name in names:
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = bench._peers.make_impl(name, "cpu")(xg, wg, t)
        loss.backward()
        got[name] = (float(loss.detach()), wg.grad)
    for a, b in (("flce-jsd", "eager-jsd"), ("flce-fkl", "eager-fkl"), ("gemm5", "gemm5-flce"),
                 ("flce-jsd", "liger-jsd")):
        if b in got:
            assert got[a][0] == pytest.approx(got[b][0], rel=1e-5, abs=1e-30), (a, b)
            assert torch.allclose(got[a][1], got[b][1], rtol=1e-4, atol=1e-7), (a, b)
    assert got["flce-jsd"][0] != pytest.approx(got["flce-fkl"][0], rel=1e-3)
    args = bench.parse_args(["--device", "cpu"], distill=True)
    assert args.impls[0] == "flce-jsd" and args.impls[-2:] == ["gemm5", "gemm5-flce"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "chunked"], distill=True)


def test_distill_collapse_record():
    """`run.py collapse --distill` at margins 0 and 40: where the models agree, the eager
    formula's forward KL returns a wrong loss and no gradient at the student's class (1 - p
    rounds to 0); where they disagree, its JSD gradient there is lost likewise. flce keeps fp32
    accuracy in both."""
    rec = run.distill_collapse_record(v=256, d=16, n=4, margins=(0, 40))
    assert rec["op"] == "distill_collapse" and rec["margins"] == [0, 40]
    for case in ("agree", "disagree"):
        for name in ("flce-jsd", "flce-fkl"):
            assert max(rec["rel_err"][case][name]["loss"]) < 1e-4, (case, name)
            assert max(rec["rel_err"][case][name]["grad"]) < 1e-4, (case, name)
        assert all(r > 2.0 ** -126 for k in ("jsd", "fkl") for r in rec["ref"][case][k]["grad"])
    eager = rec["rel_err"]["agree"]["eager-fkl"]
    assert eager["loss"][0] < 1e-4 and eager["loss"][1] > 0.5 and eager["grad"][1] > 0.5
    assert rec["rel_err"]["disagree"]["eager-jsd"]["grad"][1] > 0.5


def test_floor_is_the_faster_engine():
    """On the CPU `linear` times the 3 GEMMs on torch.mm (gemm3) and on flce's tile GEMMs
    (gemm3-flce); the table's and the record's floor is the faster of those that ran, named."""
    args = bench.parse_args(["--device", "cpu", "--peers", "eager,gemm3"])
    assert args.impls == ["flce", "eager", "gemm3", "gemm3-flce"]
    assert bench.parse_args(["--device", "cpu", "--peers", "eager"]).impls == ["flce", "eager"]
    assert bench.skip_reason("gemm3-flce", bench.parse_args(["--device", "cpu"])) is None

    def row(impl, s, status="ok"):
        return {"impl": impl, "status": status, "time_median_s": s, "time_min_s": s,
                "time_max_s": s, "time_first_s": s, "first_vs_median": 1.0, "peak_mem_mb": 1.0,
                "peak_total_mb": 2.0, "loss": 1.0, "threads": 2, "loadavg_before": 0.5,
                "loadavg_after": 0.5}
    for times, floor in (((2.0, 1.0), "gemm3-flce"), ((1.0, 2.0), "gemm3")):
        rows = [row("flce", 1.5), row("gemm3", times[0]), row("gemm3-flce", times[1])]
        assert bench.floor_row(rows)["impl"] == floor
        table = bench.format_table(rows, args)
        assert f"here {floor}." in table and "x floor" in table
        flce_line = next(ln for ln in table.splitlines() if ln.startswith("flce "))
        assert flce_line.split()[3] == "1.50"  # 1.5 s over the 1.0 s floor
        rec = bench.record(rows, args)
        assert rec["floor"] == floor and set(rec["peak_gib"]) == {"flce"}
    rows = [row("flce", 1.5), row("gemm3", 0.0, "failed: x"), row("gemm3-flce", 3.0)]
    assert bench.floor_row(rows)["impl"] == "gemm3-flce"
    # what did not run, under the name flce.check's and `run.py ce`'s records give it
    assert bench.record(rows, args)["skipped"] == {"gemm3": "failed: x"}
    assert bench.floor_row([row("flce", 1.5)]) is None


def test_run_subcommands(capsys):
    assert run.main([]) == 2 and "linear" in capsys.readouterr().out
    assert run.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err
    assert set(run.COMMANDS) >= {"linear", "ce", "accuracy", "parallel", "gpu-check", "profile",
                                 "plots", "report", "collapse", "demo", "distill"}


def test_run_gpu_check_plan(capfd):
    """`run.py gpu-check` hands its arguments to benchmarks/gpu/check.sh."""
    assert run.main(["gpu-check", "headline", "--plan"]) == 0
    assert "budget" in capfd.readouterr().out


def test_progress_lines():
    now = [0.0]
    out = io.StringIO()
    p = Progress(3, out=out, clock=lambda: now[0])
    p.start("a")
    now[0] = 10.0
    p.done("1 s")
    p.start("b")
    now[0] = 30.0
    p.done("2 s")
    assert out.getvalue().splitlines() == [
        "[1/3 0:00:00] a ...", "[1/3 0:00:10] a: 1 s (ETA 0:00:20)",
        "[2/3 0:00:10] b ...", "[2/3 0:00:30] b: 2 s (ETA 0:00:15)"]


def test_linear_configurations():
    args = bench.parse_args(["--device", "cpu", "--dtype", "fp32,bf16", "--shapes",
                             "8x16x4,32x64x8"])
    cfgs = bench.configurations(args)
    assert [(c.dtype, c.N, c.V, c.D) for c in cfgs] == [
        ("fp32", 8, 16, 4), ("fp32", 32, 64, 8), ("bf16", 8, 16, 4), ("bf16", 32, 64, 8)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "fp33"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "8x16"])


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--peers", "eager,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["-N", "0"])
    with pytest.raises(SystemExit):  # (not a ValueError from int(""))
        bench.ce_main(["--shapes", "4096x"])
    assert "--shapes: NxV,NxV,... of integers >= 1, got '4096x'" in capsys.readouterr().err


def test_liger_on_cpu_refused_at_large_shapes(monkeypatch):
    monkeypatch.setattr(bench._peers, "available", lambda name: None)  # as if installed
    big = bench.parse_args(["--device", "cpu", "--peers", "liger"])
    assert "interpreter" in bench.skip_reason("liger", big)
    small = bench.parse_args(["--device", "cpu", "--peers", "liger", "-N", "64", "-V", "512"])
    assert bench.skip_reason("liger", small) is None


def test_demo_quick(capsys):
    out = demo.main(["--device", "cpu", "--quick"])
    text = capsys.readouterr().out
    assert "(i) Collapse" in text and "(ii) Gradient" in text and "(iii) Cost" in text
    table = out["collapse"]
    assert set(table) == set(demo.MARGINS)
    for m, row in table.items():
        ref_loss, ref_grad = row["ref"]
        loss, grad = row["flce"]
        assert loss > 0 and grad < 0
        if ref_loss > 1e6 * demo.FP32_TINY:  # normal fp32 range: m <= 50
            assert loss == pytest.approx(ref_loss, rel=1e-3)
            assert grad == pytest.approx(ref_grad, rel=1e-3)
        if m >= 30:
            assert row["eager"] == (0.0, 0.0)
            assert row["chunked"] == (0.0, 0.0)
    for name, r in out["grad"].items():
        assert r["dC"] > 0 and r["dE"] > 0 and math.isfinite(r["dC"]), name
    for name, r in out["speed"].items():
        assert "error" not in r, (name, r)
        assert r["time_median_s"] > 0
