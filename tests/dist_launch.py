"""Run a script as a gloo process group on this machine, with a hard timeout.

Each launch gets a free port on 127.0.0.1 (bind to port 0); every rank's output goes to a file
(a full pipe must not block a rank in the middle of a collective). When one rank fails or the
deadline passes, the others are killed: CI never hangs.
"""
import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flce_path():
    """The directory holding the flce package this process imports (the installed wheel or
    python/ of a source tree), so that the ranks import the same one."""
    import flce

    return os.path.dirname(os.path.dirname(os.path.abspath(flce.__file__)))


def launch(script, world_size, args=(), timeout=120.0):
    """Run ``script`` on ``world_size`` ranks; returns ``[(returncode, output), ...]`` by rank.

    A rank killed at the deadline reports returncode None.
    """
    port = free_port()
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([flce_path(), os.path.join(ROOT, "tests"),
                                           env.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        procs, logs = [], []
        for rank in range(world_size):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, script, *args],
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout
        codes = [None] * world_size
        while time.monotonic() < deadline and None in codes:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                time.sleep(2.0)  # let the others report their side, then stop them
                break
            time.sleep(0.05)
        killed = set()
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                killed.add(rank)
            p.wait()
        codes = [None if rank in killed else p.returncode for rank, p in enumerate(procs)]
        out = []
        for rank, log in enumerate(logs):
            log.seek(0)
            out.append((codes[rank], log.read()))
            log.close()
    return out


def run_checked(script, world_size, timeout=120.0, args=()):
    """Launch ``script --worker *args`` on ``world_size`` ranks; assert that every rank exited 0
    and printed ALL CHECKS PASSED, with every rank's output tail in the failure message."""
    results = launch(script, world_size, args=("--worker",) + tuple(args), timeout=timeout)
    report = "\n".join(f"--- rank {r} (exit {rc}) ---\n{out[-6000:]}"
                       for r, (rc, out) in enumerate(results))
    assert all(rc == 0 for rc, _ in results), report
    assert all("ALL CHECKS PASSED" in out for _, out in results), report


def init_worker(timeout_s=60):
    """In a launched rank: join the gloo group (collectives time out instead of hanging)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def finish_worker():
    """End a launched rank whose checks have passed: leave the process group (if any), then skip
    interpreter teardown, where a gloo / FSDP background thread still joinable at exit can abort
    a finished run ("terminate called without an active exception"). A failure raised before
    this exits 1 as usual."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
