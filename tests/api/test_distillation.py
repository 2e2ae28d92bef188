"""flce.linear_distillation against the float64 collapse-safe reference
(flce.reference.distillation): every divergence, beta, temperature, hard and soft weights,
ignored tokens, reductions, biases, a teacher of another hidden size, 16-bit inputs with fp32
master weights, a teacher with and without gradients, shift, chunking; the collapse sweep where
both models put almost all their mass on one class (the same one or different ones), against
which F.kl_div(F.log_softmax(...)) returns rounding noise; gradcheck, torch.compile, bad input,
NaN."""
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import flce
from flce import distill, reference
from flce.check import distill_collapsed
from helpers import HAS_CUDA, LOSS_FACTOR, assert_close_to_ref, assert_grad_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA,
                                                                reason="no CUDA device"))]
# The CUDA backend's fused row math (flce::distill_rows_, FLCE_CUDA_OPT_IN=distill) on the host
# emulation of its kernel ("cuda-host": conftest.py routes the API there), beside the CPU's.
FUSED_BACKENDS = ["cpu", pytest.param("cuda-host", marks=pytest.mark.cuda_host)]
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1),
               ("jsd", 0.9), ("jsd", 0.0), ("jsd", 1.0)]
LEAD, V, DS, DT = (3, 7), 40, 16, 24
F32_EPS = torch.finfo(torch.float32).eps


def _inputs(dtype, device, *, seed=0, lead=LEAD, v=V, bias=True, ignore=True, scale=2.0):
    """Fresh random (student_input, student_weight, teacher_input, teacher_weight, target,
    student_bias, teacher_bias); 16-bit inputs get float32 master weights."""
    g = torch.Generator().manual_seed(seed)
    wdt = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    def r(shape, dt, s):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * s).to(dt).to(device)

    xs = r(lead + (DS,), dtype, scale ** 0.5 / DS ** 0.25)
    ws = r((v, DS), wdt, scale ** 0.5 / DS ** 0.25)
    xt = r(lead + (DT,), dtype, scale ** 0.5 / DT ** 0.25)
    wt = r((v, DT), wdt, scale ** 0.5 / DT ** 0.25)
    bs = r((v,), wdt, 0.3) if bias else None
    bt = r((v,), wdt, 0.3) if bias else None
    t = torch.randint(0, v, lead, generator=g)
    if ignore:
        t[torch.rand(lead, generator=g) < 0.25] = -100
    return xs, ws, xt, wt, t.to(device), bs, bt


def _leaves(tensors, teacher_grad=True):
    out = []
    for i, x in enumerate(tensors):
        grad = x is not None and x.dtype.is_floating_point and (teacher_grad or i in (0, 1, 5))
        out.append(x.detach().clone().requires_grad_() if grad else x)
    return out


def _reference(tensors, upstream, **kw):
    """float64 loss and the gradients of (loss * upstream).sum() in every floating tensor; the
    weights' values in their input's dtype, the biases' in their own (flce.linear_cross_entropy's
    master-weight semantics)."""
    xs, ws, xt, wt, t, bs, bt = tensors
    wide = [None if x is None else
            x.detach().cpu().to(xs.dtype if i == 1 else xt.dtype if i == 3 else
                                x.dtype).double().requires_grad_()
            if x.dtype.is_floating_point else x.cpu() for i, x in enumerate(tensors)]
    w_xs, w_ws, w_xt, w_wt, w_t, w_bs, w_bt = wide
    zs = w_xs.reshape(-1, DS) @ w_ws.T + (0 if w_bs is None else w_bs)
    zt = w_xt.reshape(-1, DT) @ w_wt.T + (0 if w_bt is None else w_bt)
    loss = reference.distillation(zs, zt, w_t.reshape(-1), **kw)
    if kw.get("reduction") == "none":
        loss = loss.reshape(w_t.shape)
    (loss * upstream.cpu().double()).sum().backward()
    return loss.detach(), [None if x is None or not x.dtype.is_floating_point else x.grad
                           for x in wide]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_matches_reference(device, dtype, reduction, divergence, beta):
    _matches_reference(device, dtype, reduction, divergence, beta)


