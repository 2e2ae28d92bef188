"""The fused logits path of the CUDA single pass (FLCE_CUDA_FUSED_LOGITS=1, opt-in; docs/cuda.md
"Fused logits"): the logits GEMM's epilogue stores E = exp(z - r_tile) in bf16 and a partial per
(row, 256-column tile), and dz is computed over E in place (csrc/include/flce/tile_epilogue.h).

On "cuda-host" (and on a GPU without the sm_90a kernel) the epilogue is its SIMT stand-in over
cuBLAS's fp32 logits; on an H100/H200 the CUTLASS kernel. Either way: the loss against float64
at fp32 accuracy, every gradient element within the output rounding of the path's own ideal
(``fused_tile_ideal``: exact arithmetic but for E's and dz's roundings to bf16 and the final
one), norm-wise within 1.1x that ideal's error, and the ideal within 1.1x the exact path's (two
bf16 roundings of the tile where the exact path has one).
"""
import math

import pytest
import torch

import flce
from helpers import (CUDA_DEVICES, LOSS_FACTOR, as_f64, assert_close_to_ref, ideal_fp32_loss,
                     margin_inputs, rel_err, tile_ideal_grads)

TILE = 256  # params.h kFusedTileCols


@pytest.fixture(params=CUDA_DEVICES)
def dev(request):
    return request.param


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("FLCE_CUDA_FUSED_LOGITS", "1")


def _inputs(n, v, d, *, seed=0, device="cpu", bias=False, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * scale).bfloat16().to(device)
    w = (torch.randn(v, d, generator=g) / d ** 0.5).bfloat16().to(device)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    b = (torch.randn(v, generator=g) * 0.5).bfloat16().to(device) if bias else None
    return x, w, t, b


def fused_tile_ideal(x, w, t, b, objective, **opts):
    """dE and dW as the fused path computes them at best: float64 logits z and gradient dz of
    the reduced objective, each non-target stored value q_j = E_j c_j (E_j = exp(z_j - r), r:
    the max of the row's non-target logits in its 256-column tile; c_j = softcap'(z_j), 1
    without softcap) rounded to bf16, dz_j = bf16(bf16(q_j) * dz_j / q_j) (the factor
    f = dz_j / q_j exact), the target entry exact (the fp32 corrections), exact products; the
    caller rounds once."""
    x64, w64, b64 = (None if a is None else a.detach().cpu() for a in as_f64(x, w, b))
    u = x64 @ w64.T
    if b64 is not None:
        u = u + b64
    u.requires_grad_()
    kw = {k: v for k, v in opts.items() if k in ("ignore_index", "reduction", "z_loss",
                                                  "temperature", "softcap")}
    loss, lse, ent = flce.reference.logits_cross_entropy(u, t.cpu(), return_lse=True,
                                                         return_entropy=True, **kw)
    objective(loss, lse, ent).backward()
    dz = u.grad
    cap, temp = opts.get("softcap") or 0.0, opts.get("temperature", 1.0)
    c = u.detach()
    chain = torch.ones_like(c)
    if cap > 0:
        c = cap * torch.tanh(c / cap)
        chain = 1 - (c / cap) ** 2
    z = c / temp
    n, v = z.shape
    tt = t.cpu()
    own = (tt != opts.get("ignore_index", -100)) & (tt >= 0) & (tt < v)
    rows = torch.arange(n)[own]
    masked = z.clone()
    masked[rows, tt[own]] = -math.inf
    pad = (-v) % TILE
    r = torch.nn.functional.pad(masked, (0, pad), value=-math.inf)
    r = r.view(n, -1, TILE).amax(-1).repeat_interleave(TILE, dim=1)[:, :v]
    e = torch.exp(z - r) * chain
    ok = torch.isfinite(e) & (e > 0)  # (a tile of the target alone has r = -inf: replaced below)
    e = torch.where(ok, e, 1.0)
    hi = torch.where(ok, (e.to(torch.bfloat16).double() * (dz / e)).to(torch.bfloat16).double(), 0)
    # the bias: column sums of the fp32 dz (E rounded, dz not yet), the target entries exact
    g32 = torch.where(ok, e.to(torch.bfloat16).double() * (dz / e), 0)
    g32[rows, tt[own]] = dz[rows, tt[own]]
    hi[rows, tt[own]] = dz[rows, tt[own]]
    return {"input": hi @ w64, "weight": hi.T @ x64, "bias": g32.sum(0)}


