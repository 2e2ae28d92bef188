"""The fused target distributions of the CPU backend (flce::soft_*: probability targets, and
class targets with per-class weights and label smoothing) against float64 ``flce.reference``:
that the API takes them (no ``[N, V]`` logits), every option and output, the merge of vocabulary
shards (what vocab-parallel runs), collapse safety at margins 0-200, -inf and NaN logits, and
opcheck of the ops."""
import pytest
import torch

import flce
from flce import _composite, reference
from helpers import rel_err, round_floor

N, V, D = 37, 300, 24
OPTIONS = [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0, "temperature": 0.7},
           {"class_weight": True}, {"class_weight": True, "label_smoothing": 0.2, "z_loss": 1e-3}]
IDS = ["plain", "smoothing", "z_loss", "softcap+T", "weights", "weights+smoothing+z"]


def _inputs(dtype, seed, v=V, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(v, D, generator=g) / D ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    q = torch.softmax(torch.randn(N, v, generator=g) * 3, 1)
    cw = torch.rand(v, generator=g) + 0.5
    t = torch.randint(0, v, (N,), generator=g)
    t[::7] = -100
    return x, w, b, q, cw, t


@pytest.fixture
def no_logits(monkeypatch):
    """Fail any call that would build the [N, V] logits in torch (the composite path)."""
    def refuse(*_):
        raise AssertionError("the composite path materialized the logits")
    monkeypatch.setattr(_composite, "linear_logits", refuse)


def _check_grads(leaves, wide, dz, dtype):
    """Each gradient element against float64, within its own rounding to the dtype plus the
    error of a product of the gradient tile dz at the tile's precision: |err| <= 2 u |ref| +
    (8 + K) u_tile (|dz| |other operand|), u the dtype's unit roundoff, u_tile fp32's (bf16's
    where the tile is rounded to bf16 once, as on AMX), K the product's inner size (a sum of K
    terms in that precision: Higham's gamma_K). The second term is what an ideal implementation
    at the tile's precision leaves where the products cancel (a gradient far below its terms);
    a wrong term of the gradient (the pivot's p_a - 1 computed as is, say) is far above it."""
    u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[dtype]
    u_tile = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9}[dtype]
    x, w = (a.detach().abs() for a in wide[:2])
    n, v = dz.shape
    terms = ((8 + v) * (dz.abs() @ w), (8 + n) * (dz.abs().T @ x), (8 + n) * dz.abs().sum(0))
    for name, a, r, t in zip(("input", "weight", "bias"), leaves, wide, terms):
        err = (a.grad.double() - r.grad).abs()
        bound = 2 * u * r.grad.abs() + u_tile * t
        worst = (err / bound).max().item()
        assert worst <= 1, f"{name} gradient: {worst:.2f}x its bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
@pytest.mark.parametrize("kind", ["probabilities", "classes"])
def test_fused_against_float64(no_logits, dtype, opts, kind):
    kw = dict(opts)
    weighted = kw.pop("class_weight", False)
    if kind == "classes" and not (weighted and kw.get("label_smoothing")):
        pytest.skip("class targets take the target distributions with weights and smoothing")
    x, w, b, q, cw, t = _inputs(dtype, seed=len(IDS[OPTIONS.index(opts)]))
    cw = cw if weighted else None
    target = q if kind == "probabilities" else t
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    loss, lse, ent = flce.linear_cross_entropy(*leaves[:2], target, bias=leaves[2],
                                               reduction="none", return_lse=True,
                                               return_entropy=True, class_weight=cw, **kw)
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    if kind == "probabilities":
        ref = reference.soft_cross_entropy(z, q.double(), reduction="none",
                                           weight=None if cw is None else cw.double(), **kw)
    else:
        ref = reference.logits_cross_entropy(z, t, reduction="none", return_lse=True,
                                             return_entropy=True, weight=cw.double(), **kw)
    for name, got, r in zip(("loss", "lse", "entropy"), (loss, lse, ent), ref):
        # fp32 row statistics of exactly computed logits: a few fp32 roundings of the value
        assert rel_err(got, r) < 2e-6, name
    gl, glse, gent = (torch.rand(N, generator=torch.Generator().manual_seed(k)).double() + 0.5
                      for k in range(3))
    ((loss.double() * gl).sum() + (lse.double() * glse).sum() + (ent.double() * gent).sum()
     ).backward()
    ((ref[0] * gl).sum() + (ref[1] * glse).sum() + (ref[2] * gent).sum()).backward()
    _check_grads(leaves, wide, z.grad, dtype)


