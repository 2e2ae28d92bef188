"""flce.cross_entropy: collapse-safe cross-entropy on given logits, on every backend ("cpu",
"cuda", and "cuda-host": the CUDA row kernels under the host emulation), against float64
references taken on the same (rounded) logits, against F.cross_entropy where it does not
collapse, and as a drop-in for it (layouts, per-class weights, reductions)."""
import math

import pytest
import torch
import torch.nn.functional as F

import flce
from flce import _ops
from helpers import gen, poison_allocator, raises_within_two_calls, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTS = {
    "plain": {},
    "smooth": {"label_smoothing": 0.1},
    "all": {"label_smoothing": 0.05, "z_loss": 1e-3, "softcap": 20.0, "temperature": 0.7},
}
# Element-wise gradient tolerance. A 16-bit gradient is the float64 one rounded once: 2 eps(dtype)
# times max(|ref|, rms(ref)) (2x: the fp32 math before the rounding may push an element across a
# rounding boundary; measured 0.5x). Beneath that (and all of it for an fp32 gradient) is the
# fp32 math's own error, relative to the magnitude of the terms that make up the element (the
# loss's, the lse's and the entropy's contributions, which may cancel):
# - exp(z_j - M): the difference of a logit and the row's max is rounded (up to 2 max|z| eps32
#   in the exponent), and with a softcap or temperature z_j and M carry that transform's
#   rounding too (tanhf, u / c, c tanh, z / T: about 2 |z| eps32 each): 2 (1 + k) max|z| eps32,
#   k = 0 or 2;
# - the row's sum of exponentials S, a plain fp32 sum of V positive terms (lanes or threads,
#   then a tree): about sqrt(V) eps32 for random rounding;
# - the rest (exp itself, the division, the coefficients): 2 eps32.
# Measured: 45 eps32 at V = 5000, max|z| = 18 (bound 109); 71 with softcap 20 and temperature
# 0.7 at V = 9000 (bound 270).
GRAD_TOL16 = 2.0


def _fp32_factor(x, opts):
    zmax = x.detach().abs().max().item() if x.numel() else 0.0
    if opts.get("softcap"):
        zmax = min(zmax, opts["softcap"])
    zmax /= opts.get("temperature", 1.0)
    transformed = bool(opts.get("softcap")) or opts.get("temperature", 1.0) != 1.0
    v = x.shape[0] if x.dim() == 1 else x.shape[1]
    return 2.0 + 2.0 * (3.0 if transformed else 1.0) * zmax + math.sqrt(v)


