"""return_predicted_tokens (Liger's option): each token's argmax, int64, -1 where ignored and
where the logits hold a NaN, against torch.argmax of float64 logits, on every backend (``device``:
the CPU backend, the CUDA backend on a GPU and under the host emulation). Exact ties come from
small integer inputs (their fp32 and bf16 logits are exact): between classes, with the target,
across the CPU backend's vocabulary tiles (256 columns for fp32, 2048 for 16-bit inputs) and
logits chunks (4096), in rows that the backend's workers split among themselves; across the
CUDA row kernels' 4096-column tiles, their threads' columns, and the chunks of rows of the
linear op (a small workspace)."""
import pytest
import torch

import flce
from helpers import as_f64, gen, rand_inputs

IGNORE = -100


def _ints(shape, g, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, generator=g).float()


def _want(z64, target=None, ignore_index=IGNORE):
    """torch.argmax of float64 logits, -1 for ignored targets and rows with a NaN."""
    bad = torch.isnan(z64).any(-1)
    if target is not None:
        bad = bad | (target == ignore_index)
    return torch.where(bad, -1, z64.argmax(-1))


def _tied(z64):
    """Rows whose largest logit is held by more than one column."""
    return (z64 == z64.max(-1, keepdim=True).values).sum(-1) > 1


def _case(n=48, v=5000, d=8, seed=0):
    """Integer hidden states and classifier: logits with many exact ties. Targets: the row's
    argmax (rows 0-7), a column tied with it, the highest or the lowest (8-15), ignored (16-19),
    random elsewhere; columns 7 and v - 5 hold the row's largest logit, 150, in rows 20-23 (tiles
    apart: the earlier one is the argmax, row 20's target the later one), column v - 9 a larger
    one, 180, in rows 24-27 (a later tile's; row 24's target is column 7, 150 there)."""
    g = gen(seed)
    x, w = _ints((n, d), g), _ints((v, d), g)
    e0, e1 = (torch.arange(d) == 0).float(), (torch.arange(d) == 1).float()
    w[7], w[v - 5], w[v - 9] = 50.0 * e0, 50.0 * e0, 60.0 * e1
    x[20:24, 0], x[20:24, 1] = 3.0, 0.0
    x[24:28, 1] = 3.0
    z = x.double() @ w.double().T
    t = torch.randint(0, v, (n,), generator=g)
    t[0:8] = z[0:8].argmax(1)
    for i in range(8, 16):
        tied = (z[i] == z[i].max()).nonzero()[:, 0]
        t[i] = tied[-1] if i % 2 else tied[0]
    t[16:20] = IGNORE
    t[20] = v - 5
    t[24] = 7
    return x, w, t


def _to(device, *tensors):
    return tuple(a.to(device) for a in tensors)


