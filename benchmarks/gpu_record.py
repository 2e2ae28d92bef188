"""Records of a GPU run (benchmarks/results/gpu.jsonl's format), shared by the scripts that
benchmarks/gpu/check.sh drives.

A record stands alone: it names the commit (FLCE_COMMIT, since the device gets no .git and may
have no git), the run (FLCE_RUN: one id per gpu/check.sh call, so that records of the same call
can be compared), the device, its driver, CUDA, torch, Python and what flce was built with
(flce.build_info(): the arch list). Records are appended one line at a time and
flushed to disk at once, so that a step cut at its limit keeps every record written before the
cut. A measurement in progress lives in a partial file (`write_partial`): the complete record is
appended when it is done, and gpu/check.sh appends the partial one (``"complete": false``) when
the step that was writing it dies.

FLCE_GPU_DRY_RUN=1 (tests/tools/test_gpu_check.py: the control flow of gpu/check.sh on a machine
without a GPU) leaves torch out: the environment is a stand-in that says so.
"""
import datetime
import json
import os
import shutil
import subprocess
import sys


def dry_run():
    """True under FLCE_GPU_DRY_RUN=1: no torch, no GPU, stand-in measurements."""
    return os.environ.get("FLCE_GPU_DRY_RUN") == "1"


def commit():
    """The commit measured: FLCE_COMMIT, else `git rev-parse --short HEAD` where git and a
    checkout are there, else None (never an exception: the device has no .git)."""
    env = os.environ.get("FLCE_COMMIT", "").strip()
    if env:
        return env
    git = shutil.which("git")
    if git is None:
        return None
    try:
        out = subprocess.run([git, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def driver_version():
    """The NVIDIA driver's version (nvidia-smi), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


# flce.build_info()'s keys that say what was measured (the rest describe the CPU backend).
BUILD_KEYS = ("version", "torch", "cuda", "arch_list", "sass", "cuda_backend")


def environment():
    """The fields every record carries besides its own: date, commit, run, device, driver,
    CUDA, torch, Python and flce's build."""
    rec = {"date": datetime.date.today().isoformat(), "commit": commit(),
           "run": os.environ.get("FLCE_RUN") or None,
           "python": ".".join(map(str, sys.version_info[:3]))}
    if dry_run():
        rec.update(device="dry run (no GPU)", driver=None, cuda=None, torch=None,
                   build={"dry_run": True})
        return rec
    import torch

    rec.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               driver=driver_version(), cuda=torch.version.cuda, torch=torch.__version__)
    try:
        import flce

        info = flce.build_info()
        rec["build"] = {k: info.get(k) for k in BUILD_KEYS}
    except Exception as e:  # noqa: BLE001  (a record without the build beats no record)
        rec["build"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return rec


def append(path, rec):
    """Append ``rec`` as one JSON line to ``path`` and flush it to disk."""
    line = json.dumps(rec, allow_nan=False) + "\n"
    with open(path, "a") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def write_partial(path, rec):
    """Replace the partial record at ``path`` (atomically: a reader sees the old or the new
    one, never half of one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(rec, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def finish(records, partial, rec):
    """The measurement is complete: append ``rec`` to ``records``, drop the partial file."""
    append(records, rec)
    if partial and os.path.exists(partial):
        os.remove(partial)


def sig(x, digits=5):
    """JSON-safe float to ``digits`` significant digits; None for None, NaN and inf."""
    if x is None:
        return None
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        return None
    return float(f"{x:.{digits}g}")
