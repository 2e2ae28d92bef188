"""flce.patch under FSDP2 (fully_shard) and with DTensor lm_head weights: 2 gloo ranks on CPU."""
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the worker
CASES = ["fsdp-root", "fsdp-head", "dtensor-replicate", "dtensor-shard1", "dtensor-shard0"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_and_dtensor_weights_match_single_process():
    world = 2
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "hf_dist_worker.py"), *CASES],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{text[-4000:]}"
    for case in CASES:
        assert f"{case}: max relative gradient difference" in outputs[0], outputs[0][-2000:]