def _logits(shape, dtype, device, seed=0, scale=4.0):
    g = gen(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def _targets(shape, c, device, seed=1, ignore_frac=0.1, ignore_index=-100):
    g = gen(seed)
    t = torch.randint(0, c, shape, generator=g)
    t[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    return t.to(device)


def _ref(x, t, reduction="mean", weight=None, **opts):
    """float64 flce.reference on the same logits values (class dimension 1, as torch)."""
    c = x.shape[0] if x.dim() == 1 else x.shape[1]
    z = x.detach().cpu().double()
    z = (z.reshape(1, c) if x.dim() == 1 else z.movedim(1, -1).reshape(-1, c)).requires_grad_()
    out = flce.reference.logits_cross_entropy(
        z, t.reshape(-1).cpu(), reduction="none", return_lse=True, return_entropy=True,
        weight=None if weight is None else weight.cpu().double(), **opts)
    return z, out


def _assert_close(got, ref, dtype, factor, what, mag=None, fp32_factor=0.0):
    """Every element within factor eps(dtype) max(|ref|, rms(ref)), plus fp32_factor eps32
    max(mag, rms(ref)) for the fp32 math beneath (mag: the magnitude of the element's terms)."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite"
    rms = ref.pow(2).mean().sqrt() if ref.numel() else ref.new_zeros(())
    tol = factor * torch.finfo(dtype).eps * torch.maximum(ref.abs(), rms) + 1e-30
    if mag is not None:
        tol = tol + fp32_factor * torch.finfo(torch.float32).eps * torch.maximum(mag, rms)
    err = (got - ref).abs()
    assert (err <= tol).all(), (f"{what}: {int((err > tol).sum())}/{err.numel()} off, worst "
                                f"{(err / tol).max().item():.2f}x the tolerance")


def check_ce(x, t, *, reduction="mean", weight=None, inplace=False, seed=3, **opts):
    """forward + backward of flce.cross_entropy (with the lse and entropy, random upstream
    gradients) against float64 on the same logits, every element."""
    dtype = x.dtype
    c = x.shape[0] if x.dim() == 1 else x.shape[1]
    lead = t.shape
    g = gen(seed)
    up = torch.rand(lead, generator=g, dtype=torch.float64) + 0.5
    up_lse = torch.rand(lead, generator=g, dtype=torch.float64) - 0.5
    up_ent = torch.rand(lead, generator=g, dtype=torch.float64) - 0.5
    leaf = x.detach().clone().requires_grad_()
    src = leaf * 1 if inplace else leaf  # in place: the gradient lands on a temporary's storage
    loss, lse, ent = flce.cross_entropy(src, t, weight, reduction=reduction, return_lse=True,
                                        return_entropy=True, inplace_backward=inplace, **opts)
    assert loss.dtype == torch.float32 and lse.shape == lead and ent.shape == lead
    z, (rloss, rlse, rent) = _ref(x, t, weight=weight, **opts)
    valid = (t != opts.get("ignore_index", -100)).reshape(-1).cpu()
    rw = valid.double() if weight is None else torch.where(
        valid, weight.cpu().double()[t.reshape(-1).cpu().clamp(0, c - 1)], 0.0)
    if reduction == "none":
        _assert_close(loss.reshape(-1), rloss, torch.float32, 16, "loss")
        robj = (rloss * up.reshape(-1)).sum()
        obj = (loss * up.to(loss.device, torch.float32)).sum()
    else:
        rred = rloss.sum() / (rw.sum() if reduction == "mean" else 1.0)
        if reduction == "mean" and rw.sum() == 0:
            assert torch.isnan(loss)
            return
        _assert_close(loss, rred, torch.float32, 16, "loss")
        robj, obj = rred, loss
    _assert_close(lse.reshape(-1), rlse, torch.float32, 16, "lse")
    _assert_close(ent.reshape(-1), rent, torch.float32, 64, "entropy")
    dev = loss.device
    obj = obj + (lse * up_lse.to(dev, torch.float32)).sum() + (ent * up_ent.to(dev,
                                                                             torch.float32)).sum()
    terms = [robj, (rlse * up_lse.reshape(-1)).sum(), (rent * up_ent.reshape(-1)).sum()]
    obj.backward()
    parts = [torch.autograd.grad(term, z, retain_graph=True)[0] for term in terms]
    grad = leaf.grad

    def like_x(g):  # [rows, C] back to input's layout
        return g.reshape(x.shape) if x.dim() <= 2 else g.reshape(
            (x.shape[0],) + tuple(x.shape[2:]) + (c,)).movedim(-1, 1)

    assert grad.dtype == dtype and grad.shape == x.shape
    mag = like_x(sum(p.abs() for p in parts))
    _assert_close(grad, like_x(sum(parts)), dtype, 0.0 if dtype == torch.float32 else GRAD_TOL16,
                  "grad", mag=mag, fp32_factor=_fp32_factor(x, opts))
    return loss, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", list(OPTS), ids=list(OPTS))
def test_matches_reference(device, dtype, reduction, opts):
    x = _logits((37, 9000), dtype, device)  # rows of three 4096-column tiles
    check_ce(x, _targets((37,), 9000, device), reduction=reduction, **OPTS[opts])


@pytest.mark.parametrize("n,c", [(1, 1), (3, 2), (5, 4095), (2, 4097), (0, 50), (7, 1)])
def test_shapes_matches_reference(device, n, c):
    x = _logits((n, c), torch.bfloat16, device, seed=n + c)
    check_ce(x, _targets((n,), c, device, ignore_frac=0.2), reduction="sum", **OPTS["all"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_backward_matches_reference(device, dtype):
    x = _logits((29, 5000), dtype, device, seed=4)
    t = _targets((29,), 5000, device)
    loss, grad = check_ce(x, t, inplace=True, **OPTS["smooth"])
    _, want = check_ce(x, t, **OPTS["smooth"])
    assert torch.equal(grad, want)


def test_inplace_backward_reuses_the_logits_storage(device):
    x = _logits((16, 300), torch.bfloat16, device, seed=5).requires_grad_()
    t = _targets((16,), 300, device)
    logits = x * 2  # a temporary whose storage the gradient may take
    seen = {}

    def hook(g):
        seen["ptr"] = g.data_ptr()

    logits.register_hook(hook)
    flce.cross_entropy(logits, t, inplace_backward=True).backward()
    assert seen["ptr"] == logits.data_ptr()
    # without it, the caller's logits are never written
    y = x.detach().clone().requires_grad_()
    before = y.detach().clone()
    flce.cross_entropy(y, t).backward()
    assert torch.equal(y.detach(), before)


@pytest.mark.parametrize("layout", ["C", "NC", "NCd", "NCdd"])
def test_layouts_match_torch(device, layout):
    shape = {"C": (50,), "NC": (6, 50), "NCd": (4, 50, 3), "NCdd": (2, 50, 3, 2)}[layout]
    x = _logits(shape, torch.float32, device, seed=6, scale=2.0)
    tshape = () if layout == "C" else (shape[0],) + shape[2:]
    t = _targets(tshape, 50, device, ignore_frac=0.0 if layout == "C" else 0.2)
    for reduction in ("mean", "sum", "none"):
        xg = x.detach().clone().requires_grad_()
        xr = x.detach().cpu().double().requires_grad_()
        got = flce.cross_entropy(xg, t, reduction=reduction, label_smoothing=0.1)
        want = F.cross_entropy(xr, t.cpu(), reduction=reduction, label_smoothing=0.1)
        assert got.shape == want.shape
        assert rel_err(got, want) < 2e-6
        got.sum().backward()
        want.sum().backward()
        assert rel_err(xg.grad, xr.grad) < 2e-6
    check_ce(x, t, reduction="none")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_match_torch(device, label_smoothing, reduction):
    x = _logits((4, 20, 6), torch.float32, device, seed=7, scale=2.0)
    t = _targets((4, 6), 20, device, ignore_frac=0.2)
    w = (torch.rand(20, generator=gen(8)) + 0.1).to(device)
    xg = x.detach().clone().requires_grad_()
    xr = x.detach().cpu().double().requires_grad_()
    got = flce.cross_entropy(xg, t, w, reduction=reduction, label_smoothing=label_smoothing)
    want = F.cross_entropy(xr, t.cpu(), w.cpu().double(), reduction=reduction,
                           label_smoothing=label_smoothing)
    assert rel_err(got, want) < 2e-6
    got.sum().backward()
    want.sum().backward()
    assert rel_err(xg.grad, xr.grad) < 2e-6
    check_ce(x, t, weight=w, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_margins(device, dtype):
    """Margins 0-200: the loss and the target's gradient stay relatively accurate against
    float64 on the same logits while they are normal fp32 numbers (then fp32's own underflow),
    where F.cross_entropy returns exactly 0 from a margin of ~17 + ln V."""
    v, margins = 1000, torch.tensor([0.0, 5, 10, 20, 30, 40, 60, 80, 100, 150, 200])
    g = gen(9)
    base = torch.randn(len(margins), v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (len(margins),), generator=g)
    others = base.scatter(1, t[:, None], -math.inf).amax(1)
    z = base.scatter(1, t[:, None], (others + margins.double())[:, None]).to(dtype)
    x = z.to(device).detach().clone().requires_grad_()
    loss = flce.cross_entropy(x, t.to(device), reduction="none")
    loss.sum().backward()
    zr = z.detach().double().requires_grad_()
    ref = flce.reference.logits_cross_entropy(zr, t, reduction="none")
    ref.sum().backward()
    tiny = torch.finfo(torch.float32).tiny
    err = (loss.double().cpu() - ref).abs()
    assert (err <= 1e-5 * ref + tiny).all(), (err / ref)
    gt = x.grad.cpu().double().gather(1, t[:, None])[:, 0]
    rgt = zr.grad.gather(1, t[:, None])[:, 0]
    # -sigmoid(d), d = lse_x - z_t: d's fp32 rounding is |d| eps32 relative in the result, then
    # the rounding to the gradient's dtype.
    z64 = z.double()
    d = torch.logsumexp(z64.scatter(1, t[:, None], -math.inf), 1) - z64.gather(1, t[:, None])[:, 0]
    eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps
    tol = ((2 + d.abs()) * eps32 + (eps if dtype != torch.float32 else 0)) * rgt.abs() + tiny
    assert ((gt - rgt).abs() <= tol).all(), ((gt - rgt).abs() / rgt.abs())
    big = margins >= 30
    assert (loss.detach().cpu()[big & (ref > tiny)] > 0).all()
    peer = F.cross_entropy(z.float(), t, reduction="none")
    assert (peer[big] == 0).all()  # the peer collapses there


def test_against_torch_where_it_does_not_collapse(device):
    x = _logits((64, 777), torch.float32, device, seed=10, scale=1.0)
    t = _targets((64,), 777, device)
    got = flce.cross_entropy(x, t, label_smoothing=0.1, reduction="none")
    want = F.cross_entropy(x, t, label_smoothing=0.1, reduction="none")
    assert (got - want).abs().max() <= 4e-6 * want.abs().max()


def test_every_element_written(device):
    """Outputs and the gradient are NaN-poisoned before (the CUDA allocator; the emulation
    poisons every workspace itself): every element must be written."""
    x = _logits((33, 4500), torch.bfloat16, device, seed=11)
    t = _targets((33,), 4500, device)
    poison_allocator(((33, 4500), torch.bfloat16), ((33,), torch.float32), device=device)
    xg = x.detach().clone().requires_grad_()
    loss = flce.cross_entropy(xg, t, reduction="none")
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(xg.grad).all()


def test_deterministic(device):
    x = _logits((41, 9000), torch.bfloat16, device, seed=12)
    t = _targets((41,), 9000, device)
    outs = []
    for _ in range(2):
        xg = x.detach().clone().requires_grad_()
        loss = flce.cross_entropy(xg, t, label_smoothing=0.1)
        loss.backward()
        outs.append((loss.detach(), xg.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_strided_logits(device):
    """A row stride beyond C (a slice of wider logits) and a transposed (column-strided) view."""
    wide = _logits((20, 1100), torch.float32, device, seed=13)
    t = _targets((20,), 1000, device)
    check_ce(wide[:, :1000], t, **OPTS["all"])
    tr = _logits((1000, 20), torch.bfloat16, device, seed=14).t()
    check_ce(tr, t, reduction="none")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_logits_propagate(device, bad):
    """NaN or +inf in a row gives that row a NaN loss (others unaffected); a -inf logit is a
    class of probability 0: the loss stays finite, as torch's."""
    x = _logits((6, 300), torch.float32, device, seed=15)
    t = _targets((6,), 300, device, ignore_frac=0.0)
    col = (int(t[2]) + 7) % 300
    x[2, col] = bad
    loss = flce.cross_entropy(x, t, reduction="none")
    keep = torch.arange(6, device=x.device) != 2
    assert torch.isfinite(loss[keep]).all()
    if bad == -math.inf:
        want = F.cross_entropy(x.double().cpu(), t.cpu(), reduction="none")
        assert rel_err(loss, want) < 1e-6
    else:
        assert torch.isnan(loss[2])


def test_bad_targets(device):
    x = _logits((8, 30), torch.float32, device)
    t = _targets((8,), 30, device, ignore_frac=0.0).clone()
    t[4] = 30
    raises_within_two_calls(lambda: flce.cross_entropy(x, t), "target[4] = 30")


def test_bad_arguments():
    x = torch.randn(4, 10)
    t = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="probability targets must have shape"):
        flce.cross_entropy(x, torch.softmax(x, 1)[:, :9])
    with pytest.raises(ValueError, match="inplace_backward=True takes class-index targets"):
        flce.cross_entropy(x.clone().requires_grad_().mul(1), torch.softmax(x, 1),
                           inplace_backward=True)
    with pytest.raises(ValueError, match="target must have shape"):
        flce.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="weight must be a floating-point tensor of shape"):
        flce.cross_entropy(x, t, torch.ones(9))
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        flce.cross_entropy(x, t, ignore_index=1.5)
    with pytest.raises(TypeError, match="input must be"):
        flce.cross_entropy(x.int(), t)
    with pytest.raises(ValueError, match="0-d"):
        flce.cross_entropy(torch.tensor(1.0), t)
    with pytest.raises(TypeError, match="inplace_backward"):
        flce.cross_entropy(x, t, inplace_backward=None)


def test_float64_gradcheck_and_transforms():
    g = gen(16)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 6, -100, 0, 3])
    w = torch.rand(7, generator=g, dtype=torch.float64) + 0.5

    def f(z):
        return flce.cross_entropy(z, t, w, reduction="none", label_smoothing=0.1, z_loss=1e-2,
                                  softcap=3.0, return_lse=True, return_entropy=True)

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))
    # fp32 through the fused ops: jvp and double backward against float64
    x32 = x.detach().float()
    v = torch.randn(5, 7, generator=g)
    _, tan = torch.func.jvp(lambda z: flce.cross_entropy(z, t, label_smoothing=0.1), (x32,), (v,))
    _, rtan = torch.func.jvp(lambda z: flce.cross_entropy(z, t, label_smoothing=0.1),
                             (x32.double(),), (v.double(),))
    assert rel_err(tan, rtan) < 1e-5
    xg = x32.clone().requires_grad_()
    gx, = torch.autograd.grad(flce.cross_entropy(xg, t, z_loss=1e-2), xg, create_graph=True)
    hv, = torch.autograd.grad((gx * v).sum(), xg)
    xr = x.detach().clone().requires_grad_()
    gr, = torch.autograd.grad(flce.cross_entropy(xr, t, z_loss=1e-2), xr, create_graph=True)
    hr, = torch.autograd.grad((gr * v.double()).sum(), xr)
    assert rel_err(hv, hr) < 1e-5