def _run(x, w, t, b=None, train_bias=False, **opts):
    """flce's single pass (reduction sum or mean) against float64: the loss, and each gradient
    against the fused ideal. Returns {name: (err, fused ideal err, exact-path ideal err)}."""
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    bg = b.detach().requires_grad_() if train_bias else b
    loss = flce.linear_cross_entropy(xg, wg, t, bias=bg, **opts)
    loss.backward()
    x64, w64, b64 = (None if a is None else a.detach().cpu().requires_grad_()
                     for a in as_f64(x, w, b))
    rloss = flce.reference.linear_cross_entropy(x64, w64, t.cpu(), bias=b64, **opts)
    rloss.backward()
    assert_close_to_ref(loss, rloss, torch.float32, factor=LOSS_FACTOR, what="loss")
    objective = lambda l, s, h: l  # noqa: E731
    ideal = fused_tile_ideal(x, w, t, b, objective, **opts)
    exact = tile_ideal_grads(x, w, t, b, objective, **opts)
    out = {}
    if train_bias:
        # the column sums of the fp32 dz: within the output rounding of the path's ideal, which
        # stays near the floor (the rounded float64 gradient)
        ref = b64.grad
        assert bg.grad.dtype == b.dtype and torch.isfinite(bg.grad).all()
        assert_close_to_ref(bg.grad, ideal["bias"], b.dtype, factor=1.0, what="grad bias")
        if ref.abs().max() > 0:  # (V = 1: the only column is the target, 0)
            err, ideal_err = rel_err(bg.grad, ref), rel_err(ideal["bias"].to(b.dtype), ref)
            floor = rel_err(ref.to(b.dtype), ref)
            assert err <= 1.1 * ideal_err + 1e-6 and ideal_err <= 1.1 * floor + 1e-6, (
                err, ideal_err, floor)
            out["bias"] = (err, ideal_err, floor)
    for name, got, ref in (("input", xg.grad, x64.grad), ("weight", wg.grad, w64.grad)):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        assert_close_to_ref(got, ideal[name], torch.bfloat16, factor=1.0,
                            what=f"grad {name} (fused ideal)")
        if ref.abs().max() == 0:  # (V = 1: the only column is the target)
            assert (got == 0).all(), name
            continue
        err, ideal_err = rel_err(got, ref), rel_err(ideal[name].to(torch.bfloat16), ref)
        exact_err = rel_err(exact[name].to(torch.bfloat16), ref)
        assert err <= 1.1 * ideal_err + 1e-6, (name, err, ideal_err)
        assert ideal_err <= 1.1 * exact_err + 1e-6, (name, ideal_err, exact_err)
        out[name] = (err, ideal_err, exact_err)
    return out


SHAPES = [(1, 1, 8), (3, 5, 8), (37, 301, 72), (67, 513, 40), (130, 1000, 136), (200, 4099, 64)]
OPTIONS = {
    "plain": {},
    "mean_ignored_temperature_zloss": {"reduction": "mean", "ignore_index": 7,
                                       "temperature": 0.7, "z_loss": 1e-4},
    "sum_bias": {"reduction": "sum", "bias": True},
    "mean_trained_bias_softcap": {"reduction": "mean", "bias": True, "train_bias": True,
                                  "softcap": 6.0},
    "softcap_temperature": {"reduction": "mean", "softcap": 4.0, "temperature": 1.3},
}


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_matches_reference(dev, fused, shape, opts):
    opts = dict(opts)
    x, w, t, b = _inputs(*shape, device=dev, bias=opts.pop("bias", False))
    if "ignore_index" in opts:
        t[1::3] = opts["ignore_index"]
    # a bias without a gradient (a trained one takes the exact path)
    errs = _run(x, w, t, b, **opts)
    print({k: tuple(f"{e:.2e}" for e in v) for k, v in errs.items()})