@pytest.mark.cuda_host
@pytest.mark.parametrize("opt_in", [True, False], ids=["distill", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_cuda_row_math(monkeypatch, opt_in, dtype, reduction, divergence, beta):
    """The CUDA backend (host emulation): with FLCE_CUDA_OPT_IN=distill its fused op serves the
    row math, otherwise the torch ops of distill._rows; both against float64."""
    monkeypatch.setenv("FLCE_CUDA_OPT_IN", "distill" if opt_in else "")
    calls = []
    rows = distill._rows
    monkeypatch.setattr(distill, "_rows", lambda *a: calls.append(1) or rows(*a))
    _matches_reference("cpu", dtype, reduction, divergence, beta)
    assert bool(calls) != opt_in


def _matches_reference(device, dtype, reduction, divergence, beta):
    tensors = _inputs(dtype, device, 
                      seed=zlib.crc32(f"{dtype}{reduction}{divergence}{beta}".encode()))
    kw = dict(divergence=divergence, beta=beta, temperature=1.5, hard_weight=0.3,
              soft_weight=0.7, reduction=reduction)
    leaves = _leaves(tensors)
    xs, ws, xt, wt, t, bs, bt = leaves
    loss = flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == (LEAD if reduction == "none" else ())
    upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    (loss * upstream.to(device, loss.dtype)).sum().backward()
    ref, grads = _reference(tensors, upstream, **kw)
    if dtype == torch.float64:
        torch.testing.assert_close(loss.cpu(), ref, rtol=1e-12, atol=1e-14)
    else:
        assert_close_to_ref(loss, ref, torch.float32, factor=LOSS_FACTOR, what="loss")
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "target",
             "student_bias", "teacher_bias")
    for name, leaf, r in zip(names, leaves, grads):
        if r is None:
            continue
        assert leaf.grad.dtype == leaf.dtype, name
        if dtype == torch.float64:
            torch.testing.assert_close(leaf.grad.cpu(), r, rtol=1e-10, atol=1e-13,
                                       msg=lambda m: f"{name}: {m}")
        else:
            assert_grad_close(leaf.grad, r, what=name)


def test_reference_is_the_textbook_divergence_away_from_collapse():
    """The oracle itself: where nothing collapses, F.kl_div of float64 log_softmax (TRL's and
    Liger's formulas, M = beta T + (1 - beta) S) plus F.cross_entropy agree with it."""
    g = torch.Generator().manual_seed(3)
    zs0 = torch.randn(20, 30, generator=g, dtype=torch.float64) * 2
    zt0 = torch.randn(20, 30, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, 30, (20,), generator=g)
    t[::4] = -100
    upstream = torch.rand(20, generator=g, dtype=torch.float64) + 0.5
    for divergence, beta in DIVERGENCES:
        zs, zt = zs0.clone().requires_grad_(), zt0.clone().requires_grad_()
        s, te = F.log_softmax(zs / 1.3, -1), F.log_softmax(zt / 1.3, -1)
        if divergence == "forward_kl" or beta == 0.0:
            soft = F.kl_div(s, te, reduction="none", log_target=True).sum(-1)
        elif divergence == "reverse_kl" or beta == 1.0:
            soft = F.kl_div(te, s, reduction="none", log_target=True).sum(-1)
        else:
            m = torch.logsumexp(torch.stack([s + math.log(1 - beta), te + math.log(beta)]), 0)
            soft = (beta * F.kl_div(m, te, reduction="none", log_target=True).sum(-1)
                    + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True).sum(-1))
        hard = F.cross_entropy(zs, t, reduction="none")
        want = torch.where(t != -100, 0.6 * soft + 0.4 * hard, 0.0)
        want_grads = torch.autograd.grad((want * upstream).sum(), (zs, zt))
        got = reference.distillation(zs, zt, t, divergence=divergence, beta=beta,
                                     temperature=1.3, hard_weight=0.4, soft_weight=0.6,
                                     reduction="none")
        got_grads = torch.autograd.grad((got * upstream).sum(), (zs, zt))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weights_split_the_terms(reduction):
    """The hard term alone is flce.linear_cross_entropy of the student (at temperature 1.0 or
    not: the temperature is the soft term's), the soft term scales linearly in soft_weight, and
    the two add."""
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float64, "cpu")
    kw = dict(student_bias=bs, teacher_bias=bt, reduction=reduction, temperature=1.7)
    hard = flce.linear_distillation(xs, ws, xt, wt, t, hard_weight=1.0, soft_weight=0.0, **kw)
    ce = flce.linear_cross_entropy(xs, ws, t, bias=bs, reduction=reduction)
    torch.testing.assert_close(hard, ce, rtol=1e-12, atol=1e-14)
    soft = flce.linear_distillation(xs, ws, xt, wt, t, **kw)
    torch.testing.assert_close(
        flce.linear_distillation(xs, ws, xt, wt, t, soft_weight=2.5, **kw), 2.5 * soft,
        rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        flce.linear_distillation(xs, ws, xt, wt, t, hard_weight=0.3, soft_weight=2.5, **kw),
        0.3 * hard + 2.5 * soft, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("teacher", ["frozen", "no_grad"])
def test_teacher_without_gradients(teacher):
    xs, ws, xt, wt, t, bs, bt = _leaves(_inputs(torch.float32, "cpu"), teacher_grad=False)
    if teacher == "no_grad":
        with torch.no_grad():
            zt = (xt.reshape(-1, DT) @ wt.T).reshape(LEAD + (V,))
        xt, wt, bt = zt, torch.eye(V), None  # the teacher's logits as its hidden states
    loss = flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt)
    loss.backward()
    assert xs.grad is not None and ws.grad is not None and bs.grad is not None
    assert not xt.requires_grad and not wt.requires_grad
    with torch.no_grad():
        assert not flce.linear_distillation(xs, ws, xt, wt, t).requires_grad


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("wants", ["input", "weight", "bias"])
def test_teacher_gradient_only_where_required(wants, reduction):
    """Of the teacher's tensors, exactly those that require grad get one, and it is the float64
    reference's; the student's are unchanged by the teacher's needs."""
    tensors = _inputs(torch.float32, "cpu")
    leaves = _leaves(tensors, teacher_grad=False)
    index = {"input": 2, "weight": 3, "bias": 6}[wants]
    leaves[index] = leaves[index].detach().clone().requires_grad_()
    xs, ws, xt, wt, t, bs, bt = leaves
    loss = flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt,
                                    hard_weight=0.5, reduction=reduction)
    upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    (loss * upstream).sum().backward()
    _, grads = _reference(tensors, upstream, hard_weight=0.5, reduction=reduction)
    for i in (2, 3, 6):
        if i == index:
            assert_grad_close(leaves[i].grad, grads[i], what=wants)
        else:
            assert leaves[i].grad is None, i
    for i in (0, 1, 5):
        assert_grad_close(leaves[i].grad, grads[i], what=str(i))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_tokens(reduction):
    """Ignored tokens add neither term nor gradient (their teacher rows may hold anything, NaN
    included), "mean" counts the others, and a batch with every token ignored gives 0 and zero
    gradients (as Liger's clamped count and TRL give)."""
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu")
    kw = dict(hard_weight=0.5, reduction=reduction, student_bias=bs, teacher_bias=bt)
    base = flce.linear_distillation(xs, ws, xt, wt, t, **kw)
    poisoned = xt.clone()
    poisoned[t == -100] = 1e3
    torch.testing.assert_close(flce.linear_distillation(xs, ws, poisoned, wt, t, **kw), base)
    kept = t != -100
    per_token = flce.linear_distillation(xs, ws, xt, wt, t, **{**kw, "reduction": "none"})
    assert (per_token[~kept] == 0).all() and (per_token[kept] > 0).all()
    if reduction == "mean":
        torch.testing.assert_close(base, per_token.sum() / kept.sum())
    x = xs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    loss = flce.linear_distillation(x, w, xt, wt, torch.full_like(t, -100), **kw)
    loss.sum().backward()
    assert (loss == 0).all() and (x.grad == 0).all() and (w.grad == 0).all()