@pytest.mark.parametrize("entry", ["linear", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_exact_ties(entry, dtype, reduction, device):
    x, w, t = _case()
    z64 = x.double() @ w.double().T
    x, w, t = _to(device, x, w, t)
    if entry == "linear":
        out = flce.linear_cross_entropy(x.to(dtype), w.to(dtype), t, reduction=reduction,
                                        return_predicted_tokens=True, return_accuracy=True)
    else:
        # (|z| <= 180: integers that bf16's 8 significant bits hold exactly)
        z = (x @ w.T).to(dtype)
        assert torch.equal(z.double(), z64)
        out = flce.cross_entropy(z, t, reduction=reduction, return_predicted_tokens=True,
                                 return_accuracy=True)
    assert out._fields == ("loss", "accuracy", "predicted_tokens")
    got = out.predicted_tokens.cpu()
    assert got.dtype == torch.int64 and got.shape == t.shape
    t = t.cpu()
    want = _want(z64, t)
    assert torch.equal(got, want), (got != want).nonzero()[:, 0].tolist()
    assert got[20].item() == 7 and got[24].item() == w.shape[0] - 9
    # (the case has ties with the target, and ones that it loses to a lower column)
    assert _tied(z64)[8:16].sum() >= 4 and (want[8:16] != t[8:16]).any()
    if reduction == "none":  # the accuracy's hits are the rows whose only argmax is the target
        hit = (got == t) & ~_tied(z64)
        assert torch.equal(out.accuracy.bool().cpu(), hit)


@pytest.mark.parametrize("entry", ["linear", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_random_inputs(entry, dtype, device):
    """Fresh random inputs, a bias, ignored tokens: given logits, exactly torch.argmax's column;
    fused logits (an fp32 GEMM), a column whose float64 logit is within the GEMM's rounding of
    the row's largest, and torch.argmax's wherever the two largest are further apart."""
    n, v, d = 96, 3000, 64
    x, w, t, b = rand_inputs(n, v, d, dtype, seed=11, bias=True, ignore_frac=0.2, scale=3.0)
    if entry == "logits":
        z = (x.float() @ w.float().T + b.float()).to(dtype)
        got = flce.cross_entropy(z.to(device), t.to(device), reduction="none",
                                 return_predicted_tokens=True)
        assert torch.equal(got.predicted_tokens.cpu(), _want(z.double(), t))
        return
    got = flce.linear_cross_entropy(*_to(device, x, w, t), bias=b.to(device),
                                    return_predicted_tokens=True,
                                    reduction="sum").predicted_tokens.cpu()
    x64, w64, b64 = as_f64(x, w, b)
    z64 = x64 @ w64.T + b64
    # fp32 accumulation of d products, then the bias: |error| <= (d + 1) 2^-24 (sum |x w| + |b|)
    bound = (d + 1) * 2.0 ** -24 * ((x64.abs() @ w64.abs().T) + b64.abs())
    valid = t != IGNORE
    assert torch.equal(got[~valid], torch.full_like(got[~valid], -1))
    rows = valid.nonzero()[:, 0]
    top = z64[rows].max(1).values
    picked = z64[rows, got[rows]]
    assert (picked >= top - 2 * bound[rows].max(1).values).all()
    top2 = z64[rows].topk(2, 1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound[rows].max(1).values
    assert clear.float().mean() > 0.9  # (the check below covers most rows)
    assert torch.equal(got[rows][clear], z64[rows][clear].argmax(1))


def test_nan_and_infinite_logits(device):
    """torch.argmax's answer for infinities (the lowest of tied +inf columns, the target's or
    not; a row of -inf: column 0); -1 for a row with a NaN, wherever it sits: the target's, a
    tile of its own, beside a +inf (whose tile's sum of exponentials is NaN anyway), after one.
    V = 5000: the logits' two chunks."""
    v = 5000
    z = _ints((12, v), gen(2))
    t = torch.tensor([4, 5, 6, 7, 8, 9, 4000, 9, 9, 1, 3, 2])
    inf, nan = float("inf"), float("nan")
    z[0, 200] = nan
    z[1, 3] = inf
    z[2, 6] = inf
    z[3] = -inf
    z[4, 8] = nan  # the target's logit
    z[5, 4500], z[5, 4501] = inf, nan
    z[6, 10], z[6, 4000] = inf, inf  # the target's +inf is the later one
    z[7, 9], z[7, 4000] = inf, inf  # the target's +inf is the earlier one
    z[8, 2], z[8, 9] = inf, inf
    z[9] = -inf
    z[9, 4999] = 0.0
    z[10, 10], z[10, 4600] = nan, inf
    z[11] = -inf
    z[11, 2] = 5.0  # only the target is finite
    want = [-1, 3, 6, 0, -1, -1, 10, 9, 2, 4999, -1, 2]
    # (torch.argmax: the first NaN where there is one)
    assert z.double().argmax(1).tolist() == [200, 3, 6, 0, 8, 4501, 10, 9, 2, 4999, 10, 2]
    for zz in (z, z.double()):  # fused; float64: the composite path
        got = flce.cross_entropy(zz.to(device), t.to(device), reduction="none",
                                 return_predicted_tokens=True)
        assert got.predicted_tokens.tolist() == want, zz.dtype


def test_linear_infinite_and_nan_bias(device):
    """The fused linear op on the same: a +inf bias at two columns (fp32 tiles apart), then a
    NaN one; one column (V = 1): its target."""
    x, w, t, b = _to(device, *rand_inputs(16, 3000, 16, seed=3, bias=True, ignore_frac=0.2))
    t[0], t[1] = 10, 2500
    b[10], b[2500] = float("inf"), float("inf")
    got = flce.linear_cross_entropy(x, w, t, bias=b, return_predicted_tokens=True,
                                    reduction="none").predicted_tokens
    assert torch.equal(got, torch.where(t == IGNORE, -1, 10))
    b[1700] = float("nan")
    got = flce.linear_cross_entropy(x, w, t, bias=b, return_predicted_tokens=True,
                                    reduction="none").predicted_tokens
    assert torch.equal(got, torch.full_like(t, -1))
    t1 = torch.where(t == IGNORE, IGNORE, 0)
    for bias in (None, torch.tensor([-float("inf")])):
        bias = None if bias is None else bias.to(device)
        got = flce.linear_cross_entropy(x, w[:1], t1, bias=bias, return_predicted_tokens=True,
                                        reduction="none").predicted_tokens
        assert torch.equal(got, torch.where(t == IGNORE, -1, 0))


@pytest.mark.parametrize("entry", ["linear", "logits"])
def test_options_shift_and_grads(entry, device):
    """Every loss option, the softcap and temperature (increasing, and not saturated here: the
    argmax of the raw logits), shift=True, the lse and entropy beside; the loss, lse and
    gradients are those of the call without predicted tokens."""
    x, w, t = _to(device, *_case(n=32, v=700, seed=1))
    kw = dict(label_smoothing=0.1, z_loss=1e-4, softcap=1e4, temperature=0.7, return_lse=True,
              return_entropy=True, return_predicted_tokens=True, reduction="sum")
    lead = (4, 8)
    if entry == "linear":
        leaf = x.reshape(*lead, -1).clone().requires_grad_()
        out = flce.linear_cross_entropy(leaf, w, t.reshape(lead), shift=True, **kw)
        ref = flce.linear_cross_entropy(leaf, w, t.reshape(lead), shift=True,
                                        **{**kw, "return_predicted_tokens": False})
        z64 = (x.double() @ w.double().T).reshape(*lead, -1)
        shifted = torch.cat([t.reshape(lead)[:, 1:], torch.full((4, 1), IGNORE, device=device)],
                            1)
        want = _want(z64, shifted)[:, :-1]
        assert out.predicted_tokens.shape == (4, 7)
    else:
        leaf = (x @ w.T).clone().requires_grad_()
        out = flce.cross_entropy(leaf, t, **kw)
        ref = flce.cross_entropy(leaf, t, **{**kw, "return_predicted_tokens": False})
        want = _want(leaf.detach().double(), t)
    assert torch.equal(out.predicted_tokens, want)
    assert (want >= 0).sum() > 20
    for a, r in zip(out[:3], ref):
        assert torch.equal(a, r)
    g1, = torch.autograd.grad(out.loss, leaf)
    g2, = torch.autograd.grad(ref.loss, leaf)
    assert torch.equal(g1, g2)
    if entry == "logits":  # the gradient written over the logits: the tokens were taken before
        z = leaf.detach().clone().requires_grad_()
        zi = z * 1.0
        out = flce.cross_entropy(zi, t, inplace_backward=True, **kw)
        assert torch.equal(out.predicted_tokens, want)
        out.loss.backward()
        assert torch.equal(z.grad, g2)


def test_training_call_takes_the_recompute_path(device):
    """With gradients and "mean" (where flce may choose the single pass, which returns the loss
    alone) the call takes the recompute path: the loss and gradients are single_pass=False's,
    bitwise; single_pass=True is refused, naming the option."""
    x, w, t = _to(device, *_case(n=40, v=600, seed=4))
    outs = []
    for kw in (dict(return_predicted_tokens=True), dict(single_pass=False)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = flce.linear_cross_entropy(xs, ws, t, **kw)
        loss = out.loss if kw.get("return_predicted_tokens") else out
        loss.backward()
        outs.append((loss, xs.grad, ws.grad))
        if kw.get("return_predicted_tokens"):
            assert torch.equal(out.predicted_tokens, _want(x.double() @ w.double().T, t))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="return_predicted_tokens"):
        flce.linear_cross_entropy(x.requires_grad_(), w, t, return_predicted_tokens=True,
                                  single_pass=True)


@pytest.mark.parametrize("case", ["float64", "probabilities", "weights+smoothing", "func"])
def test_composite_paths(case):
    """The paths that materialize the logits: float64, probability targets (the argmax of
    all the logits, none ignored), class weights with label smoothing, functorch transforms."""
    x, w, t = _case(n=32, v=500, seed=3)
    z64 = x.double() @ w.double().T
    want = _want(z64, t)
    kw = dict(reduction="none", return_predicted_tokens=True)
    if case == "float64":
        got = flce.linear_cross_entropy(x.double(), w.double(), t, **kw).predicted_tokens
    elif case == "probabilities":
        q = torch.softmax(torch.randn(32, 500, generator=gen(4)), 1)
        got = flce.linear_cross_entropy(x, w, q, **kw).predicted_tokens
        want = _want(z64)
        assert torch.equal(flce.cross_entropy(x @ w.T, q, **kw).predicted_tokens, want)
    elif case == "weights+smoothing":
        cw = torch.rand(500, generator=gen(5)) + 0.5
        got = flce.linear_cross_entropy(x, w, t, class_weight=cw, label_smoothing=0.1,
                                        **kw).predicted_tokens
        assert torch.equal(flce.cross_entropy(x @ w.T, t, cw, label_smoothing=0.1,
                                              **kw).predicted_tokens, want)
    else:
        def f(xx):
            out = flce.linear_cross_entropy(xx, w, t, **kw)
            return out.loss.sum(), out.predicted_tokens

        _, got = torch.func.grad(f, has_aux=True)(x)
    assert torch.equal(got, want)


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of both entry points (the ops' fake kernels) agrees with
    eager: the predicted tokens, the loss and its gradient."""
    torch._dynamo.reset()
    x, w, t = _case(n=32, v=600, seed=6)

    def fn(x, w, t):
        a = flce.linear_cross_entropy(x, w, t, return_predicted_tokens=True)
        b = flce.cross_entropy(x @ w.T, t, return_predicted_tokens=True, reduction="sum")
        return a.loss + b.loss, a.predicted_tokens, b.predicted_tokens

    compiled = torch.compile(fn, fullgraph=True)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_c, out_e = compiled(xc, w, t), fn(xe, w, t)
    want = _want(x.double() @ w.double().T, t)
    assert torch.equal(out_c[1], want) and torch.equal(out_c[2], want)
    torch.testing.assert_close(out_c[0], out_e[0], rtol=1e-6, atol=0)
    out_c[0].backward()
    out_e[0].backward()
    # (the compiled graph sums the two losses' gradients in its own order: rounding relative to
    # the gradient's scale, where an element that cancels has few correct digits)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5,
                               atol=1e-6 * xe.grad.abs().max().item())


def test_refusals(monkeypatch):
    x, w, t = _case(n=32, v=20, seed=5)
    with pytest.raises(TypeError, match="return_predicted_tokens must be True or False"):
        flce.linear_cross_entropy(x, w, t, return_predicted_tokens="yes")
    with pytest.raises(TypeError, match="return_predicted_tokens must be True or False"):
        flce.LinearCrossEntropy(return_predicted_tokens=1.5)
    m = flce.LinearCrossEntropy(return_predicted_tokens=True, reduction="sum")
    assert "return_predicted_tokens=True" in repr(m)
    assert torch.equal(m(x, w, t).predicted_tokens, _want(x.double() @ w.double().T, t))


def _spread_case(n, v, seed):
    """Integer inputs whose rows have their largest logit, 150, at two columns 4096-column
    tiles apart (the CUDA row kernels' tiles; the earlier one is the argmax), the rows of some
    later in the vocabulary than others, and a target tied with them or above them."""
    g = gen(seed)
    x, w = _ints((n, 8), g, -2, 3), _ints((v, 8), g, -2, 3)
    cols = torch.randint(0, v - 4096, (n,), generator=g)
    for i in range(n):
        e = (torch.arange(8) == i % 8).float()
        w[cols[i]] = w[cols[i] + 4096] = 50.0 * e
        x[i, i % 8] = 3.0
    z = x.double() @ w.double().T
    t = torch.randint(0, v, (n,), generator=g)
    t[::4] = IGNORE
    t[1::8] = z[1::8].argmax(1)
    return x, w, t, z


@pytest.mark.parametrize("budget_mb", [None, "0.4"])
def test_chunks_of_rows(device, budget_mb, monkeypatch):
    """The CUDA linear op in several chunks of rows (FLCE_CUDA_WORKSPACE_MB 0.4: 12 rows of
    V = 9000 fp32 logits per chunk; the CPU backend ignores it), with a bias, a softcap and a
    temperature (increasing maps: the raw logits' argmax), and the logits op on the same rows:
    each row's own argmax, wherever its chunk starts."""
    if budget_mb:
        monkeypatch.setenv("FLCE_CUDA_WORKSPACE_MB", budget_mb)
    n, v = 40, 9000
    x, w, t, z64 = _spread_case(n, v, seed=8)
    want = _want(z64, t)
    assert (want >= 0).sum() >= 25 and _tied(z64).sum() >= 25
    b = torch.zeros(v)
    b[::7] = 1.0  # (integers: the logits stay exact)
    z64b = z64 + b.double()
    xs, ws, ts, bs = _to(device, x, w, t, b)
    for kw in (dict(), dict(softcap=500.0, temperature=0.5)):
        got = flce.linear_cross_entropy(xs, ws, ts, bias=bs, reduction="none",
                                        return_predicted_tokens=True, **kw).predicted_tokens
        assert torch.equal(got.cpu(), _want(z64b, t)), kw
        got = flce.cross_entropy((xs @ ws.T), ts, reduction="none", return_predicted_tokens=True,
                                 **kw).predicted_tokens
        assert torch.equal(got.cpu(), want), kw


def test_opcheck():
    """The CPU ops behind it (fake kernels, autograd registration, dynamic shapes), and the
    statistics they share with the ops without the argmax."""
    x, w, t = _case(n=32, v=300, seed=6)
    b = torch.randn(300, generator=gen(7))
    for grad in (False, True):
        args = (x.clone().requires_grad_(grad), w.clone().requires_grad_(grad), t,
                b.clone().requires_grad_(grad), IGNORE, 0.1, 1e-3, 5.0)
        torch.library.opcheck(torch.ops.flce.forward_argmax.default, args)
        torch.library.opcheck(torch.ops.flce.logits_forward_argmax.default,
                              ((x @ w.T).requires_grad_(grad), t, IGNORE, 0.1, 1e-3, 0.0, 1.0,
                               True))
    got = torch.ops.flce.forward_argmax(x, w, t, b, IGNORE, 0.1, 1e-3, 5.0)
    want = torch.ops.flce.forward(x, w, t, b, IGNORE, 0.1, 1e-3, 5.0)
    for a, r in zip(got[:4], want):
        assert torch.equal(a, r)
    z = x @ w.T
    got = torch.ops.flce.logits_forward_argmax(z, t, IGNORE, 0.1, 1e-3, 0.0, 1.0, True)
    want = torch.ops.flce.logits_forward(z, t, IGNORE, 0.1, 1e-3, 0.0, 1.0, True)
    for a, r in zip(got[:4], want):
        assert torch.equal(a, r)
    # The vocab-parallel path's: a shard's statistics and its global columns.
    args = (x, w[100:], t, b[100:], 100, IGNORE, 5.0)
    torch.library.opcheck(torch.ops.flce.partial_stats_argmax.default, args)
    parts, arg = torch.ops.flce.partial_stats_argmax(*args)
    assert torch.equal(parts, torch.ops.flce.partial_stats(*args))
    zs = z[:, 100:]
    args = (zs, t, 100, IGNORE, 0.0, 1.0, True, True)
    torch.library.opcheck(torch.ops.flce.logits_stats_argmax.default, args)
    parts, arg2 = torch.ops.flce.logits_stats_argmax(*args)
    assert torch.equal(parts, torch.ops.flce.logits_stats(*args))
    mask = (torch.arange(100, 300) == t[:, None])
    assert torch.equal(arg2, 100 + zs.masked_fill(mask, -float("inf")).argmax(1))
