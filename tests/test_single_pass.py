"""single_pass=True (flce::sum_and_grad: gradients computed in the forward, no recompute) gives
the default path's loss and gradients to fp32 rounding, and refuses what it cannot do."""
import pytest
import torch

import flce
from helpers import rand_inputs, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_single_pass_matches_default(dtype, reduction):
    x, w, t, b = rand_inputs(300, 5003, 48, dtype, "cpu", seed=3, bias=True)
    t[::5] = -100
    out = []
    for single in (False, True):
        xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
        loss = flce.linear_cross_entropy(xg, wg, t, bias=bg, reduction=reduction,
                                         label_smoothing=0.05, single_pass=single)
        (loss * 1.7).backward()
        out.append((loss.detach(), xg.grad, wg.grad, bg.grad))
    ref = flce.reference.linear_cross_entropy(
        x.double(), w.double(), t, bias=b.double(), reduction=reduction, label_smoothing=0.05)
    assert rel_err(out[1][0], ref) <= 2 * rel_err(out[0][0], ref) + 1e-7
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, c in zip(out[0][1:], out[1][1:]):
        assert a.dtype == c.dtype
        assert rel_err(c, a.double()) <= tol


def test_single_pass_refuses_what_it_cannot_do():
    x, w, t, _ = rand_inputs(8, 50, 4, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x, w, t, reduction="none", single_pass=True)
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x, w, t, return_lse=True, single_pass=True)


def test_module_passes_single_pass():
    x, w, t, _ = rand_inputs(16, 300, 8, torch.float32, "cpu", seed=2)
    xg = x.clone().requires_grad_()
    loss = flce.LinearCrossEntropy(single_pass=True)(xg, w, t)
    assert "sum_and_grad" in type(loss.grad_fn).__name__
    loss.backward()
    ref = x.clone().requires_grad_()
    flce.linear_cross_entropy(ref, w, t).backward()
    assert rel_err(xg.grad, ref.grad.double()) <= 1e-6