def test_without_target():
    """No target: every token counts and hard_weight must stay 0."""
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu", ignore=False)
    got = flce.linear_distillation(xs, ws, xt, wt, divergence="reverse_kl")
    torch.testing.assert_close(got, flce.linear_distillation(xs, ws, xt, wt, t,
                                                             divergence="reverse_kl"))


@pytest.mark.parametrize("k", [1, 2])
def test_shift(k):
    """shift=k scores position i against target[..., i + k] and ignores the last k positions,
    as shifting the labels by hand; "none" returns the T - k positions that have a target."""
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu")
    shifted = torch.cat([t[..., k:], torch.full(LEAD[:-1] + (k,), -100)], -1)
    kw = dict(hard_weight=0.5, divergence="jsd", beta=0.3)
    torch.testing.assert_close(flce.linear_distillation(xs, ws, xt, wt, t, shift=k, **kw),
                               flce.linear_distillation(xs, ws, xt, wt, shifted, **kw))
    none = flce.linear_distillation(xs, ws, xt, wt, t, shift=k, reduction="none", **kw)
    assert none.shape == LEAD[:-1] + (LEAD[-1] - k,)
    torch.testing.assert_close(none, flce.linear_distillation(
        xs, ws, xt, wt, shifted, reduction="none", **kw)[..., :-k])
    no_target = flce.linear_distillation(xs, ws, xt, wt, shift=k, reduction="none")
    assert no_target.shape == LEAD[:-1] + (LEAD[-1] - k,)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunks(monkeypatch, reduction):
    """Row chunks of 3 rows (and a last, shorter one) give the one-chunk result (float64:
    only the order of the sums differs)."""
    tensors = _inputs(torch.float64, "cpu")
    kw = dict(hard_weight=0.5, reduction=reduction, temperature=0.7)

    def run():
        xs, ws, xt, wt, t, bs, bt = leaves = _leaves(tensors)
        loss = flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt,
                                        **kw)
        loss.sum().backward()
        return [loss] + [x.grad for x in leaves if x is not None and x.dtype.is_floating_point]

    whole = run()
    for name in ("CPU_CHUNK_BYTES", "CPU_ROWS_CHUNK_BYTES"):
        monkeypatch.setattr(distill, name, 3 * V * 8)
    for fused in (True, False):
        assert len(distill._chunks(21, V, 8, torch.device("cpu"), fused)) == 7
    for a, b in zip(run(), whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vocab_blocks(monkeypatch, dtype):
    """16-bit inputs: GEMMs over vocabulary blocks of widened weight (blocks of 7 to 10 classes
    and a shorter last one, then of one class) against the float64 reference."""
    tensors = _inputs(dtype, "cpu")
    kw = dict(hard_weight=0.5, beta=0.3, temperature=1.2)
    _, grads = _reference(tensors, torch.ones(()), **kw)
    for block_rows in (7, 1):
        monkeypatch.setattr(distill, "BLOCK_BYTES", block_rows * 4 * DT)
        xs, ws, xt, wt, t, bs, bt = leaves = _leaves(tensors)
        flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt,
                                 **kw).backward()
        for i, (leaf, r) in enumerate(zip(leaves, grads)):
            if r is not None:
                assert_grad_close(leaf.grad, r, what=str(i))


