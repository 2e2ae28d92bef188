"""single_pass=True (flce::sum_and_grad: gradients computed in the forward, no recompute) gives
the default path's loss and gradients to fp32 rounding, and refuses what it cannot do."""
import pytest
import torch

import flce
from helpers import check_flce, rand_inputs, rel_err


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
    # (the message names every per-token output, the accuracy too)
    with pytest.raises(ValueError, match="single_pass=True.*return_accuracy"):
        flce.linear_cross_entropy(x, w, t, return_accuracy=True, single_pass=True)
    # on the composite paths too (float64; probability targets with the accuracy), which
    # accepted it silently
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x.double(), w.double(), t, return_lse=True, single_pass=True)
    q = torch.softmax(torch.randn(8, 50), 1)
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x, w, q, return_accuracy=True, single_pass=True)


def test_module_passes_single_pass():
    x, w, t, _ = rand_inputs(16, 300, 8, torch.float32, "cpu", seed=2)
    xg = x.clone().requires_grad_()
    loss = flce.LinearCrossEntropy(single_pass=True)(xg, w, t)
    assert "sum_and_grad" in type(loss.grad_fn).__name__
    loss.backward()
    ref = x.clone().requires_grad_()
    flce.linear_cross_entropy(ref, w, t).backward()
    assert rel_err(xg.grad, ref.grad.double()) <= 1e-6


def _takes_single_pass(dtype, n, v, d):
    x, w, t, _ = rand_inputs(n, v, d, dtype, "cpu", seed=4)
    loss = flce.linear_cross_entropy(x.clone().requires_grad_(), w, t)
    return "sum_and_grad" in type(loss.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_default_path(dtype, monkeypatch):
    """On the CPU, training takes the single pass by default while its O(V D) memory stays
    within the budget (FLCE_CPU_MEMORY_MB, by default half an fp32 [N, V] buffer), except for
    bf16 where its GEMMs run on AMX (the recompute path is faster there) and fp16 (its tile
    scale needs every row's statistics) (docs/cpu-backend.md)."""
    eligible = dtype == torch.float32 or (dtype == torch.bfloat16 and not flce._ops.CPU_BF16_AMX)
    monkeypatch.delenv("FLCE_CPU_MEMORY_MB", raising=False)
    # Few rows: the single pass's dW compensation and fp32 gradients are over half the logits.
    assert not _takes_single_pass(dtype, 40, 300, 16)
    # Many rows of a small vocabulary: within the default budget (a 1024-row block of logits,
    # with the per-worker tile rounding, is a quarter of an fp32 [N, V] here; the budget half).
    n, v, d = 8192, 4096, 16
    assert flce._common.cpu_single_pass_bytes(n, v, d, dtype) <= 2 * n * v
    assert _takes_single_pass(dtype, n, v, d) == eligible
    # An explicit budget either way.
    monkeypatch.setenv("FLCE_CPU_MEMORY_MB", "1000")
    assert _takes_single_pass(dtype, 40, 300, 16) == eligible
    monkeypatch.setenv("FLCE_CPU_MEMORY_MB", "0")
    assert not _takes_single_pass(dtype, n, v, d)
    monkeypatch.setenv("FLCE_CPU_MEMORY_MB", "lots")
    with pytest.raises(ValueError, match="FLCE_CPU_MEMORY_MB"):
        _takes_single_pass(torch.float32, 40, 300, 16)
    # reduction "none", per-token outputs or no gradient: never the single pass
    monkeypatch.setenv("FLCE_CPU_MEMORY_MB", "1000")
    x, w, t, _ = rand_inputs(40, 300, 16, dtype, "cpu", seed=4)
    xg = x.clone().requires_grad_()
    for kwargs in ({"reduction": "none"}, {"return_lse": True}):
        out = flce.linear_cross_entropy(xg, w, t, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        assert "sum_and_grad" not in type(out.grad_fn).__name__


def test_cpu_deferred_gradients_are_fp32_of_the_reduced_loss():
    """sum_and_grad's CPU gradients: [1, *shape] fp32 of the mean (1 / count inside), which
    scale_grad multiplies by the upstream gradient and rounds once (the exact bf16 mode: a
    gradient tile rounded to bf16 would be all that this test sees)."""
    x, w, t, b = rand_inputs(64, 700, 24, torch.bfloat16, "cpu", seed=5, bias=True)
    t[::3] = -100
    loss, divisor, gi, gw, gb = flce.ops.sum_and_grad(x, w, t, b, -100, 0.0, 0.0, 0.0,
                                                     [True, True, True], True,
                                                     exact_bf16_grad=True)
    assert (gi.shape, gw.shape, gb.shape) == ((1, *x.shape), (1, *w.shape), (1, *b.shape))
    assert gi.dtype == gw.dtype == gb.dtype == torch.float32
    assert float(divisor) == 1.0
    xr, wr, br = (a.double().requires_grad_() for a in (x, w, b))
    ref = flce.reference.linear_cross_entropy(xr, wr, t, bias=br)
    ref.backward()
    assert rel_err(loss, ref.detach()) <= 1e-6
    for g, r in ((gi, xr.grad), (gw, wr.grad), (gb, br.grad)):
        # fp32 of bf16-input products: far below bf16's own rounding
        assert rel_err(g[0], r) <= 1e-5, rel_err(g[0], r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_is_the_deferred_buffer(device, dtype):
    """A deferred gradient already in its gradient's dtype (fp32 training everywhere; a 16-bit
    dW on the CUDA backend) is scaled in place: the gradient is that buffer (a view of the
    [1, ...] tensor sum_and_grad returned), not a second one of its size. A second backward
    through the same graph then raises instead of scaling twice."""
    x, w, t, _ = rand_inputs(48, 700, 16, dtype, device, seed=6)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    saved = []  # what the op saves for its backward: the divisor and the deferred gradients

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = flce.linear_cross_entropy(xg, wg, t, reduction="sum", single_pass=True)
    loss.backward(retain_graph=True)
    in_place = {"x": dtype == torch.float32,
                "w": dtype == torch.float32 or flce._ops.is_cuda_backend(x)}
    deferred = {s_.data_ptr() for s_ in saved if s_.dim() >= 2}
    for name, leaf in (("x", xg), ("w", wg)):
        assert (leaf.grad.data_ptr() in deferred) == in_place[name], name
    ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    flce.linear_cross_entropy(*ref[:2], t, reduction="sum", single_pass=False).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(wg.grad, ref[1].grad.double()) < tol
    if in_place["x"] or in_place["w"]:
        with pytest.raises(RuntimeError, match="scaled in place.*single_pass=False"):
            loss.backward()


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("single_pass", [True, False])
def test_transposed_classifier(device, weight_dtype, single_pass):
    """A classifier stored as (D, V) and passed as its transpose (column stride V, not 1), with
    16-bit inputs and 16-bit or fp32 master weights: every gradient as for a contiguous weight.
    A column of the weight that is all zeros makes the input gradient's column exactly 0 (the
    CUDA single pass's target-entry fix once read weight[t] with its row stride only)."""
    x, w, t, _ = rand_inputs(37, 301, 24, torch.bfloat16, device, seed=11,
                             weight_dtype=weight_dtype)
    w[:, 5] = 0
    wt = w.t().contiguous().t()  # the same values, strides (1, V)
    assert wt.stride() == (1, w.shape[0])
    _, _, grads = check_flce(x, wt, t, single_pass=single_pass, reduction="sum")
    assert (grads["input"][:, 5] == 0).all()
