"""Smoke tests of benchmarks/bench.py and benchmarks/demo.py at tiny shapes, so that they cannot
rot. They check the output's structure and the collapse the demo shows, never speed."""
import csv
import math
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH_DIR)

import bench  # noqa: E402
import demo  # noqa: E402

EXPECTED_COLUMNS = ["impl", "device", "dtype", "N", "V", "D", "threads", "repeats", "status",
                    "time_median_s", "time_min_s", "time_max_s", "peak_mem_mb", "peak_total_mb",
                    "time_vs_flce", "mem_vs_flce", "loss", "acc_margin", "loss_rel_err",
                    "time_first_s", "first_vs_median", "load", "loadavg_before", "loadavg_after",
                    "isa", "cpu_gemm", "cpu", "rounds"]


def test_bench_csv(tmp_path, capsys):
    path = tmp_path / "out.csv"
    bench.main(["--device", "cpu", "-N", "64", "-V", "512", "-D", "32", "--repeats", "2",
                "--peers", "chunked", "--acc-V", "512", "--acc-D", "16", "--csv",
                str(path)])
    assert "rel.err" in capsys.readouterr().out
    with open(path, newline="") as fh:
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


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--peers", "eager,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["-N", "0"])


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
