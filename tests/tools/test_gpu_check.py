"""benchmarks/gpu/check.sh's control flow on a machine without a GPU, and its record writers.

Each phase runs for real with every command stubbed: a stand-in interpreter (PYTHON) and stub
nvidia-smi / nvcc / ncu / compute-sanitizer on PATH log their calls and fail or hang where told;
benchmarks/gpu/tests_record.py runs for real in its dry-run mode (FLCE_GPU_DRY_RUN=1: no
torch), and `python -m flce.check` has a stand-in that writes its records as the check does (one
per shape, the partial one first). The runs show that the limits of each phase fit its budget,
that a shape's record is appended the moment it is measured (and kept, marked incomplete, when
its step is cut), and that a failed or timed-out step is reported and the next one runs.
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "check.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))

import _records  # noqa: E402
import tests_record  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")

# The stand-in interpreter: logs its arguments, hangs or fails where FAKE_HANG / FAKE_FAIL match,
# writes a JUnit report where pytest would, a stand-in record where `python -m flce.check
# --partial P --out R` would (the partial one first, as the check writes it after its first
# measurement; tests/tools/test_check.py runs the check itself), and hands the record writers
# to the real interpreter.
FAKE_PYTHON = r"""#!/usr/bin/env bash
set -f
sig="$*"
echo "$sig" >>"$FAKE_LOG"
check=0 out= partial= prev=
[[ ${1:-} == -m && ${2:-} == flce.check ]] && check=1
for a in "$@"; do
  [[ $prev == --out ]] && out=$a
  [[ $prev == --partial ]] && partial=$a
  prev=$a
done
shapes=4096,128256,4096 prev=
for a in "$@"; do [[ $prev == --shapes ]] && shapes=$a; prev=$a; done
record() {  # the record of shape $1 (N,V,D), complete or not ($2)
  local n v d
  IFS=, read -r n v d <<<"$1"
  echo '{"op": "linear_cross_entropy", "n": '$n', "v": '$v', "d": '$d','\
    '"commit": "'$FLCE_COMMIT'",'\
    '"run": "'$FLCE_RUN'", "ms": {"gemm3": 1.0, "flce": 1.1}, "complete": '$2'}'
}
((check)) && [[ -n $partial ]] && record "${shapes%%;*}" false >"$partial"
for pat in ${FAKE_HANG:-}; do [[ $sig == *$pat* ]] && exec sleep 60; done
for pat in ${FAKE_FAIL:-}; do [[ $sig == *$pat* ]] && { echo "fake failure: $pat"; exit 3; }; done
if ((check)) && [[ -n $out ]]; then
  IFS=';' read -r -a list <<<"$shapes"
  for shape in "${list[@]}"; do
    [[ -n $partial ]] && record "$shape" false >"$partial"
    [[ $shape == "${FLCE_GPU_DRY_HANG:-}" ]] && exec sleep 60
    record "$shape" true >>"$out" && rm -f "$partial"
    IFS=, read -r n v d <<<"$shape"
    printf '\nlinear_cross_entropy  N=%s V=%s D=%s  bfloat16  (dry run)\nflce 1.1\n' "$n" "$v" "$d"
    printf '(floor: the 3 GEMMs)\n'
  done
fi
junit='<testsuite><testcase classname="t" name="a"/>'
junit+='<testcase classname="t" name="b"><failure/></testcase>'
junit+='<testcase classname="t" name="c"><skipped/></testcase></testsuite>'
for a in "$@"; do
  [[ $a == --junitxml=* ]] && printf '%s' "$junit" >"${a#--junitxml=}"
done
case $1 in
  benchmarks/gpu/tests_record.py) exec "$REAL_PYTHON" "$@" ;;
esac
exit 0
"""
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$FAKE_LOG"
"""


