"""Result records: one JSON object per line in benchmarks/results/*.jsonl, written by every
benchmark here and by the GPU check's scripts (benchmarks/gpu/).

Every record stands alone: ``date``, ``device``, ``torch``, ``commit`` (``+dirty`` when the
checkout had uncommitted changes to tracked files; ``FLCE_COMMIT`` overrides, for a machine
without the .git, as the GPU machine is), ``threads`` (CPU), ``op`` (what was measured) and the
measurement's own fields. ``source`` says which command wrote it, or, for a record transcribed
from an older document, where from. A GPU record (``environment``) also names the run
(``FLCE_RUN``: one id per benchmarks/gpu/check.sh call, so that records of the same call can be
compared), the driver, CUDA, Python and what flce was built with (flce.build_info(): the arch
list).

Records are appended one line at a time and flushed to disk at once, so that a run cut mid-way
keeps every configuration it finished. A measurement in progress lives in a partial file
(``write_partial``): the complete record is appended when it is done (``finish``), and
benchmarks/gpu/check.sh appends the partial one (``"complete": false``) when the step that was
writing it dies. Old records are never edited: a newer one for the same configuration
supersedes them (benchmarks/report.py takes the latest).

FLCE_GPU_DRY_RUN=1 (tests/tools/test_gpu_check.py: the control flow of the GPU check on a
machine without a GPU) leaves torch out: the environment is a stand-in that says so.

The measuring runs also print a progress line as each step starts and ends (``Progress``).
"""
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
if importlib.util.find_spec("flce") is None:  # not installed: the checkout's in-place build
    sys.path.insert(0, os.path.join(REPO, "python"))
# flce.build_info()'s keys that say what was measured (the rest describe the CPU backend).
BUILD_KEYS = ("version", "torch", "cuda", "arch_list", "sass", "cuda_backend")


def dry_run():
    """True under FLCE_GPU_DRY_RUN=1: no torch, no GPU, stand-in measurements."""
    return os.environ.get("FLCE_GPU_DRY_RUN") == "1"


def _run(*cmd, timeout):
    """``cmd``'s stdout, stripped; raises OSError or SubprocessError where it fails."""
    return subprocess.run(cmd, capture_output=True, text=True, check=True,
                          timeout=timeout).stdout.strip()


def commit():
    """The commit measured: FLCE_COMMIT, else `git rev-parse --short HEAD` of this checkout
    (``+dirty`` with uncommitted changes to tracked files), else None: never an exception, with
    no git or no checkout."""
    env = os.environ.get("FLCE_COMMIT", "").strip()
    if env:
        return env
    try:
        sha = _run("git", "-C", REPO, "rev-parse", "--short", "HEAD", timeout=10)
        dirty = _run("git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                     timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None


def driver_version():
    """The NVIDIA driver's version (nvidia-smi), or None."""
    try:
        out = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                   timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def _today():
    return datetime.date.today().isoformat()


def base(device, op):
    """The fields every record of the benchmarks here starts with; ``device``: "cpu" or
    "cuda"."""
    import torch
    from flce.check import device_name  # (the self-check's records name devices so too)

    return {"date": _today(), "device": device_name(device), "torch": torch.__version__,
            "commit": commit(), "threads": torch.get_num_threads() if device == "cpu" else None,
            "op": op}


def environment():
    """The fields every GPU record carries besides its own: date, commit, run, device, driver,
    CUDA, torch, Python and flce's build."""
    rec = {"date": _today(), "commit": commit(), "run": os.environ.get("FLCE_RUN") or None,
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


def _put(path, mode, rec):
    """Write ``rec`` to ``path`` as one line, on disk when this returns (NaN refused before the
    file is opened)."""
    line = json.dumps(rec, allow_nan=False) + "\n"
    with open(path, mode) as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def append(path, rec):
    """Append ``rec`` to ``path`` as one line, on disk when this returns."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    _put(path, "a", rec)
    print(f"record appended to {path}", flush=True)


def write_partial(path, rec):
    """Replace the partial record at ``path`` (atomically: a reader sees the old or the new
    one, never half of one)."""
    _put(f"{path}.tmp", "w", rec)
    os.replace(f"{path}.tmp", path)


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


def config_key(r):
    """What a record measured: a newer record with the same key supersedes an older one."""
    return (r["device"], r["op"], r.get("dtype"), r.get("n"), r.get("v"), r.get("d"),
            r.get("load") or 0, r.get("isa") or "native", r.get("group"), r.get("across"),
            r.get("world"))


def latest(records, key=config_key):
    """The last record of each ``key(record)``, in the order the keys first appear."""
    out = {}
    for r in records:
        out[key(r)] = r
    return list(out.values())


def read(*paths):
    out = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out


def hms(seconds):
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Progress lines for long benchmark runs: what runs now, the time since the start and,
    once a step has finished, an estimate of the time left.

        progress = Progress(total=8)
        progress.start("fp32 N=4096 V=32768 D=512: flce")
        ...                                   # the measurement
        progress.done("1.62 s, 246 MB")

    prints, on stdout and flushed at once (a run cut by a timeout keeps what it printed):

        [1/8 0:00:00] fp32 N=4096 V=32768 D=512: flce ...
        [1/8 0:00:14] fp32 N=4096 V=32768 D=512: flce: 1.62 s, 246 MB (ETA 0:01:38)

    The estimate assumes the steps left take as long as the finished ones did on average: right
    for repeats of one configuration, rough across shapes."""

    def __init__(self, total, out=None, clock=time.monotonic):
        self.total, self.done_steps = max(int(total), 1), 0
        self.out = out or sys.stdout
        self.clock = clock
        self.t0 = clock()
        self.what = ""

    def _head(self):
        k = min(self.done_steps + 1, self.total)
        return f"[{k}/{self.total} {hms(self.clock() - self.t0)}]"

    def start(self, what):
        """A step begins: name it."""
        self.what = what
        print(f"{self._head()} {what} ...", file=self.out, flush=True)

    def done(self, result="done"):
        """The step begun last has finished with ``result`` (a short summary)."""
        head = self._head()
        self.done_steps += 1
        left = self.total - self.done_steps
        elapsed = self.clock() - self.t0
        eta = f" (ETA {hms(elapsed / self.done_steps * left)})" if left > 0 else ""
        print(f"{head} {self.what}: {result}{eta}", file=self.out, flush=True)
