"""The CPU backend never materializes [N, V]: peak memory of a forward + backward stays within the
gradients plus the documented scratch budget (docs/cpu-backend.md), far below one [N, V] buffer.

Measured as benchmarks/bench.py measures it (benchmarks/_peers.py): the growth of the
resident-set high-water mark during one step in a fresh child process, after a warm-up step.
Memory, not time: it does not depend on how busy the machine is.
"""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import _peers  # noqa: E402

from flce import _common  # noqa: E402
from flce._common import cpu_single_pass_bytes  # noqa: E402


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("impl", ["flce-recompute", "flce-single", "flce-soft"])
def test_peak_memory_is_gradients_plus_budget(impl, dtype, size):
    single = impl == "flce-single"
    if impl == "flce-soft":
        # probability targets take the path flce.linear_cross_entropy's rule picks at this shape
        dt = _peers.DTYPES[dtype]
        w = torch.empty(65537, 32, dtype=dt, requires_grad=True)
        single = _common.plan(torch.empty(2048, 32, dtype=dt), (w,), classes=65537,
                              distribution=True).single_pass
    # The single pass's logits workspace is a constant (fp32: at most 152 MiB, 544 rows of
    # V = 65537 on 2 workers here), so N is large enough that it is far below one fp32 [N, V]
    # buffer.
    # (probability targets are themselves an [N, V] input: N stays 2048 for them)
    n, v, d = (16384 if single and impl != "flce-soft" else 2048), 65537, 32
    spec = {"impl": impl, "device": "cpu", "dtype": dtype, "N": n, "V": v, "D": d,
            "repeats": 1, "warmup": 1, "threads": 0, "accuracy": False,
            "seed": random.randrange(2 ** 31)}
    result = _peers.run_child(spec, timeout=600)
    assert "error" not in result, result
    growth = result["peak_mem_bytes"]
    grads = (n + v) * d * size
    if single:
        # The single pass (docs/cpu-backend.md): the gradients in fp32 from the forward to the
        # backward, dW's bf16 compensation, a block of rows' logits (at most 152 MiB for fp32,
        # 72 MiB for 16-bit inputs, whatever N), 16-bit weight tiles packed twice: the model the
        # default path's memory rule uses.
        budget = cpu_single_pass_bytes(n, v, d, _peers.DTYPES[dtype])
        if impl == "flce-soft":
            budget += torch.get_num_threads() * 2064 * 4  # a row of target weights per worker
    else:
        # The global accumulator's bf16 compensation (and its fp32 sum when the gradient is not
        # fp32); per worker a tile of [rows, block_v + 16] fp32 and, for bf16, at most its split
        # into two bf16 tiles (rounded once: one; docs/cpu-backend.md): 34 MiB on 2 workers
        # here. Probability targets (flce-soft, the recompute path) add a row of target weights
        # per worker and the rows' [N, 7] states: nothing of size N * V (the targets themselves
        # are an input).
        budget = min(n, v) * d * (2 + (4 if size != 4 else 0))
        rows, cols = (256, 256 + 16) if size == 4 else (1024, 2048 + 16)
        budget += torch.get_num_threads() * rows * cols * (4 if size == 4 else 8)
        if impl == "flce-soft":
            budget += n * 8 * 4 + torch.get_num_threads() * 2064 * 4
    # The allowance is for the allocator and the interpreter, not for anything that grows with
    # N * V.
    budget += 16 << 20
    logits = n * v * 4  # one fp32 [N, V] buffer: 512 MiB (recompute) / 4 GiB (single pass)
    assert growth <= grads + budget, (growth / 2 ** 20, grads / 2 ** 20, budget / 2 ** 20)
    # (the single pass's constant workspace at N = 2048: a third of one [N, V] buffer)
    assert growth < logits / (2 if impl == "flce-soft" and single else 16)