def test_module():
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu")
    kw = dict(divergence="forward_kl", temperature=2.0, hard_weight=0.2, soft_weight=0.8,
              reduction="sum", shift=True)
    module = flce.LinearDistillation(**kw)
    torch.testing.assert_close(module(xs, ws, xt, wt, t, bs, bt),
                               flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs,
                                                        teacher_bias=bt, **kw))
    assert "forward_kl" in repr(module)
    with pytest.raises(flce.ArgumentError, match="beta"):
        flce.LinearDistillation(beta=2.0)


def _naive(zs, zt, divergence, beta):
    """TRL's / Liger's per-token divergence: F.kl_div of log_softmax, in the logits' dtype."""
    s, t = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    if divergence == "forward_kl":
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if divergence == "reverse_kl":
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), 0)
    return (beta * F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
            + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True).sum(-1))


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("same", [True, False], ids=["same_class", "different_classes"])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:5])
def test_collapse_sweep(monkeypatch, same, divergence, beta, backend):
    """Margins 0..100 (the off-dominant mass down to ~1e-42, 1 - 1e-30 on the dominant class at
    70): the fp32 loss within 1e-5 of float64 wherever it is a normal fp32 number, and every
    student and teacher gradient entry within a few roundings of the logits' scale, times the
    row's largest gradient entry (an fp32 logit z carries |z| 2^-24 absolute error: the floor of
    any fp32-logit implementation, docs/numerics.md). The hidden states are the logits (an
    identity classifier, exact in fp32). Where both share a class and the margin is >= 30,
    F.kl_div(F.log_softmax) in fp32, TRL's and Liger's formula, is off by 10% to 100% (KL) and
    by factors up to 1e20 (JSD at beta 0.1, 0.9) in the typical token; at beta = 0.5 its two
    lost dominant-class terms cancel (docs/numerics.md, "Distillation"). On "cuda-host": the
    CUDA backend's fused row math (FLCE_CUDA_OPT_IN=distill)."""
    monkeypatch.setenv("FLCE_CUDA_OPT_IN", "distill")
    n, v = 16, 64
    eye = torch.eye(v)
    for margin in range(0, 101, 10):
        zs, zt, _, _ = distill_collapsed(n, v, float(margin), same, seed=margin)
        xs, xt = zs.clone().requires_grad_(), zt.clone().requires_grad_()
        loss = flce.linear_distillation(xs, eye, xt, eye, divergence=divergence, beta=beta,
                                        reduction="none")
        loss.sum().backward()
        s64, t64 = zs.double().requires_grad_(), zt.double().requires_grad_()
        ref = reference.distillation(s64, t64, divergence=divergence, beta=beta,
                                     reduction="none")
        ref.sum().backward()
        tiny = torch.finfo(torch.float32).tiny
        normal = ref.abs() > tiny
        err = ((loss.double() - ref).abs() / ref.abs())[normal]
        assert not normal.any() or err.max() <= 1e-5, (margin, err.max().item())
        # (below fp32's normal range, within its subnormal spacing of the true value)
        assert ((loss.double() - ref).abs()[~normal] <= tiny).all(), margin
        for what, got, want, z in (("student", xs.grad, s64.grad, zs),
                                   ("teacher", xt.grad, t64.grad, zt)):
            scale = want.abs().amax(1, keepdim=True)
            live = (scale > torch.finfo(torch.float32).tiny / F32_EPS)[:, 0]
            floor = 4 * F32_EPS * (1 + z.abs().amax(1, keepdim=True)) * scale
            bad = ((got.double() - want).abs() > floor)[live]
            assert not bad.any(), (what, margin, ((got.double() - want).abs() / scale).max())
        if same and margin >= 30 and beta != 0.5:
            naive = _naive(zs, zt, divergence, beta)
            assert ((naive.double() - ref).abs() / ref).median() >= 0.1, margin


