"""docs/benchmarks.md's result tables are generated from the committed records
(benchmarks/report.py, `python benchmarks/run.py report`): regenerating them must reproduce the
committed doc exactly, so that a new record without the doc's update, or a hand edit of a
generated table, fails here."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import report  # noqa: E402


def test_doc_tables_match_the_committed_records():
    with open(report.DOC) as fh:
        doc = fh.read()
    regenerated = report.render(doc, report.regions())
    assert regenerated == doc, ("docs/benchmarks.md's generated tables differ from "
                                "benchmarks/results/*.jsonl: run `python benchmarks/run.py report`")
    assert report.main(["--check"]) == 0


def test_every_latest_configuration_is_in_the_doc():
    with open(report.DOC) as fh:
        doc = fh.read()
    records = report._records.read(*(os.path.join(report._records.RESULTS, f)
                                     for f in ("gpu.jsonl", "cpu.jsonl")))
    for r in report._records.latest(records):
        assert f"### {r['device']}" in doc
        if r["op"] in ("linear_cross_entropy", "cross_entropy"):
            assert report._shape(r) in doc and f"commit {r['commit']}" in doc


def test_check_reports_a_stale_doc(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- generated:results:begin -->\nold table\n"
                   "<!-- generated:results:end -->\n<!-- generated:train_lm:begin -->\n"
                   "<!-- generated:train_lm:end -->\noutro\n")
    assert report.main(["--doc", str(doc), "--check"]) == 1
    assert "differ" in capsys.readouterr().err
    assert report.main(["--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert "| `flce` |" in text and report.main(["--doc", str(doc), "--check"]) == 0


def test_render_needs_each_region_once():
    with pytest.raises(ValueError, match="exactly one"):
        report.render("no markers", {"results": "x"})
