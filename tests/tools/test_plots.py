"""benchmarks/report.py draws the README's pictures from the committed records (seconds, Agg).

It also checks that the committed records say what the pictures are there to show, so that a
record set that lost them (a collapse that no longer happens, a missing floor) is noticed."""
import os
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import report  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")


def _records(name):
    return report._records.read(os.path.join(RESULTS, name))


def test_committed_records():
    cpu = _records("cpu.jsonl")
    for rec in cpu + _records("gpu.jsonl") + _records("train_lm.jsonl"):
        assert rec["date"] and rec["device"] and rec["commit"], rec.get("op")
    collapse = [r for r in cpu if r["op"] == "collapse"][-1]
    margins = collapse["margins"]
    at = {m: i for i, m in enumerate(margins)}
    # The picture's point: F.cross_entropy's loss is exactly 0 from margin 20 on, flce's keeps
    # fp32-logit accuracy (~1e-7 - 1e-5 relative) while the loss is a normal fp32 number.
    assert all(e == 1.0 for m, e in zip(margins, collapse["rel_err"]["eager"]) if m >= 20)
    assert all(collapse["rel_err"]["flce"][at[m]] < 1e-4 for m in margins if m <= 80)
    # Distillation's: where both models are confident on one class the eager forward KL's loss
    # and student gradient are wrong (relative error >= 1) from margin 20 on; where they are
    # confident on different classes, its JSD's gradient at the student's class is; flce keeps
    # fp32 accuracy wherever the float64 value is an fp32 normal number (what the picture
    # draws).
    dc = [r for r in cpu if r["op"] == "distill_collapse"][-1]
    at = {m: i for i, m in enumerate(dc["margins"])}
    agree, disagree = dc["rel_err"]["agree"], dc["rel_err"]["disagree"]
    for m in (20, 40, 60, 80):
        assert agree["eager-fkl"]["loss"][at[m]] >= 1 and agree["eager-fkl"]["grad"][at[m]] >= 0.99
        assert disagree["eager-jsd"]["grad"][at[m]] >= 0.99
    for case in ("agree", "disagree"):
        for name in ("flce-jsd", "flce-fkl"):
            for what in ("loss", "grad"):
                refs = dc["ref"][case][name[5:]][what]
                errs = [e for e, r in zip(dc["rel_err"][case][name][what], refs)
                        if r >= 2.0 ** -126]
                assert len(errs) >= 17 and max(errs) < 1e-4, (case, name, what)
    speed = report._speed_sets(cpu)
    assert speed and all("gemm3" in r["ms"] and "flce" in r["ms"] for _, rs in speed for r in rs)


def test_draw(tmp_path):
    written = report.draw(str(tmp_path), RESULTS)
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["collapse.png", "distill_collapse.png", "speed_memory.png", "train_lm.png"]
    for path in written:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 20_000
