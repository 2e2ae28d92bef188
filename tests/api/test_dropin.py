"""flce as a drop-in for torch's cross-entropy entry points: torch's calling conventions and
signatures, per-class weights in linear_cross_entropy, torch's exceptions, and torch's answers
at the edges (no classes, an infinite target logit). Values against float64 (flce.reference),
and against torch itself where torch does not collapse."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import flce
from helpers import (TORCH_LCE, assert_close_to_ref, check_flce, gen, needs_torch_lce,
                     rand_inputs, randn)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_class_weights(device, reduction, smoothing, dtype):
    """Per-class weights with torch's semantics, every element against float64: fused without
    label smoothing, the composite path with it."""
    x, w, t, b = rand_inputs(29, 301, 24, dtype, device, seed=5, bias=True, ignore_frac=0.2)
    cw = (torch.rand(301, generator=gen(6)) + 0.2).to(device)
    ref_cw = cw.double()
    leaves = [a.detach().requires_grad_() for a in (x, w, b)]
    up = torch.rand(t.shape, generator=gen(7), dtype=torch.float64) + 0.5
    got = flce.linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2], weight=cw,
                                    reduction=reduction, label_smoothing=smoothing)
    r_leaves = [a.detach().double().requires_grad_() for a in (x, w, b)]
    z = r_leaves[0] @ r_leaves[1].T + r_leaves[2]
    ref = flce.reference.logits_cross_entropy(z, t, weight=ref_cw, reduction=reduction,
                                              label_smoothing=smoothing)
    assert_close_to_ref(got, ref, torch.float32, factor=32, what="loss")
    ((got * up.float()).sum() if reduction == "none" else got).backward()
    ((ref * up).sum() if reduction == "none" else ref).backward()
    for a, r, name in zip(leaves, r_leaves, ("input", "weight", "bias")):
        # the 16-bit gradients: float64 rounded once, plus the CUDA tile's rounding
        factor = 1024 if dtype == torch.float32 else 2
        assert_close_to_ref(a.grad, r.grad, dtype, factor=factor, what=name)
    if reduction != "none" and dtype == torch.float32 and TORCH_LCE:
        # torch's own F.linear_cross_entropy agrees where it does not collapse
        want = F.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction,
                                      label_smoothing=smoothing)
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())


def test_linear_calling_conventions(device):
    """torch's F.linear_cross_entropy(input, linear_weight, target, linear_bias=, weight=):
    weight= is the per-class weights (None too); flce's own weight= keyword is the classifier."""
    x, w, t, b = rand_inputs(16, 50, 8, torch.float32, device, seed=8, bias=True)
    plain = flce.linear_cross_entropy(x, w, t, bias=b)
    for call in (lambda: flce.linear_cross_entropy(x, w, t, linear_bias=b, weight=None),
                 lambda: flce.linear_cross_entropy(x, linear_weight=w, target=t, linear_bias=b,
                                                   weight=None),
                 lambda: flce.linear_cross_entropy(input=x, weight=w, target=t, bias=b)):
        assert torch.equal(call(), plain)
    ones = torch.ones(50, device=device)
    assert torch.allclose(flce.linear_cross_entropy(x, w, t, bias=b, class_weight=ones), plain)
    with pytest.raises(TypeError, match="not both"):
        flce.linear_cross_entropy(x, w, t, weight=ones, class_weight=ones)
    with pytest.raises(ValueError, match="per-class weights"):
        flce.linear_cross_entropy(x, w, t, weight=torch.ones(49, device=device))


@needs_torch_lce
def test_nn_linear_cross_entropy_loss_with_flce_patched_in(monkeypatch):
    """nn.LinearCrossEntropyLoss calls F.linear_cross_entropy with weight=None (or its class
    weights): with flce in its place, the module's loss and gradients are flce's."""
    torch.manual_seed(0)
    for kwargs in ({}, {"weight": torch.rand(40) + 0.5, "label_smoothing": 0.1}):
        mod = torch.nn.LinearCrossEntropyLoss(16, 40, bias=True, **kwargs)
        x = torch.randn(12, 16)
        t = torch.randint(0, 40, (12,))
        want = mod(x, t)
        monkeypatch.setattr(F, "linear_cross_entropy", flce.linear_cross_entropy)
        got = mod(x, t)
        monkeypatch.undo()
        assert torch.allclose(got, want, rtol=1e-5), (got, want)


def test_cross_entropy_positional_signature():
    """F.cross_entropy's positional order: (input, target, weight, size_average, ignore_index,
    reduce, reduction, label_smoothing)."""
    x = randn((9, 11), torch.float32, "cpu", gen(9), 2.0)
    t = torch.randint(0, 11, (9,), generator=gen(10))
    t[0] = 3
    cw = torch.rand(11, generator=gen(11)) + 0.5
    args = (x, t, cw, None, 3, None, "sum", 0.1)
    assert torch.allclose(flce.cross_entropy(*args), F.cross_entropy(*args), rtol=1e-6)


