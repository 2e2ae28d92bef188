"""The fused target distributions (flce::soft_*: probability targets, and class targets with
per-class weights and label smoothing) against float64 ``flce.reference``: that the API takes them
(no ``[N, V]`` logits), every option and output, the merge of vocabulary shards (what
vocab-parallel runs), collapse safety at margins 0-200, -inf and NaN logits, and opcheck of the
ops. The CPU backend, and the CUDA backend's soft mode (opt-in: FLCE_CUDA_OPT_IN=distributions, set
here; "cuda-host" runs it on the host emulation of its kernels)."""
import pytest
import torch

import flce
from flce import _composite, _ops, reference
from helpers import CUDA_DEVICES, DEVICES, raises_within_two_calls, rel_err, round_floor

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


@pytest.fixture(autouse=True)
def cuda_distributions(monkeypatch):
    """The CUDA backend's fused target distributions are opt-in (never run on a GPU yet)."""
    monkeypatch.setenv("FLCE_CUDA_OPT_IN", "distributions")


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.fixture
def no_logits(monkeypatch):
    """Fail any call that would build the [N, V] logits in torch (the composite path)."""
    def refuse(*_):
        raise AssertionError("the composite path materialized the logits")
    monkeypatch.setattr(_composite, "linear_logits", refuse)


def _target_weights(target, v, cw, eps, ignore_index=-100):
    """The rows' target weights y [N, V] in float64: w ((1 - eps) q + eps / V), q the
    probabilities or the class's one-hot (0 for an ignored row)."""
    if target.dtype.is_floating_point:
        y = (1 - eps) * target.double() + eps / v
    else:
        valid = target != ignore_index
        q = torch.zeros(target.shape[0], v, dtype=torch.float64)
        q[valid, target[valid]] = 1.0
        y = ((1 - eps) * q + eps / v) * valid[:, None]
    return y if cw is None else y * cw.double()


def _check_grads(leaves, wide, u, y, g, dtype, softcap=None, temperature=1.0, g_ent=None,
                 g_lse=None, z_loss=0.0, zw=None):
    """Each gradient element against float64, within its own rounding to the dtype plus the
    error of a product of the gradient tile at the tile's precision: |err| <= 2 u |ref| + (8 +
    K) u_tile (T |other operand|), u the dtype's unit roundoff, u_tile fp32's (bf16's where the
    tile is rounded to bf16 once, as on AMX), K the product's inner size (a sum of K terms in
    that precision: Higham's gamma_K), and T the magnitude of each tile entry's terms, which an
    fp32 tile carries to a few ulps: dz_j = A p_j - g y_j (+ the entropy's g_H p_j (log p_j +
    H)) times the transforms' chain rule, T_j = (|dz_j| + 2 g |y_j| + |g_H| p_j (|log p_j| + H))
    chain_j, where A p_j and g y_j cancel to a small dz_j; at the row's pivot a (its largest
    logit) the collapse-safe form's terms, T_a = (|A - g Y| p_a + g Y q_a + g y_rest + the
    entropy's) chain_a with q_a = 1 - p_a, so that computing the pivot's entry as A p_a - g y_a
    (which rounds to 0 where a confident row's q_a is below fp32's resolution) fails. u: the
    raw logits (float64, their grad the tile), y the target weights, g [N] the loss's upstream
    gradient (g_lse the lse's, g_ent the entropy's), zw the z-loss's row weights (default Y)."""
    eps_u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[dtype]
    u_tile = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9}[dtype]
    with torch.no_grad():
        z = u.detach()
        chain = torch.ones_like(z)
        if softcap:
            z = softcap * torch.tanh(z / softcap)
            chain = 1 - (z / softcap) ** 2
        z, chain = z / temperature, chain / temperature
        logp = torch.log_softmax(z, 1)
        p = logp.exp()
        ent = torch.zeros_like(p)
        if g_ent is not None:
            h = -(p * logp).sum(1, keepdim=True)
            ent = g_ent.abs()[:, None] * p * (logp.abs() + h)
        tile = u.grad.abs() + chain * (2 * g[:, None] * y.abs() + ent)
        a = z.argmax(1, keepdim=True)
        big_y = y.sum(1)
        y_rest = big_y - y.gather(1, a)[:, 0]
        p_a = p.gather(1, a)[:, 0]
        q_a = p.scatter(1, a, 0.0).sum(1)
        lse = torch.logsumexp(z, 1)
        a_minus = 2 * g * z_loss * (big_y if zw is None else zw) * lse.abs()
        if g_lse is not None:
            a_minus = a_minus + g_lse.abs()
        pivot = chain.gather(1, a)[:, 0] * (a_minus * p_a + g * big_y * q_a + g * y_rest.abs()
                                             + ent.gather(1, a)[:, 0])
        tile = tile.scatter(1, a, (u.grad.gather(1, a)[:, 0].abs() + pivot)[:, None])
        x, w = (a.detach().abs() for a in wide[:2])
        n, v = tile.shape
        terms = ((8 + v) * (tile @ w), (8 + n) * (tile.T @ x), (8 + n) * tile.sum(0))
    for name, a, r, t in zip(("input", "weight", "bias"), leaves, wide, terms):
        err = (a.grad.cpu().double() - r.grad).abs()
        bound = 2 * eps_u * r.grad.abs() + u_tile * t
        # (a row or column without any term, e.g. an ignored token's, must be exactly 0)
        worst = torch.where(bound > 0, err / bound, err * float("inf")).nan_to_num(0.0).max()
        worst = worst.item()
        assert worst <= 1, f"{name} gradient: {worst:.2f}x its bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
