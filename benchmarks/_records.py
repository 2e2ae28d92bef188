"""Result records: one JSON object per line in benchmarks/results/*.jsonl.

Every record stands alone: ``date``, ``device``, ``torch``, ``commit`` (``+dirty`` when the
checkout had uncommitted changes to tracked files; ``FLCE_COMMIT`` overrides, for a machine
without the .git), ``threads`` (CPU), ``op`` (what was measured) and the measurement's own
fields. ``source`` says which command wrote it, or, for a record transcribed from an older
document, where from. Records are appended one line at a time and flushed to disk at once, so
that a run cut mid-way keeps every configuration it finished. Old records are never edited:
a newer one for the same configuration supersedes them (benchmarks/report.py takes the latest).
"""
import json
import os
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def commit():
    env = os.environ.get("FLCE_COMMIT", "").strip()
    if env:
        return env
    try:
        sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30).stdout
        return sha + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device):
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name()
    import _peers

    return _peers.cpu_model()


def base(device, op):
    """The fields every record starts with."""
    import torch

    cpu = not str(device).startswith("cuda")
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": device_name(device),
            "torch": torch.__version__, "commit": commit(),
            "threads": torch.get_num_threads() if cpu else None, "op": op}


def append(path, rec):
    """Append ``rec`` to ``path`` as one line, on disk when this returns."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(rec, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    print(f"record appended to {path}", flush=True)


def config_key(r):
    """What a record measured: a newer record with the same key supersedes an older one."""
    return (r["device"], r["op"], r.get("dtype"), r.get("n"), r.get("v"), r.get("d"),
            r.get("load") or 0, r.get("isa") or "native", r.get("group"), r.get("across"),
            r.get("world"))


def read(*paths):
    out = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return out