@pytest.mark.parametrize("size_average,reduce", [(None, False), (True, None), (False, None),
                                                 (False, True), (True, False)])
def test_cross_entropy_legacy_reduction_arguments(size_average, reduce):
    x = randn((9, 11), torch.float32, "cpu", gen(12), 2.0)
    t = torch.randint(0, 11, (9,), generator=gen(13))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = F.cross_entropy(x, t, size_average=size_average, reduce=reduce)
    with pytest.warns(UserWarning, match="deprecated"):
        got = flce.cross_entropy(x, t, size_average=size_average, reduce=reduce)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6)


def test_errors_are_also_torchs_runtime_error():
    """Where torch raises RuntimeError for a bad value, code that catches it catches flce's
    error too (a ValueError and a RuntimeError, naming the argument)."""
    x = torch.randn(4, 5)
    t = torch.tensor([0, 1, 2, 3])
    for kwargs, name in (({"label_smoothing": 1.2}, "label_smoothing"),
                         ({"weight": torch.ones(4)}, "weight")):
        with pytest.raises(RuntimeError):
            F.cross_entropy(x, t, **kwargs)
        with pytest.raises(RuntimeError, match=name) as e:
            flce.cross_entropy(x, t, **kwargs)
        assert isinstance(e.value, ValueError) and isinstance(e.value, flce.ArgumentError)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_classes(device, reduction):
    """(N, 0) logits, every target ignored: torch's answer (NaN mean, 0 sum, zeros)."""
    x = torch.randn(3, 0, device=device, requires_grad=True)
    t = torch.full((3,), -100, device=device)
    got = flce.cross_entropy(x, t, reduction=reduction)
    want = F.cross_entropy(x.detach().cpu(), t.cpu(), reduction=reduction)
    assert torch.equal(got.detach().cpu().isnan(), want.isnan())
    assert torch.equal(got.detach().cpu().nan_to_num(), want.nan_to_num())
    (got.sum() if reduction == "none" else got.nan_to_num()).backward()
    assert x.grad.shape == (3, 0)


def test_infinite_target_logit_is_nan(device):
    """+inf at a target logit: a NaN loss, as torch's (inf - inf), never a finite loss beside
    NaN gradients that a loop's NaN check of the loss would miss; -inf: +inf, as torch."""
    z = torch.tensor([[math.inf, 1.0, 2.0], [0.5, -math.inf, 2.0], [1.0, 2.0, 3.0]],
                     device=device)
    t = torch.tensor([0, 1, 2], device=device)
    got = flce.cross_entropy(z, t, reduction="none")
    want = F.cross_entropy(z.cpu(), t.cpu(), reduction="none")
    assert torch.isnan(got[0]) and torch.isnan(want[0])
    assert got[1] == math.inf and want[1] == math.inf
    assert torch.isfinite(got[2])
    # through the linear entry: a +inf bias entry of the target's class
    x, w, tt, b = rand_inputs(4, 6, 3, torch.float32, device, seed=14, bias=True)
    b[tt[0]] = math.inf
    lin = flce.linear_cross_entropy(x, w, tt, bias=b, reduction="none")
    assert torch.isnan(lin[0]) and torch.isnan(flce.linear_cross_entropy(x, w, tt, bias=b))


def test_module_options_are_validated_at_construction():
    with pytest.raises(TypeError, match="single_pass"):
        flce.LinearCrossEntropy(single_pass="x")
    with pytest.raises(ValueError, match="single_pass"):
        flce.LinearCrossEntropy(single_pass=True, reduction="none")
    with pytest.raises(ValueError, match="reduction"):
        flce.LinearCrossEntropy(reduction="avg")


def test_class_weights_check_every_element(device):
    """check_flce's reference does not take class weights; a unit weight must give exactly the
    unweighted run (the fused path multiplies by 1 and divides by the count)."""
    x, w, t, _ = rand_inputs(21, 97, 16, torch.float32, device, seed=15)
    check_flce(x, w, t, reduction="sum")
    base = flce.linear_cross_entropy(x, w, t, reduction="none")
    ones = flce.linear_cross_entropy(x, w, t, reduction="none",
                                     class_weight=torch.ones(97, device=device))
    assert torch.equal(base, ones)


def test_one_token_with_a_target_of_shape_1():
    # torch takes a (C,) input (a (D,) hidden state) with a 0-d or a (1,) class id; 0-d result.
    x, w = torch.randn(9), torch.randn(12, 9)
    for red in ("none", "mean", "sum"):
        for t in (torch.tensor(4), torch.tensor([4])):
            got, want = flce.cross_entropy(x, t, reduction=red), F.cross_entropy(x, t,
                                                                                reduction=red)
            assert got.shape == want.shape == () and torch.allclose(got, want)
            got = flce.linear_cross_entropy(x, w, t, reduction=red)
            want = (F.linear_cross_entropy(x, w, t, reduction=red) if TORCH_LCE
                    else F.cross_entropy(x @ w.T, t, reduction=red))
            assert got.shape == want.shape == () and torch.allclose(got, want)
