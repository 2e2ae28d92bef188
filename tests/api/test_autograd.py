"""Autograd beyond first derivatives, against float64: forward-mode AD (torch.func.jvp and
torch.autograd.forward_ad), double backward, torch.func.grad / vmap, and float64 inputs through
gradcheck / gradgradcheck. None of these may be silently zero, None or wrong: they either match
the float64 reference or raise an error that names the feature."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import flce
from helpers import as_f64, gen, needs_torch_lce, rand_inputs, randn, rel_err

N, V, D = 10, 37, 12
OPTS = [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 4.0, "temperature": 0.7}]


def _inputs(device, dtype=torch.float32, seed=3):
    x, w, t, b = rand_inputs(N, V, D, dtype, device, seed=seed, bias=True, scale=3.0)
    t = t.clone()
    t[2] = -100
    return x, w, t, b


def _ref(x, w, t, b, **kw):
    """float64 flce.reference on the values flce computes with (detached, CPU)."""
    x64, w64, b64 = (a.detach().cpu() for a in as_f64(x, w, b))
    return x64, w64, b64, lambda xx, ww, bb: flce.reference.linear_cross_entropy(
        xx, ww, t.cpu(), bias=bb, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", OPTS, ids=["plain", "options"])
def test_jvp_matches_float64(device, dtype, reduction, opts):
    x, w, t, b = _inputs(device, dtype)
    g = gen(7)
    vx = randn(x.shape, dtype, device, g)
    vw = randn(w.shape, dtype, device, g)

    def f(xx, ww):
        return flce.linear_cross_entropy(xx, ww, t, bias=b, reduction=reduction, **opts)

    out, tangent = torch.func.jvp(f, (x, w), (vx, vw))
    x64, w64, b64, ref = _ref(x, w, t, b, reduction=reduction, **opts)
    rout, rtan = torch.func.jvp(lambda xx, ww: ref(xx, ww, b64), (x64, w64),
                                (vx.cpu().double(), vw.cpu().double()))
    assert out.dtype == torch.float32 and tangent.dtype == torch.float32
    assert rel_err(out, rout) < 1e-5
    # The logits of 16-bit inputs are exact products summed in fp32, as in the fused path.
    assert rel_err(tangent, rtan) < 1e-5, (tangent, rtan)
    assert tangent.abs().sum() > 0


def test_forward_ad_dual_tensors(device):
    x, w, t, b = _inputs(device)
    v = randn(x.shape, torch.float32, device, gen(8))
    with fwAD.dual_level():
        loss = flce.linear_cross_entropy(fwAD.make_dual(x, v), w, t, bias=b, return_lse=True,
                                         return_entropy=True, reduction="none")
        tangents = [fwAD.unpack_dual(o).tangent for o in loss]
    x64, w64, b64, ref = _ref(x, w, t, b, reduction="none", return_lse=True,
                              return_entropy=True)
    _, rtan = torch.func.jvp(lambda xx: ref(xx, w64, b64), (x64,), (v.cpu().double(),))
    for got, want in zip(tangents, rtan):
        assert got is not None
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", OPTS, ids=["plain", "options"])
def test_double_backward_matches_float64(device, reduction, opts):
    """d/dw ||dL/dx||^2, d/dx ||dL/dw||^2 and d/db ||dL/dx||^2 through the recompute path, with
    the lse and the entropy in the objective."""
    x, w, t, b = _inputs(device)
    x64, w64, b64, ref = _ref(x, w, t, b, reduction=reduction, return_lse=True,
                              return_entropy=True, **opts)
    up = torch.rand(N, generator=gen(9), dtype=torch.float64) + 0.5

    def objective(out, u):
        loss, lse, ent = out
        return (loss * u).sum() + (0.3 * lse * u).sum() - (0.2 * ent * u).sum()

    def second(xx, ww, bb, f, u):
        xx, ww, bb = (a.detach().requires_grad_() for a in (xx, ww, bb))
        gx, gw = torch.autograd.grad(objective(f(xx, ww, bb), u), (xx, ww), create_graph=True)
        a = torch.autograd.grad((gx * gx).sum(), (ww, bb), retain_graph=True)
        c = torch.autograd.grad((gw * gw).sum(), (xx,))
        return a + c

    got = second(x, w, b, lambda xx, ww, bb: flce.linear_cross_entropy(
        xx, ww, t, bias=bb, reduction=reduction, return_lse=True, return_entropy=True,
        single_pass=False, **opts), up.float())
    want = second(x64, w64, b64, ref, up)
    for g_, w_ in zip(got, want):
        assert g_ is not None and g_.abs().sum() > 0
        assert rel_err(g_, w_) < 2e-5, rel_err(g_, w_)


def test_double_backward_of_the_single_pass_raises(device):
    x, w, t, b = _inputs(device)
    xg = x.clone().requires_grad_()
    loss = flce.linear_cross_entropy(xg, w.requires_grad_(), t, bias=b, single_pass=True)
    with pytest.raises(RuntimeError, match="double backward.*single_pass=False"):
        torch.autograd.grad(loss, xg, create_graph=True)


def test_func_grad_and_vmap(device):
    x, w, t, b = _inputs(device)

    def f(ww, xx, tt):
        return flce.linear_cross_entropy(xx, ww, tt, bias=b)

    gw = torch.func.grad(f)(w, x, t)
    wr = w.clone().requires_grad_()
    f(wr, x, t).backward()
    assert rel_err(gw, wr.grad) < 1e-6
    # per-example weight gradients: vmap over rows of (x, t)
    per = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, 0))(w, x[:, None], t[:, None])
    for i in (0, 1, 5):
        wi = w.clone().requires_grad_()
        f(wi, x[i:i + 1], t[i:i + 1]).backward()
        if t[i] == -100:
            assert torch.isnan(per[i]).all() or (per[i] == 0).all()
        else:
            assert rel_err(per[i], wi.grad) < 1e-6


@pytest.mark.parametrize("opts", OPTS, ids=["plain", "options"])
def test_gradcheck_float64(device, opts):
    x, w, t, b = (a.detach() for a in _inputs(device))
    x, w, b = (a.double().requires_grad_() for a in (x[:5], w[:9, :4], b[:9]))
    x = x[:, :4].detach().requires_grad_()
    t = t[:5].clamp(max=8)

    def f(xx, ww, bb):
        loss, lse, ent = flce.linear_cross_entropy(xx, ww, t, bias=bb, reduction="none",
                                                   return_lse=True, return_entropy=True, **opts)
        return loss, lse, ent

    assert f(x, w, b)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(f, (x, w, b))
    mean = flce.linear_cross_entropy(x, w, t, bias=b, **opts)
    ref = flce.reference.linear_cross_entropy(x, w, t, bias=b, **opts)
    assert mean.dtype == torch.float64 and rel_err(mean, ref) < 1e-14


@needs_torch_lce
def test_torch_linear_cross_entropy_gradcheck_case():
    """PyTorch's test_linear_cross_entropy.py gradchecks F.linear_cross_entropy in float64; the
    same call through flce (torch's keyword names)."""
    g = gen(11)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (6,), generator=g)
    assert torch.autograd.gradcheck(
        lambda xx, ww, bb: flce.linear_cross_entropy(xx, linear_weight=ww, target=t,
                                                     linear_bias=bb, label_smoothing=0.2),
        (x, w, b))
    ref = torch.nn.functional.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.2)
    assert rel_err(flce.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.2), ref) < 1e-14


def test_reference_edge_cases():
    """V = 1: the entropy is 0 (only the target); ignore_index=None is -100, as in flce."""
    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(1, 4, dtype=torch.float64)
    t = torch.zeros(3, dtype=torch.int64)
    loss, ent = flce.reference.linear_cross_entropy(x, w, t, reduction="none",
                                                    return_entropy=True)
    assert torch.equal(loss, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(ent.abs(), torch.zeros(3, dtype=torch.float64))
    w5 = torch.randn(5, 4, dtype=torch.float64)
    t = torch.tensor([1, -100, 3])
    assert torch.equal(flce.reference.linear_cross_entropy(x, w5, t, ignore_index=None),
                       flce.reference.linear_cross_entropy(x, w5, t))