def test_collapse_gradient_at_the_shared_class():
    """Forward KL at a shared dominant class: the student's gradient there is e_T - e_S, about
    1e-13 here, which (1 - e_S) - (1 - e_T) in fp32 rounds to 0 or to multiples of 2^-24."""
    zs, zt, _, _ = distill_collapsed(4, 32, 30.0, True, seed=5)
    x = zs.clone().requires_grad_()
    flce.linear_distillation(x, torch.eye(32), zt, torch.eye(32), divergence="forward_kl",
                             reduction="sum").backward()
    s64 = zs.double().requires_grad_()
    reference.distillation(s64, zt.double(), divergence="forward_kl", reduction="sum").backward()
    a = zt.argmax(1, keepdim=True)
    want, got = s64.grad.gather(1, a), x.grad.gather(1, a).double()
    assert (want.abs() < 1e-9).all() and (want != 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    naive = zs.clone().requires_grad_()
    _naive(naive, zt, "forward_kl", 0.5).sum().backward()
    assert ((naive.grad.gather(1, a).double() - want).abs() / want.abs()).min() > 0.5


@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:4])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck(divergence, beta, reduction):
    xs, ws, xt, wt, t, bs, bt = _leaves(_inputs(torch.float64, "cpu", lead=(5,), v=9))

    def f(xs, ws, xt, wt, bs, bt):
        return flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt,
                                        divergence=divergence, beta=beta, temperature=1.3,
                                        hard_weight=0.4, reduction=reduction)

    # fast_mode: the Jacobian against random vectors on both sides (a full one takes ~15 s)
    assert torch.autograd.gradcheck(f, (xs, ws, xt, wt, bs, bt), fast_mode=True)


