"""Append a gpu_tests record to a gpu.jsonl file from the JUnit XML reports of the GPU script's
pytest steps (benchmarks/gpu_check.sh):

    python benchmarks/gpu_tests_record.py OUT.jsonl junit_a.xml [junit_b.xml ...]

Record: {"op": "gpu_tests", "date", "device", "torch", "commit", "passed", "failed",
"skipped", "failures": [test ids]} (errors count as failed). Prints the record.
"""
import datetime
import json
import subprocess
import sys
import xml.etree.ElementTree as ET


def counts(paths):
    passed = failed = skipped = 0
    failures = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            failures.append(f"{path}: no report ({type(e).__name__})")
            failed += 1
            continue
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                failures.append(name)
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped, failures


def main(argv):
    out, reports = argv[0], argv[1:]
    import torch

    passed, failed, skipped, failures = counts(reports)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    rec = {"date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "commit": commit, "op": "gpu_tests", "passed": passed,
           "failed": failed, "skipped": skipped, "failures": failures[:50]}
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