@pytest.mark.parametrize("margin", [0.0, 20.0, 40.0, 80.0, 200.0])
def test_collapse_safe(no_logits, margin):
    """A target concentrated on the dominant class (1 - 1e-7) at a margin: the loss is
    ~1e-7 * margin, which lse - sum_c y_c z_c loses to rounding from margin ~17; flce keeps it
    to fp32's relative accuracy, and its gradients too."""
    g = torch.Generator().manual_seed(int(margin))
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.1
    b = torch.zeros(V)
    b[5] = margin
    q = torch.full((N, V), 1e-7 / (V - 1))
    q[:, 5] = 1 - 1e-7
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    loss = flce.linear_cross_entropy(*leaves[:2], q, bias=leaves[2], reduction="none")
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    ref = reference.soft_cross_entropy(z, q.double(), reduction="none")[0]
    assert ((loss.double() - ref).abs() / ref).max() < 1e-6
    cot = torch.rand(N, generator=g).double() + 0.5
    (loss.double() * cot).sum().backward()
    (ref * cot).sum().backward()
    _check_grads(leaves, wide, z.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_shards_merge_to_one_device(dtype):
    """Three vocabulary shards' partials, merged by soft_combine, give soft_forward's loss on
    one device, and their backward the same gradients: dW and db shard by shard, dE summed.
    The shards cut through the tiles, and the pivot lies in a later shard for some rows."""
    x, w, b, q, cw, _ = _inputs(dtype, seed=3)
    cuts = [0, 70, 211, V]
    args = (0.1, 5.0, 1.0)  # label_smoothing, softcap, temperature
    one = flce.ops.soft_forward(x, w, q.to(dtype), b, cw, None, -100, 0.1, 1e-3, 5.0, 1.0)
    parts = [flce.ops.soft_partial_stats(x, w[s:e], q[:, s:e].to(dtype), b[s:e], cw[s:e], s, V,
                                         -100, *args) for s, e in zip(cuts, cuts[1:])]
    merged = flce.ops.soft_combine(torch.stack([p for p, _ in parts]),
                                   torch.stack([a for _, a in parts]), None, 1e-3)
    for name, a, m in zip(("loss", "lse", "stats", "pivot", "entropy"), one, merged):
        assert torch.equal(a, m) if name == "pivot" else rel_err(a, m) < 1e-6, name
    assert (merged[3] >= cuts[1]).any() and (merged[3] < cuts[1]).any()
    gl = torch.rand(N) + 0.5
    mask = [True, True, True]
    whole = flce.ops.soft_backward(gl, None, None, x, w, q.to(dtype), b, cw, one[2], one[3],
                                   None, 0, V, -100, 0.1, 1e-3, 5.0, 1.0, mask)
    shards = [flce.ops.soft_backward(gl, None, None, x, w[s:e], q[:, s:e].to(dtype), b[s:e],
                                     cw[s:e], one[2], one[3], None, s, V, -100, 0.1, 1e-3, 5.0,
                                     1.0, mask) for s, e in zip(cuts, cuts[1:])]
    tol = 4 * {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[
        dtype]
    assert rel_err(sum(s[0].double() for s in shards), whole[0]) < tol
    assert rel_err(torch.cat([s[1] for s in shards]), whole[1]) < tol
    assert rel_err(torch.cat([s[2] for s in shards]), whole[2]) < tol


def test_masked_columns_and_nan():
    """A -inf bias (a padded vocabulary) where the target has no weight adds nothing; target
    weight on a -inf logit gives an infinite loss; a NaN logit gives a NaN loss, row by row."""
    x, w, b, q, _, _ = _inputs(torch.float32, seed=5)
    b = b.clone()
    b[-20:] = float("-inf")
    q = q.clone()
    q[:, -20:] = 0
    q = q / q.sum(1, keepdim=True)
    loss = flce.linear_cross_entropy(x, w, q, bias=b, reduction="none")
    ref = reference.soft_cross_entropy(x.double() @ w.double().T + b.double(), q.double(),
                                       reduction="none")[0]
    assert torch.isfinite(loss).all() and rel_err(loss, ref) < 2e-6
    q[3, -1] = 0.5
    x = x.clone()
    x[6, 0] = float("nan")
    loss = flce.linear_cross_entropy(x, w, q, bias=b, reduction="none")
    assert loss[3] == float("inf") and torch.isnan(loss[6])
    keep = torch.ones(N, dtype=torch.bool)
    keep[[3, 6]] = False
    assert torch.isfinite(loss[keep]).all()


def test_routes():
    """What the fused ops do not serve takes the composite path, and gives its answer: target
    gradients (distillation from a model in the graph), the accuracy output, float64."""
    x, w, b, q, _, _ = _inputs(torch.float32, seed=7)
    y = q.clone().requires_grad_()
    loss = flce.linear_cross_entropy(x, w, y, bias=b)
    loss.backward()
    z = x.double() @ w.double().T + b.double()
    yd = q.double().requires_grad_()
    ref = reference.soft_cross_entropy(z, yd)
    ref.backward()
    assert rel_err(loss, ref) < 2e-6 and rel_err(y.grad, yd.grad) < 1e-5
    out = flce.linear_cross_entropy(x, w, q, bias=b, return_accuracy=True)
    assert rel_err(out[0], ref) < 2e-6


def test_double_backward():
    """create_graph=True through the fused op recomputes its gradients differentiably."""
    x, w, b, q, cw, _ = _inputs(torch.float32, seed=9)
    xs = x.clone().requires_grad_()
    loss = flce.linear_cross_entropy(xs, w, q, bias=b, class_weight=cw)
    gx, = torch.autograd.grad(loss, xs, create_graph=True)
    gx.square().sum().backward()
    xd = x.double().requires_grad_()
    ref = reference.soft_cross_entropy(xd @ w.double().T + b.double(), q.double(),
                                       weight=cw.double())
    gd, = torch.autograd.grad(ref, xd, create_graph=True)
    gd.square().sum().backward()
    assert rel_err(gx, gd) < 1e-5 and rel_err(xs.grad, xd.grad) < 1e-4


def test_opcheck():
    x, w, b, q, cw, t = _inputs(torch.float32, seed=11)
    torch.library.opcheck(torch.ops.flce.soft_partial_stats.default,
                          (x, w[100:], q[:, 100:], b[100:], cw[100:], 100, V, -100, 0.1, 0.0,
                           1.0))
    for target, zw in ((q, None), (t, torch.rand(N) + 0.5)):
        args = (x.clone().requires_grad_(), w.clone().requires_grad_(), target,
                b.clone().requires_grad_(), cw, zw, -100, 0.1, 1e-3, 0.0, 1.0)
        torch.library.opcheck(torch.ops.flce.soft_forward.default, args)
    parts = [flce.ops.soft_partial_stats(x, w[s:e], q[:, s:e], b[s:e], None, s, V, -100, 0.0,
                                         0.0, 1.0) for s, e in ((0, 100), (100, V))]
    torch.library.opcheck(torch.ops.flce.soft_combine.default,
                          (torch.stack([p for p, _ in parts]), torch.stack([a for _, a in parts]),
                           None, 1e-3))


def test_bad_arguments():
    x, w, b, q, cw, t = _inputs(torch.float32, seed=13)
    with pytest.raises(ValueError, match="probability targets must be"):
        flce.ops.soft_forward(x, w, q[:, 1:], b, None, None, -100, 0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="class_weight must be"):
        flce.ops.soft_forward(x, w, q, b, cw[1:], None, -100, 0.0, 0.0, 0.0, 1.0)
    with pytest.raises(IndexError, match="out of range"):
        flce.ops.soft_forward(x, w, t.clamp(min=0) + V, b, cw, None, -100, 0.1, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(5, 7), (4, 300, 3), (6, 5000)], ids=["NC", "NCd", "wide"])
@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
def test_cross_entropy_fused(monkeypatch, dtype, shape, opts):
    """flce.cross_entropy on given logits, torch's layouts (the class dimension 1), probability
    targets fused: no composite (soft_per_token refuses), every output and the logits'
    gradient against float64. 'wide' spans two chunks of the CPU's row loop (4096 columns)."""
    def refuse(*_):
        raise AssertionError("the composite path was taken")
    monkeypatch.setattr(_composite, "soft_per_token", refuse)
    kw = dict(opts)
    g = torch.Generator().manual_seed(17)
    c = shape[1]
    cw = torch.rand(c, generator=g) + 0.5 if kw.pop("class_weight", False) else None
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    q = torch.softmax(torch.randn(*shape, generator=g) * 2, 1)
    loss, lse, ent = flce.cross_entropy(x, q, weight=cw, reduction="none", return_lse=True,
                                        return_entropy=True, **kw)
    xd = x.detach().double().requires_grad_()
    rows = (lambda a: a.movedim(1, -1).reshape(-1, c))
    ref = reference.soft_cross_entropy(rows(xd), rows(q).double(), reduction="none",
                                       weight=None if cw is None else cw.double(), **kw)
    for name, got, r in zip(("loss", "lse", "entropy"), (loss, lse, ent), ref):
        assert rel_err(got.reshape(-1), r) < 2e-6, name
    k = torch.rand(ref[0].shape, generator=g).double() + 0.5
    (loss.double().reshape(-1) * k).sum().backward()
    (ref[0] * k).sum().backward()
    # dz_j = k (Y p_j - y_j): one rounding to the dtype, relative to the row's largest element,
    # plus the fp32 sums of the row's target weights (Y, Y_rest: c non-negative terms, Higham's
    # gamma_c relative to k Y) that the pivot's gradient holds.
    u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[dtype]
    y = rows(q).double() * (1 if cw is None else cw.double())
    mass = k * ((1 - kw.get("label_smoothing", 0.0)) * y.sum(1) + kw.get("label_smoothing", 0.0)
                * (1 if cw is None else cw.double().mean()))
    gd, got = rows(xd.grad), rows(x.grad.double())
    bound = u * gd.abs().amax(1, keepdim=True) + (8 + c) * 2.0 ** -24 * mass[:, None]
    assert ((got - gd).abs() <= bound).all()