def test_compile_fullgraph():
    tensors = _inputs(torch.float32, "cpu")

    def f(xs, ws, xt, wt, t, bs):
        return flce.linear_distillation(xs, ws, xt, wt, t, student_bias=bs, hard_weight=0.5,
                                        beta=0.3, temperature=2.0)

    def run(fn):
        xs, ws, xt, wt, t, bs, _ = _leaves(tensors, teacher_grad=False)
        loss = fn(xs, ws, xt, wt, t, bs)
        loss.backward()
        return [loss, xs.grad, ws.grad, bs.grad]

    torch._dynamo.reset()
    for a, b in zip(run(torch.compile(f, fullgraph=True)), run(f)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_nan_propagates():
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu", ignore=False)
    for which in ("student", "teacher"):
        a, b = xs.clone(), xt.clone()
        (a if which == "student" else b)[1, 2, 0] = math.nan
        loss = flce.linear_distillation(a, ws, b, wt, t, hard_weight=0.5, reduction="none")
        assert torch.isnan(loss[1, 2]), which
        assert torch.isfinite(loss[0]).all(), which
        assert torch.isnan(flce.linear_distillation(a, ws, b, wt, t)), which


def _bad(**changes):
    xs, ws, xt, wt, t, bs, bt = _inputs(torch.float32, "cpu")
    args = dict(student_input=xs, student_weight=ws, teacher_input=xt, teacher_weight=wt,
                target=t, student_bias=bs, teacher_bias=bt)
    args.update({k: v(args) if callable(v) else v for k, v in changes.items()})
    return args


@pytest.mark.parametrize("changes,exc,match", [
    (dict(student_weight=lambda a: a["student_weight"].T), flce.ArgumentError,
     "student_weight looks transposed"),
    (dict(teacher_weight=lambda a: a["teacher_weight"][:, :5]), flce.ArgumentError,
     "teacher_input's last dimension"),
    (dict(teacher_weight=lambda a: a["teacher_weight"][:7], teacher_bias=None),
     flce.ArgumentError, "teacher_weight's V"),
    (dict(student_weight=lambda a: a["student_weight"][:0],
          teacher_weight=lambda a: a["teacher_weight"][:0], student_bias=None,
          teacher_bias=None), flce.ArgumentError, "at least one class"),
    (dict(teacher_input=lambda a: a["teacher_input"][:2]), flce.ArgumentError,
     "teacher_input's leading dimensions"),
    (dict(target=lambda a: a["target"][:, :3]), flce.ArgumentError, "target must have shape"),
    (dict(target=lambda a: a["target"].float()), flce.DtypeError, "class indices"),
    (dict(target=lambda a: a["target"].clamp(min=0) + V), IndexError, "out of range"),
    (dict(student_input=lambda a: a["student_input"].long()), flce.DtypeError,
     "student_input must be float32"),
    (dict(teacher_weight=lambda a: a["teacher_weight"].double()), flce.DtypeError,
     "teacher_weight must have teacher_input's dtype"),
    (dict(student_bias=lambda a: a["student_bias"][:5]), flce.ArgumentError,
     r"student_bias must have shape \(40,\)"),
    (dict(teacher_bias=lambda a: a["teacher_bias"].half()), flce.DtypeError,
     "teacher_bias must have teacher_weight's dtype"),
    (dict(student_input=None), TypeError, "student_input must be a torch.Tensor"),
    (dict(divergence="kl"), flce.ArgumentError, "divergence must be one of"),
    (dict(beta=1.5), flce.ArgumentError, "beta must be in"),
    (dict(beta=math.nan), flce.ArgumentError, "beta must be in"),
    (dict(temperature=0.0), flce.ArgumentError, "temperature must be a positive"),
    (dict(temperature=-1.0), flce.ArgumentError, "temperature must be a positive"),
    (dict(hard_weight=math.inf), flce.ArgumentError, "hard_weight must be a finite"),
    (dict(soft_weight="1"), TypeError, "soft_weight must be a number"),
    (dict(reduction="batchmean"), flce.ArgumentError, "reduction must be one of"),
    (dict(target=None, hard_weight=0.5), flce.ArgumentError, "hard_weight=0.5 needs target"),
    (dict(shift=-1), flce.ArgumentError, "shift must be"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_input(changes, exc, match):
    args = _bad(**changes)
    with pytest.raises(exc, match=match):
        flce.linear_distillation(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("divergence", ["jsd", "forward_kl", "reverse_kl"])
def test_cpu_row_math_path(monkeypatch, dtype, divergence):
    """On the CPU backend the fused op (flce::distill_rows_) serves every dtype and divergence,
    fp32 JSD (the default) included: the torch row math is not called."""
    calls = []
    rows = distill._rows
    monkeypatch.setattr(distill, "_rows", lambda *a: calls.append(1) or rows(*a))
    xs, ws, xt, wt, t, bs, bt = _leaves(_inputs(dtype, "cpu"))
    flce.linear_distillation(xs, ws, xt, wt, t, divergence=divergence).backward()
    assert not calls
