"""The CPU backend's results do not depend on scheduling: a forward + backward run while busy
processes compete for every core gives bitwise the outputs of the run on an idle machine.

The backend's workers own fixed ranges of rows or vocabulary columns and add their partial
gradients in worker order (csrc/cpu/workers.h); under load the workers are descheduled at
different points, which would show here as differing bits if any sum followed the order in which
workers arrived. The shapes make both splits run (rows when N < V, the vocabulary otherwise)
with several blocks, partials and barriers each, on at least two workers.
"""
import os
import sys

import pytest
import torch

import flce
from helpers import rand_inputs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import _peers  # noqa: E402

CASES = [
    # N < V: workers split rows; dC and db are summed from partials, per block of 256 columns.
    pytest.param(600, 3000, 64, torch.float32, {}, id="rows-fp32"),
    # N >= V: workers split the vocabulary; dE is summed from partials, per block of 1024 rows
    # (BLOCK_N_WIDE: three blocks here, the last one short).
    pytest.param(3000, 600, 64, torch.bfloat16, {"label_smoothing": 0.1}, id="vocab-bf16"),
    # The fused forward+backward: statistics merged and dE partials summed per row block of
    # up to 1024 rows (three here, the last one short).
    pytest.param(2100, 3000, 48, torch.float32, {"single_pass": True}, id="single-pass-fp32"),
]


@pytest.fixture
def two_threads_at_least():
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


def _step(x, w, t, b, opts):
    leaves = [a.detach().clone().requires_grad_() for a in (x, w, b)]
    loss = flce.linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2], **opts)
    loss.backward()
    return [loss.detach()] + [a.grad for a in leaves]


@pytest.mark.parametrize("n,v,d,dtype,opts", CASES)
def test_bitwise_identical_under_load(two_threads_at_least, n, v, d, dtype, opts):
    x, w, t, b = rand_inputs(n, v, d, dtype, seed=n + v, bias=True, ignore_frac=0.05)
    quiet = _step(x, w, t, b, opts)
    load = _peers.BusyLoad(max(2, os.cpu_count() or 1), seconds=120)
    with load:
        procs = list(load.procs)
        assert all(p.poll() is None for p in procs), "the busy processes did not start"
        for _ in range(3):
            loaded = _step(x, w, t, b, opts)
            for name, a, q in zip(("loss", "dE", "dC", "db"), loaded, quiet):
                assert torch.equal(a, q), f"{name} differs from the unloaded run"
    assert all(p.poll() is not None for p in procs), "the busy processes were not stopped"