def _grads(x, w, t, b=None, **opts):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    bg = b.detach().requires_grad_() if b is not None else None
    loss = flce.linear_cross_entropy(xg, wg, t, bias=bg, **opts)
    loss.backward()
    return [loss.detach(), xg.grad, wg.grad] + ([bg.grad] if bg is not None else [])


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_fused_is_taken_exactly_where_it_holds(dev, monkeypatch):
    """With the flag, bf16 gradients change (the fused path ran: E's rounding), with softcap and
    a trained bias as well; label smoothing, fp32 and master weights keep the exact path bit for
    bit."""
    x, w, t, b = _inputs(64, 700, 48, device=dev, bias=True)

    def both(*args, **opts):
        monkeypatch.setenv("FLCE_CUDA_FUSED_LOGITS", "0")
        off = _grads(*args, **opts)
        monkeypatch.setenv("FLCE_CUDA_FUSED_LOGITS", "1")
        return off, _grads(*args, **opts)

    for args, opts in [((x, w, t), {}), ((x, w, t), {"softcap": 15.0}), ((x, w, t, b), {})]:
        off, on = both(*args, **opts)
        assert not _same(off[1:], on[1:]), f"the flag changed nothing: no fused path ({opts})"
    for args, opts in [((x, w, t), {"label_smoothing": 0.1}),
                       ((x, w, t), {"label_smoothing": 0.1, "softcap": 15.0}),
                       ((x.float(), w.float(), t), {}),
                       ((x, w.float(), t), {})]:
        off, on = both(*args, **opts)
        assert _same(off, on), opts


def test_fused_deterministic(dev, fused):
    x, w, t, _ = _inputs(150, 2000, 64, device=dev)
    assert _same(_grads(x, w, t), _grads(x, w, t))


def test_fused_chunked(dev, fused, monkeypatch):
    """Groups and sub-chunks (a 0.6 MiB workspace: sub-chunks of 64 rows, 2 groups)."""
    x, w, t, _ = _inputs(450, 1200, 48, device=dev)
    t[::5] = -100
    full = _grads(x, w, t)
    monkeypatch.setenv("FLCE_CUDA_WORKSPACE_MB", "0.6")
    _run(x, w, t)
    chunked = _grads(x, w, t)
    torch.testing.assert_close(chunked[0], full[0], rtol=1e-6, atol=0)
    for a, c in zip(full[1:], chunked[1:]):
        assert rel_err(c, a) < 2e-3


@pytest.mark.parametrize("margin", [0, 20, 50, 80])
def test_fused_collapse_margins(dev, fused, margin):
    """Every row at target margin m: the loss keeps fp32 accuracy (its statistics come from the
    fp32 accumulators, not from E) and does not collapse; the gradients stay at the fused
    ideal while they are normal numbers. (At margin 80 the loss, ~V e^-80, is still a normal
    fp32 number; beyond ~100 it underflows, and test_accuracy's margin 200 holds every path to
    "not collapsed where representable" only.)"""
    x, w, t, b, _ = margin_inputs(16, 4099, 64, margin, torch.bfloat16, seed=margin)
    # (its weight is fp32 holding bf16 values, its bias fp32: both bf16 here; the bias carries
    # the margin, untrained)
    x, w, t, b = x.to(dev), w.to(dev, torch.bfloat16), t.to(dev), b.to(dev, torch.bfloat16)
    xg = x.detach().requires_grad_()
    loss = flce.linear_cross_entropy(xg, w, t, bias=b, reduction="sum")
    loss.backward()
    x64, w64, b64 = as_f64(x.cpu(), w.cpu(), b.cpu())
    rloss = flce.reference.linear_cross_entropy(x64, w64, t.cpu(), bias=b64, reduction="sum")
    ideal = ideal_fp32_loss(x.cpu(), w.cpu(), t.cpu(), b.cpu()).sum()
    ideal_err = ((ideal - rloss).abs() / rloss).item()
    err = ((loss.detach().cpu().double() - rloss).abs() / rloss).item()
    print(f"margin {margin}: loss rel err {err:.2e}, ideal fp32 {ideal_err:.2e}")
    assert loss.item() > 0 or rloss.item() < 2.0 ** -149, "collapsed"
    assert err <= 1e-7 + 3 * ideal_err + 2.0 ** -149 / rloss.item(), (err, ideal_err)
    if margin <= 50:
        _run(x, w, t, b, reduction="sum")


def test_fused_nan_and_ignored_rows(dev, fused):
    x, w, t, _ = _inputs(40, 600, 32, device=dev)
    xn = x.clone()
    xn[3, 5] = float("nan")
    loss, gx, gw = _grads(xn, w, t, reduction="sum")
    assert torch.isnan(loss) and torch.isnan(gx[3]).all()
    wn = w.clone()
    wn[300, 0] = float("inf")
    assert torch.isnan(_grads(x, wn, t, reduction="sum")[0])
    # every row ignored: mean is NaN (as torch), the gradients 0
    t_ign = torch.full_like(t, -100)
    loss, gx, gw = _grads(x, w, t_ign)
    assert torch.isnan(loss) and (gx == 0).all() and (gw == 0).all()