def test_opcheck_and_compile(device):
    x = _logits((12, 100), torch.bfloat16, device, seed=17)
    t = _targets((12,), 100, device)
    ops = _ops.ops
    stats = ops.logits_forward(x, t, -100, 0.1, 1e-3, 0.0, 1.0, True)[2]
    gl = torch.rand(12, device=x.device)
    for op, args in [
            (ops.logits_stats, (x, t, 0, -100, 5.0, 0.7, True, True)),
            (ops.logits_forward, (x, t, -100, 0.1, 1e-3, 0.0, 1.0, True)),
            (ops.logits_backward, (gl, None, None, x, t, stats, 0, 100, -100, 0.1, 1e-3, 0.0,
                                   1.0)),
            (ops.logits_backward_, (gl, None, None, x.clone(), t, stats, 0, 100, -100, 0.1, 1e-3,
                                    0.0, 1.0))]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.logits_forward, (x.float().requires_grad_(), t, -100, 0.1, 1e-3,
                                               0.0, 1.0, True),
                          test_utils=("test_autograd_registration",))

    def step(z, y):
        return flce.cross_entropy(z, y, label_smoothing=0.1)

    compiled = torch.compile(step, fullgraph=True)
    xg = x.detach().clone().requires_grad_()
    xe = x.detach().clone().requires_grad_()
    a, b = compiled(xg, t), step(xe, t)
    a.backward()
    b.backward()
    # (the op's rows and gradient bit for bit; the mean is inductor's sum of the rows, whose order
    # may differ from eager's by an ulp)
    assert torch.equal(xg.grad, xe.grad) and a.item() == pytest.approx(b.item(), rel=2 ** -21)
    rows = torch.compile(lambda z, y: flce.cross_entropy(z, y, label_smoothing=0.1,
                                                         reduction="none"), fullgraph=True)
    assert torch.equal(rows(x, t), flce.cross_entropy(x, t, label_smoothing=0.1,
                                                      reduction="none"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_of_strided_logits(device, reduction):
    """No rows, logits a column-strided view (whose .contiguous() keeps its strides): torch's
    answer (NaN for the mean of nothing, 0 for the sum, an empty tensor for "none") and an empty
    gradient, not a stride error."""
    base = torch.randn(0, 10, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    got = flce.cross_entropy(base[:, ::2], t, reduction=reduction)
    want = torch.nn.functional.cross_entropy(base.detach()[:, ::2], t, reduction=reduction)
    assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got.detach()), torch.nan_to_num(want))
    got.sum().backward()
    assert base.grad.shape == (0, 10)


def test_a_common_offset_changes_nothing(device):
    # A common offset of a row's logits leaves its softmax as it is. Logits on a grid of 2^-10 in
    # [-8, 56) are exact in fp32 with and without an offset of 10240 (ulp 2^-10 there), and so is
    # every difference of two of them: the loss, entropy and gradient must come out the same bits
    # at both. The fp32 lse (rounded at 10240 * 2^-24 = 6e-4) must not enter the loss as a value:
    # softplus(lse_x - z_t) missed by 1e-4 at this offset, and gave log 2 for log 10 at 1e8.
    g = gen(5)
    n, c = 12, 5000
    z = torch.round((torch.rand(n, c, generator=g) * 16 - 8) * 1024) / 1024
    t = torch.randint(0, c, (n,), generator=g)
    z[torch.arange(n), t] += torch.arange(n, dtype=torch.float32) * 4  # margins to ~50
    t[3] = -100
    up, up_ent = torch.rand(n, generator=g), torch.rand(n, generator=g)
    got = []
    for off in (0.0, 10240.0):
        x = (z + off).to(device).requires_grad_()
        loss, ent = flce.cross_entropy(x, t.to(device), reduction="none", return_entropy=True)
        # (the entropy's gradient too: its z_j - lse was rounded at the offset's scale, 5e-4 of it)
        (loss * up.to(device) + ent * up_ent.to(device)).sum().backward()
        got.append((loss, ent, x.grad))
    for a, b, what in zip(*got, ("loss", "entropy", "gradient")):
        assert torch.equal(a, b), what
    want = flce.reference.logits_cross_entropy(z.double(), t, reduction="none")
    assert rel_err(got[0][0], want) < 1e-6
    assert flce.cross_entropy(torch.full((6, 10), 1e8, device=device),
                              torch.arange(6, device=device)).item() == \
        pytest.approx(math.log(10), rel=2 ** -22)


def test_a_common_offset_changes_nothing_on_the_composite_path():
    # The same on the differentiable composite (a functorch transform): flce.reference in fp32.
    g = gen(6)
    z = torch.round((torch.rand(8, 300, generator=g) * 16 - 8) * 1024) / 1024
    t = torch.randint(0, 300, (8,), generator=g)
    z[torch.arange(8), t] += torch.arange(8, dtype=torch.float32) * 5

    def loss(x):
        return flce.cross_entropy(x, t, reduction="sum")

    a = torch.func.grad_and_value(loss)(z)
    b = torch.func.grad_and_value(loss)(z + 10240)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_z_loss_gradient_of_a_collapsed_row(device):
    # dz_t = (A - B) p_t - B q_t with A - B = 2 w lse g formed as such: A rounded first left
    # ulp(g) in it, 1.7e-4 of dz_t at w = 1e-4 and 5% at w = 1e-6 (torch's own autograd of
    # F.cross_entropy + w lse^2 is exact here).
    z = torch.full((3, 16), -40.0)
    z[:, 3] = 0.5
    t = torch.full((3,), 3)
    for w in (1e-4, 1e-6):
        x = z.clone().to(device).requires_grad_()
        flce.cross_entropy(x, t.to(device), z_loss=w, reduction="sum").backward()
        x64 = z.double().requires_grad_()
        flce.reference.logits_cross_entropy(x64, t, z_loss=w, reduction="sum").backward()
        assert rel_err(x.grad[:, 3], x64.grad[:, 3]) < 1e-6, w
