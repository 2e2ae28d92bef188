"""Append a gpu_tests record to a gpu.jsonl file from the JUnit XML reports of the GPU script's
pytest steps (benchmarks/gpu/check.sh):

    python benchmarks/gpu/tests_record.py OUT.jsonl junit_a.xml [junit_b.xml ...]

Record: {"op": "gpu_tests", "date", "commit", "run", "device", "driver", "cuda", "torch",
"python", "build", "passed", "failed", "skipped", "reports": {file: [passed, failed, skipped]},
"failures": [test ids]} (errors count as failed; a report that is missing or unreadable, as from
a step cut at its limit, counts as one failure named after it). Prints the record.
"""
import os
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _records  # noqa: E402


def counts(paths):
    """(passed, failed, skipped, failures, per-report counts) of JUnit XML reports."""
    passed = failed = skipped = 0
    failures, reports = [], {}
    for path in paths:
        name = os.path.basename(path)
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            failures.append(f"{name}: no report ({type(e).__name__})")
            failed += 1
            reports[name] = None
            continue
        p = f = s = 0
        for case in root.iter("testcase"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                f += 1
                failures.append(test)
            elif case.find("skipped") is not None:
                s += 1
            else:
                p += 1
        reports[name] = [p, f, s]
        passed, failed, skipped = passed + p, failed + f, skipped + s
    return passed, failed, skipped, failures, reports


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    out, paths = argv[0], argv[1:]
    passed, failed, skipped, failures, reports = counts(paths)
    rec = _records.environment()
    rec.update(op="gpu_tests", passed=passed, failed=failed, skipped=skipped, reports=reports,
               failures=failures[:50])
    _records.append(out, rec)
    print(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
