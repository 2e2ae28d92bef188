"""Drop-in compatibility with torch, determinism, and the nn.Module form."""
import pytest
import torch
import torch.nn.functional as F

import flce
from helpers import assert_close_to_ref, rand_inputs, rel_err

REDUCTIONS = ["mean", "sum", "none"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_drop_in_for_torch(device, reduction, label_smoothing, ignore_index):
    """Same call as torch.nn.functional.linear_cross_entropy (keyword names included), same
    answer at small margins, as logits + F.cross_entropy. (2-D input: torch's function treats
    dim 1 of a 3-D input's logits as the class dimension, flce the last one.)"""
    ii = -100 if ignore_index is None else ignore_index
    x, w, t, b = rand_inputs(300, 1200, 32, torch.float32, device, seed=43, bias=True,
                             ignore_frac=0.15, ignore_index=ii)
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, ignore_index=ignore_index)
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    ours = flce.linear_cross_entropy(leaves[0], linear_weight=leaves[1], target=t,
                                     linear_bias=leaves[2], **kw)
    eleaves = [a.clone().requires_grad_() for a in (x, w, b)]
    eager = F.cross_entropy(eleaves[0] @ eleaves[1].T + eleaves[2], t, reduction=reduction,
                            label_smoothing=label_smoothing, ignore_index=ii)
    others = [(eager, eleaves)]
    if hasattr(F, "linear_cross_entropy"):  # torch >= 2.13 (flce supports older torch too)
        tleaves = [a.clone().requires_grad_() for a in (x, w, b)]
        theirs = F.linear_cross_entropy(tleaves[0], tleaves[1], t, linear_bias=tleaves[2], **kw)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        others.append((theirs, tleaves))
    assert ours.shape == eager.shape
    up = torch.rand(t.shape, generator=torch.Generator().manual_seed(1)).to(device) + 0.5
    for out, ls in [(ours, leaves)] + others:
        (out * up if reduction == "none" else out).sum().backward()
    for other, ols in others:
        assert_close_to_ref(ours, other.double(), torch.float32, factor=64, what="loss")
        for a, o in zip(leaves, ols):
            assert_close_to_ref(a.grad, o.grad.double(), torch.float32, factor=4096,
                                what="grad")
            assert rel_err(a.grad, o.grad) < 64 * torch.finfo(torch.float32).eps


def test_positional_weight_and_bias_keyword(device):
    x, w, t, b = rand_inputs(40, 300, 16, torch.float32, device, seed=44, bias=True)
    a = flce.linear_cross_entropy(x, w, t, bias=b)
    c = flce.linear_cross_entropy(x, linear_weight=w, target=t, linear_bias=b)
    assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic(device, dtype):
    """Bitwise-identical loss, lse and gradients run to run (same thread count), on shapes
    with several row and vocabulary tiles."""
    x, w, t, b = rand_inputs(700, 5003, 48, dtype, device, seed=47, bias=True, ignore_frac=0.05)

    def run():
        leaves = [a.clone().requires_grad_() for a in (x, w, b)]
        loss, lse = flce.linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2],
                                              reduction="none", label_smoothing=0.1,
                                              z_loss=1e-3, softcap=20.0, return_lse=True)
        (loss.sum() + 0.5 * lse.sum()).backward()
        return [loss.detach(), lse.detach()] + [a.grad for a in leaves]

    first = run()
    for _ in range(2):
        for a, c in zip(first, run()):
            assert torch.equal(a, c)
    # and the row-major transposed case (N < V and N > V take different loop orders)
    x2, w2, t2, _ = rand_inputs(3000, 700, 32, dtype, device, seed=48)
    runs = []
    for _ in range(2):
        xg, wg = x2.clone().requires_grad_(), w2.clone().requires_grad_()
        flce.linear_cross_entropy(xg, wg, t2).backward()
        runs.append((xg.grad, wg.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", label_smoothing=0.1,
                                               z_loss=1e-3, softcap=10.0, ignore_index=5,
                                               return_lse=True)], ids=["default", "options"])
def test_module_matches_function(device, opts):
    x, w, t, b = rand_inputs((3, 40), 900, 24, torch.float32, device, seed=53, bias=True)
    module = flce.LinearCrossEntropy(**opts)
    assert isinstance(module, torch.nn.Module)
    repr(module)
    xm, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_m = module(xm, w, t, b)
    out_f = flce.linear_cross_entropy(xf, w, t, bias=b, **opts)
    if opts.get("return_lse"):
        assert torch.equal(out_m[1], out_f[1])
        out_m, out_f = out_m[0], out_f[0]
    assert torch.equal(out_m, out_f)
    out_m.sum().backward()
    out_f.sum().backward()
    assert torch.equal(xm.grad, xf.grad)


def test_module_repr_flags_and_class_weight():
    m = flce.LinearCrossEntropy(return_lse=True, shift=True, z_loss=1e-4)
    assert all(s in repr(m) for s in ("return_lse=True", "shift=True", "z_loss=0.0001"))
    assert "temperature" not in repr(m)  # (defaults are not printed)
    for bad in ({"return_lse": "y"}, {"return_entropy": 2}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            flce.LinearCrossEntropy(**bad)
    # class_weight: a buffer (state_dict, .to()), used as the function's class_weight=
    x, w, t, _ = rand_inputs(12, 50, 8, torch.float32, "cpu", seed=3)
    cw = torch.rand(50, dtype=torch.float64)
    m = flce.LinearCrossEntropy(class_weight=cw, label_smoothing=0.1).float()
    assert m.class_weight.dtype == torch.float32 and "class_weight" in m.state_dict()
    assert torch.equal(m(x, w, t), flce.linear_cross_entropy(x, w, t, class_weight=cw.float(),
                                                             label_smoothing=0.1))