@pytest.mark.parametrize("kind", ["probabilities", "classes"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_against_float64(no_logits, device, dtype, opts, kind):
    kw = dict(opts)
    weighted = kw.pop("class_weight", False)
    if kind == "classes" and not (weighted and kw.get("label_smoothing")):
        pytest.skip("class targets take the target distributions with weights and smoothing")
    x, w, b, q, cw, t = _inputs(dtype, seed=len(IDS[OPTIONS.index(opts)]))
    cw = cw if weighted else None
    target = q if kind == "probabilities" else t
    leaves = [a.clone().to(device).requires_grad_() for a in (x, w, b)]
    target, cw_d = _on(device, target, cw)
    loss, lse, ent = flce.linear_cross_entropy(*leaves[:2], target, bias=leaves[2],
                                               reduction="none", return_lse=True,
                                               return_entropy=True, class_weight=cw_d, **kw)
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    if kind == "probabilities":
        ref = reference.soft_cross_entropy(z, q.double(), reduction="none",
                                           weight=None if cw is None else cw.double(), **kw)
    else:
        ref = reference.logits_cross_entropy(z, t, reduction="none", return_lse=True,
                                             return_entropy=True, weight=cw.double(), **kw)
    for name, got, r in zip(("loss", "lse", "entropy"), (loss.cpu(), lse.cpu(), ent.cpu()), ref):
        # fp32 row statistics of exactly computed logits: a few fp32 roundings of the value
        assert rel_err(got, r) < 2e-6, name
    gl, glse, gent = (torch.rand(N, generator=torch.Generator().manual_seed(k)).double() + 0.5
                      for k in range(3))
    ((loss.double() * gl.to(device)).sum() + (lse.double() * glse.to(device)).sum() +
     (ent.double() * gent.to(device)).sum()).backward()
    ((ref[0] * gl).sum() + (ref[1] * glse).sum() + (ref[2] * gent).sum()).backward()
    y = _target_weights(target, V, cw, kw.get("label_smoothing", 0.0))
    zw = None
    if kind == "classes":
        zw = torch.where(t != -100, cw.double()[t.clamp(min=0)], 0.0)
    _check_grads(leaves, wide, z, y, gl, dtype, kw.get("softcap"), kw.get("temperature", 1.0),
                 gent, glse, kw.get("z_loss", 0.0), zw)


@pytest.mark.parametrize("margin", [0.0, 20.0, 40.0, 80.0, 200.0])
@pytest.mark.parametrize("device", DEVICES)
def test_collapse_safe(no_logits, device, margin):
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
    leaves = [a.clone().to(device).requires_grad_() for a in (x, w, b)]
    loss = flce.linear_cross_entropy(*leaves[:2], q.to(device), bias=leaves[2],
                                     reduction="none").cpu()
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    ref = reference.soft_cross_entropy(z, q.double(), reduction="none")[0]
    assert ((loss.double() - ref).abs() / ref).max() < 1e-6
    cot = torch.rand(N, generator=g).double() + 0.5
    (loss.double() * cot).sum().backward()
    (ref * cot).sum().backward()
    _check_grads(leaves, wide, z, q.double(), cot, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_shards_merge_to_one_device(device, dtype):
    """Three vocabulary shards' partials, merged by soft_combine, give soft_forward's loss on
    one device, and their backward the same gradients: dW and db shard by shard, dE summed.
    The shards cut through the tiles, and the pivot lies in a later shard for some rows."""
    x, w, b, q, cw, _ = _on(device, *_inputs(dtype, seed=3))
    ops = _ops.ops  # (the namespace the tests route to: flce_cuda_host on cuda-host)
    cuts = [0, 70, 211, V]
    args = (0.1, 5.0, 1.0)  # label_smoothing, softcap, temperature
    one = ops.soft_forward(x, w, q.to(dtype), b, cw, None, -100, 0.1, 1e-3, 5.0, 1.0)
    parts = [ops.soft_partial_stats(x, w[s:e], q[:, s:e].to(dtype), b[s:e], cw[s:e], s, V,
                                         -100, *args) for s, e in zip(cuts, cuts[1:])]
    merged = ops.soft_combine(torch.stack([p for p, _ in parts]),
                                   torch.stack([a for _, a in parts]), None, 1e-3)
    for name, a, m in zip(("loss", "lse", "stats", "pivot", "entropy"), one, merged):
        assert torch.equal(a, m) if name == "pivot" else rel_err(a, m) < 1e-6, name
    assert (merged[3] >= cuts[1]).any() and (merged[3] < cuts[1]).any()
    gl = (torch.rand(N) + 0.5).to(device)
    mask = [True, True, True]
    whole = ops.soft_backward(gl, None, None, x, w, q.to(dtype), b, cw, one[2], one[3],
                                   None, 0, V, -100, 0.1, 1e-3, 5.0, 1.0, mask)
    shards = [ops.soft_backward(gl, None, None, x, w[s:e], q[:, s:e].to(dtype), b[s:e],
                                     cw[s:e], one[2], one[3], None, s, V, -100, 0.1, 1e-3, 5.0,
                                     1.0, mask) for s, e in zip(cuts, cuts[1:])]
    tol = 4 * {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[
        dtype]
    # dE: the shards' fp32 products summed against one product over the whole vocabulary, two
    # fp32 computations each a few roundings off float64 (norm-wise up to 4.7 eps where MKL's
    # sgemm runs AVX-512 kernels): their difference is bounded by the sum of the two.
    assert rel_err(sum(s[0].double() for s in shards), whole[0]) < \
        (2 * tol if dtype == torch.float32 else tol)
    assert rel_err(torch.cat([s[1] for s in shards]), whole[1]) < tol
    assert rel_err(torch.cat([s[2] for s in shards]), whole[2]) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_masked_columns_and_nan(device):
    """A -inf bias (a padded vocabulary) where the target has no weight adds nothing; target
    weight on a -inf logit gives an infinite loss; a NaN logit gives a NaN loss, row by row."""
    x, w, b, q, _, _ = _on(device, *_inputs(torch.float32, seed=5))
    b = b.clone()
    b[-20:] = float("-inf")
    q = q.clone()
    q[:, -20:] = 0
    q = q / q.sum(1, keepdim=True)
    loss = flce.linear_cross_entropy(x, w, q, bias=b, reduction="none").cpu()
    ref = reference.soft_cross_entropy(x.double() @ w.double().T + b.double(), q.double(),
                                       reduction="none")[0].cpu()
    assert torch.isfinite(loss).all() and rel_err(loss, ref) < 2e-6
    q[3, -1] = 0.5
    x = x.clone()
    x[6, 0] = float("nan")
    loss = flce.linear_cross_entropy(x, w, q, bias=b, reduction="none").cpu()
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


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    x, w, b, q, cw, t = _on(device, *_inputs(torch.float32, seed=13))
    ops = _ops.ops
    with pytest.raises(ValueError, match="probability targets must be"):
        ops.soft_forward(x, w, q[:, 1:], b, None, None, -100, 0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="class_weight must be"):
        ops.soft_forward(x, w, q, b, cw[1:], None, -100, 0.0, 0.0, 0.0, 1.0)
    # (the CUDA backend checks class ids without a host sync: at this call or the next)
    raises_within_two_calls(lambda: ops.soft_forward(x, w, t.clamp(min=0) + V, b, cw, None, -100,
                                                     0.1, 0.0, 0.0, 1.0), "out of range")


@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_cuda_opt_in(no_logits, monkeypatch, device):
    """Without FLCE_CUDA_OPT_IN=distributions the CUDA backend takes the composite path (the [N, V]
    logits in torch ops): its soft mode has not run on a GPU yet."""
    monkeypatch.delenv("FLCE_CUDA_OPT_IN")
    x, w, b, q, _, _ = _on(device, *_inputs(torch.float32, seed=15))
    with pytest.raises(AssertionError, match="materialized the logits"):
        flce.linear_cross_entropy(x, w, q, bias=b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(5, 7), (4, 300, 3), (6, 5000)], ids=["NC", "NCd", "wide"])
@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_fused(monkeypatch, device, dtype, shape, opts):
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
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(device).requires_grad_()
    q = torch.softmax(torch.randn(*shape, generator=g) * 2, 1)
    loss, lse, ent = flce.cross_entropy(x, q.to(device), weight=None if cw is None else
                                        cw.to(device), reduction="none", return_lse=True,
                                        return_entropy=True, **kw)
    xd = x.detach().cpu().double().requires_grad_()
    rows = (lambda a: a.movedim(1, -1).reshape(-1, c))
    ref = reference.soft_cross_entropy(rows(xd), rows(q).double(), reduction="none",
                                       weight=None if cw is None else cw.double(), **kw)
    for name, got, r in zip(("loss", "lse", "entropy"), (loss, lse, ent), ref):
        assert rel_err(got.cpu().reshape(-1), r) < 2e-6, name
    k = torch.rand(ref[0].shape, generator=g).double() + 0.5
    (loss.double().reshape(-1) * k.to(device)).sum().backward()
    (ref[0] * k).sum().backward()
    # dz_j = k (Y p_j - y_j): one rounding to the dtype, relative to the row's largest element,
    # plus the fp32 sums of the row's target weights (Y, Y_rest: c non-negative terms, Higham's
    # gamma_c relative to k Y) that the pivot's gradient holds.
    u = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[dtype]
    y = rows(q).double() * (1 if cw is None else cw.double())
    mass = k * ((1 - kw.get("label_smoothing", 0.0)) * y.sum(1) + kw.get("label_smoothing", 0.0)
                * (1 if cw is None else cw.double().mean()))
    gd, got = rows(xd.grad), rows(x.grad.cpu().double())
    bound = u * gd.abs().amax(1, keepdim=True) + (8 + c) * 2.0 ** -24 * mass[:, None]
    assert ((got - gd).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["probabilities", "classes"])
@pytest.mark.parametrize("upstream", [1.0, 2.0 ** -16], ids=["g1", "g-tiny"])
@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_cuda_chunked(monkeypatch, device, dtype, kind, upstream):
    """The CUDA backend's soft mode through several sub-chunks and groups of rows of its chunk
    driver (a 0.1 MB workspace: 86-row logits chunks, 64-row groups): each chunk's target rows,
    fp16's scale, the pivots' target fixes, against float64. A tiny upstream gradient (2^-16: a
    mean over many tokens, a loss scale) puts the gradient tile's entries among fp16's
    subnormals unless the tile is scaled."""
    monkeypatch.setenv("FLCE_CUDA_WORKSPACE_MB", "0.1")
    n = 150
    g = torch.Generator().manual_seed(19)
    x = torch.randn(n, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) / D ** 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    q = torch.softmax(torch.randn(n, V, generator=g) * 3, 1)
    cw = torch.rand(V, generator=g) + 0.5
    t = torch.randint(0, V, (n,), generator=g)
    t[::5] = -100
    target = q if kind == "probabilities" else t
    kw = dict(label_smoothing=0.1, z_loss=1e-3)
    leaves = [a.clone().to(device).requires_grad_() for a in (x, w, b)]
    loss, lse = flce.linear_cross_entropy(*leaves[:2], target.to(device), bias=leaves[2],
                                          class_weight=cw.to(device), reduction="none",
                                          return_lse=True, **kw)
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    if kind == "probabilities":
        ref = reference.soft_cross_entropy(z, q.double(), reduction="none", weight=cw.double(),
                                           **kw)
    else:
        ref = reference.logits_cross_entropy(z, t, reduction="none", weight=cw.double(),
                                             return_lse=True, **kw)
    assert rel_err(loss.cpu(), ref[0]) < 2e-6 and rel_err(lse.cpu(), ref[1]) < 2e-6
    cot = (torch.rand(n, generator=g).double() + 0.5) * upstream
    ((loss.double() + 0.1 * lse.double()) * cot.to(device)).sum().backward()
    ((ref[0] + 0.1 * ref[1]) * cot).sum().backward()
    zw = None if kind == "probabilities" else torch.where(t != -100, cw.double()[t.clamp(min=0)],
                                                          0.0)
    # (fp16: the tile is scaled to fp16's range, then rounded once, as bf16's is: bf16's bound
    # holds it with 3 more bits to spare)
    _check_grads(leaves, wide, z, _target_weights(target, V, cw, 0.1), cot,
                 torch.bfloat16 if dtype == torch.float16 else dtype, None, 1.0, None, 0.1 * cot,
                 1e-3, zw)
    # Norm-wise, each gradient within 1.5x the error of rounding the float64 one to its dtype
    # (the CUDA contract for a tile rounded once), plus 2^-12: the element bound above allows a
    # sum of (8 + K) tile errors, loose enough to hide a tile flushed among fp16's subnormals
    # (4-12x the floor at the tiny upstream without the tile's scale).
    for name, a, r in zip(("input", "weight", "bias"), leaves, wide):
        err, floor = rel_err(a.grad, r.grad), rel_err(r.grad.to(dtype), r.grad)
        assert err <= 1.5 * floor + 2.0 ** -12, \
            f"{name} gradient off by {err:.3g} norm-wise, its dtype's floor {floor:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["probabilities", "classes"])
def test_single_pass(no_logits, dtype, reduction, kind):
    """The single pass (flce::soft_sum_and_grad: one logit GEMM for the loss and the gradients)
    against float64, as the recompute path is held: probability targets with weights and
    smoothing, class targets with weights and smoothing (the mean over the targets' weights)."""
    x, w, b, q, cw, t = _inputs(dtype, seed=23)
    target = q if kind == "probabilities" else t
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, class_weight=cw,
              reduction=reduction)
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    loss = flce.linear_cross_entropy(*leaves[:2], target, bias=leaves[2], single_pass=True, **kw)
    loss.backward()
    wide = [a.double().requires_grad_() for a in (x, w, b)]
    z = wide[0] @ wide[1].T + wide[2]
    z.retain_grad()
    ref_kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, reduction=reduction,
                  weight=cw.double())
    if kind == "probabilities":
        ref = reference.soft_cross_entropy(z, q.double(), **ref_kw)
        zw, g = None, torch.full((N,), 1.0 / N if reduction == "mean" else 1.0,
                                  dtype=torch.float64)
    else:
        ref = reference.logits_cross_entropy(z, t, **ref_kw)
        zw = torch.where(t != -100, cw.double()[t.clamp(min=0)], 0.0)
        g = torch.full((N,), 1.0 / zw.sum().item() if reduction == "mean" else 1.0,
                       dtype=torch.float64)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 2e-6 * abs(ref.item())
    y = _target_weights(target, V, cw, 0.1)
    _check_grads(leaves, wide, z, y, g, dtype, 5.0, 1.0, None, None, 1e-3, zw)


def test_single_pass_without_room_for_a_row_block():
    """A vocabulary too large for the single pass's row-block logits (bf16, V = 1.2M: not 16
    rows within its 72 MiB) takes forward + recompute backward inside the op: the same loss and
    gradients as single_pass=False."""
    g = torch.Generator().manual_seed(29)
    n, v, d = 16, 1_200_000, 4
    x = torch.randn(n, d, generator=g).bfloat16()
    w = torch.randn(v, d, generator=g).bfloat16()
    q = torch.softmax(torch.randn(n, v, generator=g) * 4, 1)
    grads = []
    for single in (True, False):
        leaves = [a.clone().requires_grad_() for a in (x, w)]
        loss = flce.linear_cross_entropy(*leaves, q, single_pass=single, label_smoothing=0.1)
        loss.backward()
        grads.append((loss.detach(), leaves[0].grad, leaves[1].grad))
    (l1, x1, w1), (l2, x2, w2) = grads
    assert torch.equal(l1, l2) or rel_err(l1, l2) < 1e-6
    assert rel_err(x1, x2) < 2.0 ** -8 and rel_err(w1, w2) < 2.0 ** -8
