"""Probability (soft) targets, torch's semantics, against float64: both entry points, every
option, class weights, label smoothing, every reduction, the gradients of the logits, the
classifier and the targets themselves; and collapse safety where torch's formula rounds the
loss to a wrong value (a target concentrated on the dominant class at a large margin)."""
import math

import pytest
import torch
import torch.nn.functional as F

import flce
from flce import reference
from helpers import DEVICES, rel_err

N, V, D = 24, 40, 16


def _inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D ** 0.5
    b = torch.randn(V, generator=g) * 0.1
    y = torch.softmax(torch.randn(N, V, generator=g) * 2, 1)
    cw = torch.rand(V, generator=g) + 0.5
    return (x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), y.to(device, dtype),
            cw.to(device))


def _close(got, ref, dtype, what):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got.double().cpu(), ref.double().cpu(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"class_weight": True},
                                  {"class_weight": True, "label_smoothing": 0.2}],
                         ids=["plain", "smoothing", "weights", "weights+smoothing"])
def test_linear_matches_torch_in_float64(device, dtype, reduction, opts):
    x, w, b, y, cw = _inputs(dtype, device)
    kw = dict(opts)
    weight = cw if kw.pop("class_weight", False) else None
    leaves = [t.clone().requires_grad_() for t in (x, w, b, y)]
    got = flce.linear_cross_entropy(*leaves[:2], leaves[3], bias=leaves[2], reduction=reduction,
                                    class_weight=weight, **kw)
    wide = [t.detach().cpu().double().requires_grad_() for t in (x, w, b, y)]
    ref = F.cross_entropy(wide[0] @ wide[1].T + wide[2], wide[3], reduction=reduction,
                          weight=None if weight is None else weight.cpu().double(), **kw)
    _close(got, ref, dtype, "loss")
    cot = torch.rand(got.shape, generator=torch.Generator().manual_seed(1)).double() + 0.5
    (got.double() * cot.to(got.device)).sum().backward()
    (ref * cot).sum().backward()
    for name, a, r in zip(("input", "weight", "bias", "target"), leaves, wide):
        scale = r.grad.abs().max().item()
        floor = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(a.grad.double().cpu(), r.grad, rtol=0, atol=2 * floor * scale,
                                   msg=lambda m: f"{name} gradient: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["linear", "logits"])
def test_target_gradient_where_the_target_is_zero(device, entry):
    """d loss / d q_c = -w_c log p_c for every class, also where q_c is exactly 0 (one-hot and
    sparse targets; a sharp softmax underflowing in fp32): the gradient of the targets against
    torch's float64 at those entries too (a masked product gave them none)."""
    x, w, b, y, cw = _inputs(torch.float32, device, seed=4)
    q = y.clone()
    q[:, ::3] = 0.0  # exact zeros in every row
    q[0] = 0.0
    q[0, 5] = 1.0  # a one-hot row
    q = q / q.sum(1, keepdim=True)
    qs = q.clone().requires_grad_()
    if entry == "linear":
        loss = flce.linear_cross_entropy(x, w, qs, bias=b, class_weight=cw, reduction="sum")
        z = x.double().cpu() @ w.double().cpu().T + b.double().cpu()
    else:
        z = (x @ w.T + b).detach()
        loss = flce.cross_entropy(z, qs, cw, reduction="sum")
        z = z.double().cpu()
    loss.backward()
    q64 = q.detach().double().cpu().requires_grad_()
    F.cross_entropy(z, q64, weight=cw.double().cpu(), reduction="sum").backward()
    zero = q.cpu() == 0
    assert zero.sum() > V  # (the case has them)
    torch.testing.assert_close(qs.grad.double().cpu(), q64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target_grad", [True, False], ids=["target-grad", "no-target-grad"])
def test_master_weights_gradient_in_fp32(device, dtype, target_grad):
    """fp32 master weights of 16-bit inputs: the weight's gradient at fp32's accuracy on every
    path (targets that require grad take the composite path everywhere), not rounded to the
    inputs' dtype (2^-9 relative in bf16) on the way back through the cast."""
    x, w, b, y, cw = _inputs(torch.float32, device, seed=3)
    xs, ys = x.to(dtype), y.requires_grad_(target_grad)
    ws = w.clone().requires_grad_()
    loss = flce.linear_cross_entropy(xs, ws, ys, class_weight=cw, label_smoothing=0.1,
                                     reduction="sum")
    loss.backward()
    # float64 of the same values: the weight as the inputs' dtype rounds it, its gradient exact
    w64 = w.to(dtype).double().cpu().requires_grad_()
    ref = F.cross_entropy(xs.double().cpu() @ w64.T, y.detach().double().cpu(), reduction="sum",
                          weight=cw.double().cpu(), label_smoothing=0.1)
    ref.backward()
    err = (ws.grad.double().cpu() - w64.grad).norm() / w64.grad.norm()
    assert ws.grad.dtype == torch.float32
    assert err < 2.0 ** -16, f"master weights' gradient off by {err:.3g} (fp32-level expected)"


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_layouts_and_outputs(device):
    x, w, b, y, cw = _inputs(torch.float32, device, seed=2)
    logits = (x @ w.T + b).reshape(4, 6, V).movedim(-1, 1).contiguous()  # (N, C, d1)
    target = y.reshape(4, 6, V).movedim(-1, 1).contiguous()
    loss, lse, ent, acc = flce.cross_entropy(logits, target, cw, reduction="none",
                                             softcap=8.0, temperature=0.9, return_lse=True,
                                             return_entropy=True, return_accuracy=True)
    z = (logits.double().cpu().movedim(1, -1).reshape(-1, V))
    z = 8.0 * torch.tanh(z / 8.0) / 0.9
    yy = target.double().cpu().movedim(1, -1).reshape(-1, V)
    ref = -(cw.double().cpu() * yy * torch.log_softmax(z, 1)).sum(1)
    _close(loss.reshape(-1), ref, torch.float32, "loss")
    _close(lse.reshape(-1), torch.logsumexp(z, 1), torch.float32, "lse")
    p = torch.softmax(z, 1)
    _close(ent.reshape(-1), -(p * torch.log(p)).sum(1), torch.float32, "entropy")
    assert torch.equal(acc.reshape(-1).cpu(), (z.argmax(1) == yy.argmax(1)).float())
    assert loss.shape == lse.shape == ent.shape == acc.shape == (4, 6)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_hidden_size(device):
    """D = 0 (every logit 0): torch's loss, -sum_c y_c log(1 / V), at every leading shape and
    reduction, and zero gradients (reshape(-1, 0) of the input raised before)."""
    _, _, _, y, _ = _inputs(torch.float32, device)
    for lead, reduction in (((N,), "mean"), ((4, 6), "none"), ((0,), "sum")):
        target = y[:math.prod(lead)].reshape(*lead, V)
        x = torch.zeros(*lead, 0, device=device, requires_grad=True)
        w = torch.zeros(V, 0, device=device, requires_grad=True)
        loss = flce.linear_cross_entropy(x, w, target, reduction=reduction)
        ref = F.cross_entropy(torch.zeros(math.prod(lead), V, dtype=torch.float64),
                              target.double().cpu().reshape(-1, V), reduction=reduction)
        _close(loss, ref.reshape(loss.shape), torch.float32, f"loss {lead} {reduction}")
        loss.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and not w.grad.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("margin", [20.0, 40.0, 80.0])
def test_collapse_safe(device, margin):
    """A target that puts all but 1e-30 of its mass on the dominant class, at margin m: the loss
    is ~ (V - 1) e^-m + 1e-30 m, which torch's lse - sum_c y_c z_c (float32) gets wrong; flce
    holds fp32's relative accuracy against float64."""
    z = torch.zeros(3, V)
    z[:, 5] = margin
    z[1, 7] = margin / 2
    y = torch.full((3, V), 1e-30 / (V - 1))
    y[:, 5] = 1.0
    ref = reference.soft_cross_entropy(z.double(), y.double(), reduction="none")[0]
    got = flce.cross_entropy(z.to(device), y.to(device), reduction="none").cpu().double()
    assert torch.all(ref > 0)
    rel = ((got - ref).abs() / ref).max().item()
    assert rel < 1e-5, rel
    torch_rel = ((F.cross_entropy(z, y, reduction="none").double() - ref).abs() / ref).max()
    if margin >= 40.0:
        assert torch_rel > 0.1  # the peer's collapse this test guards against
    # and through the classifier: the same logits from x @ w.T with an identity classifier
    got_lin = flce.linear_cross_entropy(z.to(device), torch.eye(V, device=device), y.to(device),
                                        reduction="none").cpu().double()
    assert ((got_lin - ref).abs() / ref).max().item() < 1e-5


def test_refusals():
    x, w, b, y, cw = _inputs(torch.float32, "cpu")
    with pytest.raises(ValueError, match="probability targets must have shape"):
        flce.linear_cross_entropy(x, w, y[:, :-1])
    with pytest.raises(ValueError, match="shift=True takes class-index targets"):
        flce.linear_cross_entropy(x.reshape(4, 6, D), w, y.reshape(4, 6, V), shift=True)
    with pytest.raises(TypeError, match="class indices .* or probabilities"):
        flce.cross_entropy(x @ w.T, y.to(torch.complex64))


def test_composite_pivot_gradient_with_tiny_off_pivot_mass():
    # The composite path (a functorch transform here; also targets that require grad and float64)
    # left the pivot's own term in its sum of y_c (z_a - z_c): the pivot's gradient then came out
    # as (sum_c y_c) - y_a, which loses off-pivot mass below y_a's ulp: -5.3e-13 where the answer
    # is +5.0e-9 (the fused path's).
    z = torch.tensor([[30.0, 0.5, -0.3, 0.1, 0.0, 0.2]])
    y = torch.full((1, 6), 1e-9)
    y[0, 0] = 1 - 5e-9
    got = torch.func.grad(lambda a: flce.cross_entropy(a, y, reduction="sum"))(z)
    fused = z.clone().requires_grad_()
    flce.cross_entropy(fused, y, reduction="sum").backward()
    want = torch.func.grad(lambda a: flce.reference.soft_cross_entropy(a, y.double(),
                                                                       reduction="sum"))(z.double())
    assert want[0, 0] > 0 and got[0, 0] > 0
    assert rel_err(got, want) < 1e-5 and rel_err(fused.grad, want) < 1e-5


_U32 = 2.0 ** -24


@pytest.mark.parametrize("device,n,v", [
    pytest.param("cpu", 64, 32000, id="cpu"),
    pytest.param("cuda", 64, 32000, id="cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    # (the host emulation at a size it runs in seconds)
    pytest.param("cpu", 8, 4000, id="cuda-host", marks=pytest.mark.cuda_host),
])
@pytest.mark.parametrize("target", ["class", "probabilities"])
def test_pivot_gradient_with_class_weights_and_smoothing(device, n, v, target, request,
                                                         monkeypatch):
    """Liger's test_correctness_with_weight_with_other_params_once case: randn logits, class
    weights rand(V), label smoothing 0.1, "sum". At each row's largest logit that is not its
    target, dz_a = Y p_a - y_a is small beside Y; the collapse-safe pivot form (A - Y) p_a -
    Y q_a + y_rest cancelled to it from terms of Y: 1.4e-4 relative off float64 in fp32, ~2000
    roundings of its terms A p_a + y_a (torch's F.cross_entropy: 25-65). Held to 8 + log2(2V)
    roundings: p_a's divisor is a sum of V fp32 exponentials, as every fp32 softmax's (measured:
    6-17 at V = 32000). The CUDA backend on its fused soft ops (FLCE_CUDA_OPT_IN=distributions), which
    share math.h's formula; its default, the composite path, is
    test_composite_pivot_gradient_with_class_weights_and_smoothing's."""
    if request.node.callspec.id.endswith(("cuda", "cuda-host")):
        monkeypatch.setenv("FLCE_CUDA_OPT_IN", "distributions")
    g = torch.Generator().manual_seed(51)
    x = torch.randn(n, v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    w = torch.rand(v, generator=g)
    if target == "class":
        tgt = t
    else:  # a sharp distribution whose mode is not the pivot (the same cancellation)
        tgt = torch.softmax(torch.randn(n, v, generator=g) * 4, 1)
    xs = x.clone().to(device).requires_grad_()
    flce.cross_entropy(xs, tgt.to(device), w.to(device), label_smoothing=0.1,
                       reduction="sum").backward()
    x64 = x.double().requires_grad_()
    if target == "class":
        reference.logits_cross_entropy(x64, t, weight=w.double(), label_smoothing=0.1,
                                       reduction="sum").backward()
        y = w.double() * 0.1 / v + torch.zeros(n, v, dtype=torch.float64).scatter(
            1, t[:, None], (w.double()[t] * 0.9)[:, None])
    else:
        reference.soft_cross_entropy(x64, tgt.double(), weight=w.double(), label_smoothing=0.1,
                                     reduction="sum").backward()
        y = w.double() * (0.9 * tgt.double() + 0.1 / v)
    a = x.argmax(1, keepdim=True)
    p_a = torch.softmax(x.double(), 1).gather(1, a)[:, 0]
    y_a = y.gather(1, a)[:, 0]
    terms = y.sum(1) * p_a + y_a
    got = xs.grad.cpu().double().gather(1, a)[:, 0]
    want = x64.grad.gather(1, a)[:, 0]
    assert torch.all(y_a < 0.01 * y.sum(1))  # the pivot is not (mostly) the target
    err = (got - want).abs() / (_U32 * terms)
    limit = 8 + math.log2(2 * v)
    assert err.max().item() <= limit, f"pivot gradient {err.max().item():.1f} roundings off"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["linear", "logits"])
def test_weighted_mean_over_zero_weights_is_nan_like_torch(device, entry):
    """Class weights with label smoothing, "mean", where every non-ignored target weighs 0:
    torch's mean is 0/0 = NaN (the smoothing's terms keep the weighted sum positive), and so are
    its gradients of those tokens' logits (those of ignored tokens 0). flce gave inf."""
    g = torch.Generator().manual_seed(52)
    z = torch.randn(N, V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[::4] = -100
    w = torch.rand(V, generator=g) + 0.5
    w[t[t != -100]] = 0.0
    zs = z.clone().requires_grad_()
    ref = F.cross_entropy(zs, t, w, label_smoothing=0.1)
    ref.backward()
    assert ref.isnan()
    if entry == "logits":
        zf = z.clone().to(device).requires_grad_()
        got = flce.cross_entropy(zf, t.to(device), w.to(device), label_smoothing=0.1)
        got.backward()
        grad = zf.grad.cpu()
    else:
        zf = z.clone().to(device).requires_grad_()
        got = flce.linear_cross_entropy(zf, torch.eye(V, device=device), t.to(device),
                                        class_weight=w.to(device), label_smoothing=0.1)
        got.backward()
        grad = zf.grad.cpu()
    assert got.isnan(), got
    assert torch.equal(grad.isnan(), zs.grad.isnan()), (grad.isnan().sum(1), zs.grad.isnan().sum(1))
    assert torch.all(grad[~zs.grad.isnan()] == zs.grad[~zs.grad.isnan()])


def _pivot_case(n, v, target):
    """Liger's case above: randn logits, class weights rand(V), label smoothing 0.1, "sum",
    class or (sharp) probability targets whose mode is not the pivot; with its float64 gradient
    and target weights y."""
    g = torch.Generator().manual_seed(51)
    x = torch.randn(n, v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    w = torch.rand(v, generator=g)
    x64 = x.double().requires_grad_()
    if target == "class":
        tgt = t
        reference.logits_cross_entropy(x64, t, weight=w.double(), label_smoothing=0.1,
                                       reduction="sum").backward()
        y = w.double() * 0.1 / v + torch.zeros(n, v, dtype=torch.float64).scatter(
            1, t[:, None], (w.double()[t] * 0.9)[:, None])
    else:
        tgt = torch.softmax(torch.randn(n, v, generator=g) * 4, 1)
        reference.soft_cross_entropy(x64, tgt.double(), weight=w.double(), label_smoothing=0.1,
                                     reduction="sum").backward()
        y = w.double() * (0.9 * tgt.double() + 0.1 / v)
    return x, tgt, w, x64.grad, y


@pytest.mark.parametrize("target", ["class", "probabilities"])
def test_composite_pivot_gradient_with_class_weights_and_smoothing(target):
    """The composite path (torch.func.grad here; float64, double backward and targets that
    require grad take it too, and CUDA's probability targets by default) at each row's largest
    logit that is not its target: dz_a = Y p_a - y_a. flce.reference's collapse-safe form gave
    autograd -Y q_a + y_rest there, which cancels from terms of Y: 417 fp32 roundings of the
    terms Y p_a + y_a at V = 4000. Held to the fused ops' bound, 8 + log2(2V) (measured: 3-5)."""
    n, v = 8, 4000
    x, tgt, w, want, y = _pivot_case(n, v, target)
    got = torch.func.grad(lambda z: flce.cross_entropy(z, tgt, w, label_smoothing=0.1,
                                                       reduction="sum"))(x)
    a = x.argmax(1, keepdim=True)
    p_a = torch.softmax(x.double(), 1).gather(1, a)[:, 0]
    y_a = y.gather(1, a)[:, 0]
    assert torch.all(y_a < 0.01 * y.sum(1)) and torch.all(p_a < 0.5)
    err = (got.double().gather(1, a)[:, 0] - want.gather(1, a)[:, 0]).abs() / (
        _U32 * (y.sum(1) * p_a + y_a))
    limit = 8 + math.log2(2 * v)
    assert err.max().item() <= limit, f"pivot gradient {err.max().item():.1f} roundings off"
    # and every other column, at fp32's accuracy of the row's largest entry
    assert rel_err(got, want) < 1e-6


def test_composite_pivot_forms_agree_in_float64():
    """flce.reference takes a row's loss in one of two forms by whether its pivot's p_a is at
    most 1/2: both sides of that switch (and a row at it) through gradcheck, gradgradcheck,
    forward-mode AD and vmap, with the probability targets differentiated too."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(5, 7, dtype=torch.float64, generator=gen)
    z[0, 2] += 6.0  # p_a near 1: the collapse-safe form
    z[1, 4] += 1.0  # p_a < 1/2
    z[2, :] = 0.0
    z[2, 1] = math.log(6.0)  # p_a = 1/2 (up to a rounding)
    q = torch.softmax(torch.randn(5, 7, dtype=torch.float64, generator=gen), 1)
    cw = torch.rand(7, dtype=torch.float64, generator=gen) + 0.5
    p_a = torch.softmax(z, 1).amax(1)
    assert (p_a > 0.5).any() and (p_a < 0.49).any()

    def f(zz, qq):
        return reference.soft_cross_entropy(zz, qq, weight=cw, label_smoothing=0.1,
                                            z_loss=1e-2, reduction="none")[0]

    z.requires_grad_()
    q.requires_grad_()
    assert torch.autograd.gradcheck(f, (z, q))
    assert torch.autograd.gradgradcheck(f, (z, q))
    gz, = torch.autograd.grad(f(z, q).sum(), z)
    z, q = z.detach(), q.detach()
    tz = torch.randn(z.shape, dtype=torch.float64, generator=gen)
    _, tangent = torch.func.jvp(lambda zz: f(zz, q).sum(), (z,), (tz,))
    torch.testing.assert_close(tangent, (gz * tz).sum(), rtol=1e-12, atol=1e-12)
    per_row = torch.func.vmap(torch.func.grad(lambda zz, qq: f(zz[None], qq[None]).sum()))(z, q)
    torch.testing.assert_close(per_row, gz, rtol=1e-12, atol=0)