def _plan(phase):
    out = subprocess.run(["bash", SCRIPT, phase, "--plan"], capture_output=True, text=True,
                         timeout=30)
    steps, contingent = {}, {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(?!total )([a-z0-9_]+)\s+(\d+)(\s+contingent)?", line)
        if m:
            (contingent if m.group(3) else steps)[m.group(1)] = int(m.group(2))
    total, budget = map(int, re.search(r"total (\d+) s, budget (\d+) s", out.stdout).groups())
    return out.returncode, steps, contingent, total, budget


@pytest.mark.parametrize("phase", ["headline", "rest"])
def test_plan_fits_the_budget(phase):
    rc, steps, contingent, total, budget = _plan(phase)
    assert rc == 0
    assert total == sum(steps.values()) <= budget <= 300
    if phase == "headline":
        assert {"build", "check", "bench", "test_cuda", "record_tests"} <= set(steps)
    else:
        assert set(contingent) == {"build"}


def test_every_step_is_planned():
    """A step the script runs but no plan lists would escape the budget (the script refuses it
    at run time too)."""
    text = open(SCRIPT).read()
    used = set()
    for line in text.splitlines():
        code = line.split("#")[0]  # (the script has no "#" inside a command)
        used |= set(re.findall(r"(?:^|[\s;!&|])step ([a-z][a-z0-9_]*)\b", code))
    planned = set()
    for phase in ("headline", "rest"):
        _, steps, contingent, _, _ = _plan(phase)
        planned |= set(steps) | set(contingent)
    assert used and used <= planned, used - planned


def _run(tmp_path, phase, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in [("python", FAKE_PYTHON)] + [(n, STUB) for n in (
            "nvidia-smi", "nvcc", "ncu", "compute-sanitizer")]:
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    out, log, wheels = tmp_path / "out", tmp_path / "calls.log", tmp_path / "whl"
    wheels.mkdir(exist_ok=True)
    (wheels / "peer-1.0-py3-none-any.whl").write_text("")
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
                    PYTHON=str(bin_dir / "python"), REAL_PYTHON=sys.executable,
                    FAKE_LOG=str(log), OUT=str(out), FLCE_GPU_DRY_RUN="1",
                    FLCE_COMMIT="abc1234", FLCE_RUN=f"test-{phase}", GPU_CHECK_MAX_LIMIT="20",
                    WHEELS=str(wheels))
    full_env.pop("FLCE_GPU_DRY_HANG", None)
    full_env.update(env)
    proc = subprocess.run(["bash", SCRIPT, phase], capture_output=True, text=True, timeout=120,
                          env=full_env, cwd=tmp_path)
    summary = (out / "summary.txt").read_text().splitlines()
    records = [json.loads(line) for line in (out / "gpu_records.jsonl").read_text().splitlines()]
    calls = log.read_text()
    return proc, summary, records, calls


def _status(summary):
    """{step: (rc, status text)} from summary.txt."""
    out = {}
    for line in summary:
        m = re.match(r"^([a-z0-9_]+)\s+rc=(\d+)\s+\d+s\s+(.*)$", line)
        if m:
            out[m.group(1)] = (int(m.group(2)), m.group(3))
    return out


def test_headline_dry_run(tmp_path):
    proc, summary, records, calls = _run(tmp_path, "headline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = _status(summary)
    _, steps, _, _, _ = _plan("headline")
    assert list(status) == list(steps) and all(rc == 0 for rc, _ in status.values()), summary
    bench = [r for r in records if r["op"] == "linear_cross_entropy"]
    tests = [r for r in records if r["op"] == "gpu_tests"]
    assert len(bench) == 1 and len(tests) == 1 and records[-1] is tests[0]
    assert (bench[0]["n"], bench[0]["v"], bench[0]["d"], bench[0]["complete"]) == \
        (4096, 128256, 4096, True)
    # flce.check: correctness, then the records, each in its own process
    assert "-m flce.check --quick --only correctness" in calls
    assert "-m flce.check --quick --only speed --out " in calls and " --partial " in calls
    assert calls.index("--only correctness") < calls.index("--only speed")
    for r in records:
        assert (r["commit"], r["run"]) == ("abc1234", "test-headline")
    assert (tests[0]["passed"], tests[0]["failed"], tests[0]["skipped"]) == (1, 1, 1)
    assert "setup.py build_ext --inplace" in calls
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "linear_cross_entropy  N=4096 V=128256 D=4096" in table and "(floor: " in table


def test_headline_failures_and_timeouts_do_not_stop_it(tmp_path):
    proc, summary, records, calls = _run(
        tmp_path, "headline", GPU_CHECK_MAX_LIMIT="1",
        FAKE_FAIL="check_ptxas.py --only*correctness",
        FAKE_HANG="tests/cuda/test_cuda.py --only*speed")
    assert proc.returncode == 1
    status = _status(summary)
    assert status["ptxas"][0] == 3 and "FAILED" in status["ptxas"][1]
    assert status["check"][0] == 3  # a wrong path: the records are measured all the same
    assert status["bench"][0] in (124, 137) and "TIMEOUT" in status["bench"][1]
    assert "unfinished record kept" in status["bench"][1]
    assert status["test_cuda"][0] in (124, 137)
    # the steps after each failure ran
    assert status["build"][0] == status["record_tests"][0] == status["profile"][0] == 0
    bench = [r for r in records if r["op"] == "linear_cross_entropy"]
    assert len(bench) == 1 and bench[0]["complete"] is False
    tests = [r for r in records if r["op"] == "gpu_tests"]
    assert tests[0]["failed"] == 1 and "no report" in tests[0]["failures"][0]
    assert not (tmp_path / "out" / "gpu_records.partial").exists()


def test_rest_dry_run(tmp_path):
    proc, summary, records, calls = _run(tmp_path, "rest")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = _status(summary)
    _, steps, _, _, _ = _plan("rest")
    assert list(status) == list(steps) and all(rc == 0 for rc, _ in status.values()), summary
    shapes = [(r["n"], r["v"], r["d"]) for r in records if r["op"] == "linear_cross_entropy"]
    assert shapes == [(16384, 128256, 4096), (4096, 256000, 4096), (16384, 256000, 4096),
                      (4096, 32768, 512)]  # the last one the host CPU's bf16 step
    assert "-m flce.check --device cpu --only speed --dtype bf16" in calls
    assert "--ignore=tests/cuda/test_cuda.py" in calls
    assert "setup.py" not in calls  # the build was found: not rebuilt


def test_rest_without_a_build_and_a_cut_shape(tmp_path):
    proc, summary, records, calls = _run(
        tmp_path, "rest", GPU_CHECK_MAX_LIMIT="1", FAKE_FAIL="cuda_backend",
        FAKE_HANG="gpu/target_check.py", FLCE_GPU_DRY_HANG="4096,256000,4096")
    assert proc.returncode == 1
    status = _status(summary)
    assert status["build_reuse"][0] == 3 and status["build"][0] == 0
    assert any("no CUDA build of flce here" in line for line in summary)
    assert status["target_modes"][0] in (124, 137)
    assert status["memcheck"][0] == status["nvtx"][0] == 0
    bench = [r for r in records if r["op"] == "linear_cross_entropy"]
    # the first shape complete the moment it was measured, the second cut while measured; the
    # steps after it ran (the host CPU's bf16 step last)
    assert [(r["v"], r["n"], r["complete"]) for r in bench] == [(128256, 16384, True),
                                                                (256000, 4096, False),
                                                                (32768, 4096, True)]
    assert sum(r["op"] == "gpu_tests" for r in records) == 1


# ---- the record writers -----------------------------------------------------------------------

def test_commit_from_the_environment_and_without_git(monkeypatch):
    monkeypatch.setenv("FLCE_COMMIT", "0123abc")
    assert _records.commit() == "0123abc"
    monkeypatch.delenv("FLCE_COMMIT")
    monkeypatch.setenv("PATH", "/nonexistent")  # no git binary: None, not FileNotFoundError
    assert _records.commit() is None
    assert _records.driver_version() is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_of_a_checkout_says_dirty(tmp_path, monkeypatch):
    """Every record writer's commit: the checkout's, ``+dirty`` once a tracked file changed
    (an untracked file is not a change); None where there is no checkout."""
    monkeypatch.delenv("FLCE_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "a.txt").write_text("a\n")
    subprocess.run(git + ["add", "a.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "a"], check=True)
    sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, check=True).stdout.strip()
    monkeypatch.setattr(_records, "REPO", str(repo))
    (repo / "untracked.txt").write_text("u\n")
    assert _records.commit() == sha
    (repo / "a.txt").write_text("b\n")
    assert _records.commit() == sha + "+dirty"
    monkeypatch.setattr(_records, "REPO", str(tmp_path))  # no checkout
    assert _records.commit() is None


def test_append_partial_and_finish(tmp_path):
    records, partial = tmp_path / "r.jsonl", tmp_path / "r.partial"
    _records.append(records, {"a": 1})
    _records.write_partial(partial, {"b": 2, "complete": False})
    _records.write_partial(partial, {"b": 3, "complete": False})
    assert json.loads(partial.read_text()) == {"b": 3, "complete": False}
    _records.finish(records, partial, {"b": 3, "complete": True})
    assert not partial.exists()
    assert [json.loads(x) for x in records.read_text().splitlines()] == [
        {"a": 1}, {"b": 3, "complete": True}]
    with pytest.raises(ValueError):  # NaN is not JSON: refused, not written as NaN
        _records.append(records, {"x": float("nan")})
    assert _records.sig(float("nan")) is None and _records.sig(26.0934567) == 26.093


def test_environment_names_the_build(monkeypatch):
    monkeypatch.setenv("FLCE_COMMIT", "0123abc")
    monkeypatch.setenv("FLCE_RUN", "r1")
    monkeypatch.delenv("FLCE_GPU_DRY_RUN", raising=False)
    env = _records.environment()
    assert (env["commit"], env["run"], env["torch"]) == ("0123abc", "r1", torch.__version__)
    assert set(_records.BUILD_KEYS) <= set(env["build"]) and "arch_list" in env["build"]


def test_dry_run_leaves_torch_out():
    """The GPU check's record writers run on the stand-in interpreter's host without torch."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import _records; "
            "env = _records.environment(); print(env['device'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "benchmarks")],
                         capture_output=True, text=True, timeout=60, check=True,
                         env=dict(os.environ, FLCE_GPU_DRY_RUN="1"))
    assert out.stdout.split("\n")[0] == "dry run (no GPU) False"


def test_junit_counts(tmp_path):
    report = tmp_path / "junit.xml"
    ET.ElementTree(ET.fromstring(
        '<testsuites><testsuite><testcase classname="m" name="ok"/>'
        '<testcase classname="m" name="bad"><failure/></testcase>'
        '<testcase classname="m" name="err"><error/></testcase>'
        '<testcase classname="m" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )).write(report)
    passed, failed, skipped, failures, reports = tests_record.counts(
        [str(report), str(tmp_path / "missing.xml")])
    assert (passed, failed, skipped) == (1, 3, 1)
    assert failures[:2] == ["m::bad", "m::err"] and "missing.xml: no report" in failures[2]
    assert reports == {"junit.xml": [1, 2, 1], "missing.xml": None}


@pytest.mark.parametrize("phase", ["headline", "rest"])
def test_the_docs_give_the_plan(phase):
    """docs/profiling.md's table of the phases names every step with its limit."""
    text = open(os.path.join(ROOT, "docs", "profiling.md")).read()
    (row,) = [ln for ln in text.splitlines() if ln.startswith(f"| `{phase}` |")]
    _, steps, contingent, _, _ = _plan(phase)
    for name, limit in {**steps, **contingent}.items():
        assert re.search(rf"\b{name}\b[^|,]*?\b{limit}\b", row) or name in contingent and \
            re.search(rf"\b{name}\b", row), (name, limit)
