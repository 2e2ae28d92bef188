"""flce::distill_rows_, the distillation row math of the CPU backend (csrc/cpu/distill_cpu.cpp) and
of the CUDA backend (csrc/cuda/flce_distill.cu; "cuda-host": its kernel under the host emulation),
against the torch ops of flce.distill._rows (its oracle, the CUDA backend's default path) and the
float64 collapse-safe reference (flce.reference.distillation): random and collapsed rows, every
divergence, beta, temperature and weight, V not a multiple of the vector width nor of the
kernel's 256 threads, ignored rows, NaN and inf logits, gradients wanted or not, NaN-poisoned
outputs."""
import math

import pytest
import torch

from flce import _ops, distill, reference
from flce.check import distill_collapsed
from helpers import raises_within_two_calls

F32_EPS = torch.finfo(torch.float32).eps
TINY = torch.finfo(torch.float32).tiny
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1),
               ("jsd", 0.9)]
# V = 1, widths around the CPU's 4-, 8- and 16-lane vectors, a long row, and (the CUDA kernel's
# 256 threads a row) a row of fewer columns than threads with a tail past them
WIDTHS = [1, 2, 7, 8, 9, 17, 33, 67, 1000, 300]


def _op(z_s, z_t, target, valid, cfg, grad_s=True, grad_t=True, device="cpu"):
    """The op of the backend that serves ``device`` (conftest.py routes "cuda-host" to the
    emulated CUDA backend) on copies: (loss, g_s or the untouched z_s copy, g_t or the
    untouched z_t copy), on the CPU; the loss buffer starts NaN-filled, so an element it does
    not write fails every check."""
    gs, gt = z_s.to(device, copy=True), z_t.to(device, copy=True)
    loss = torch.full((z_s.shape[0],), math.nan, dtype=z_s.dtype, device=device)
    _ops.ops.distill_rows_(gs, gt, loss, target.to(device), valid.to(device), *cfg, grad_s,
                           grad_t)
    return loss.cpu(), gs.cpu(), gt.cpu()


def _logits(n, v, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z_s = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    z_t = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale + 0.5).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    valid = torch.rand(n, generator=g) >= 0.2
    return z_s, z_t, target, valid


def _reference(z_s, z_t, target, valid, cfg, weights=None):
    """float64 per-row losses and their gradients in both logits (0 on ignored rows), and each
    gradient's scale [rows, 1]: its soft and hard terms' largest entries, added (the two
    terms' gradients cancel in part where the student's and the target's classes meet)."""
    divergence, beta, temperature, hard_weight, soft_weight = cfg
    s64 = z_s.detach().double().clone().requires_grad_()
    t64 = z_t.detach().double().clone().requires_grad_()
    hard_weight, soft_weight = weights or (hard_weight, soft_weight)
    loss = reference.distillation(s64, t64, torch.where(valid, target, -100),
                                  divergence=divergence, beta=beta, temperature=temperature,
                                  hard_weight=hard_weight, soft_weight=soft_weight,
                                  reduction="none")
    loss.sum().backward()
    if weights is not None:
        return s64.grad.abs().amax(1, keepdim=True), t64.grad.abs().amax(1, keepdim=True)
    scales = [_reference(z_s, z_t, target, valid, cfg, w)
              for w in ((hard_weight, 0.0), (0.0, soft_weight))]
    return (loss.detach(), s64.grad, t64.grad,
            (scales[0][0] + scales[1][0], scales[0][1] + scales[1][1]))


def _terms(z_s, z_t, target, cfg):
    """Per row, the size of the terms the loss sums (float64): the soft term's
    sum_j (S_j + T_j)(|log S_j| + |log T_j| + |u_s,j| + |u_t,j|) (each log ratio is formed from
    logit differences, which carry the logits' rounding) and the hard term's |log p_t|: a few
    roundings of it is the floor of any fp32-logit implementation (docs/numerics.md)."""
    divergence, beta, temperature, hard_weight, soft_weight = cfg
    u_s, u_t = z_s.double() / temperature, z_t.double() / temperature
    ls, lt = torch.log_softmax(u_s, 1), torch.log_softmax(u_t, 1)
    terms = ((ls.exp() + lt.exp()) * (ls.abs() + lt.abs() + u_s.abs() + u_t.abs()))
    out = abs(soft_weight) * terms.nan_to_num(0.0, 0.0, 0.0).sum(1)
    if hard_weight:
        lh = torch.log_softmax(z_s.double(), 1).gather(1, target.clamp(min=0)[:, None])[:, 0]
        out = out + abs(hard_weight) * lh.abs().nan_to_num(0.0, 0.0, 0.0)
    return out


def _check_against_float64(loss, g_s, g_t, z_s, z_t, ref, loss_rtol, what, floor=None,
                           eps=F32_EPS):
    """The loss within loss_rtol of float64 where it is a normal fp32 number (within fp32's
    subnormal spacing below; within ``floor`` [rows] where given, a few roundings of the terms
    it sums) and each gradient entry within 8 roundings of the logits' scale times its row's
    largest entry (docs/numerics.md, "Distillation": the floor of fp32 logits)."""
    want, want_s, want_t, scales = ref
    normal = want.abs() > TINY
    err = (loss.double() - want).abs()
    tol = loss_rtol * want.abs() + (0 if floor is None else floor)
    assert (err[normal] <= tol[normal]).all(), \
        (what, (err[normal] / want.abs()[normal]).max().item())
    assert (err[~normal] <= TINY).all(), what
    for name, got, w, z, scale in (("student", g_s, want_s, z_s, scales[0]),
                                   ("teacher", g_t, want_t, z_t, scales[1])):
        # (fp64, the gradcheck path: the float64 reference rounds as often as the op, and the
        # JSD's log mixtures, formed differently in each, differ by up to ~200 roundings at
        # beta 0.9 and temperature 0.7 (_rows agrees with the op to 8); 512 is still 1e-13 of
        # the scale, where a wrong formula is off by 1e-3 or more)
        roundings = 8 if eps == F32_EPS else 512
        floor = roundings * eps * (1 + z.double().abs().amax(1, keepdim=True)) * scale
        # (rows whose gradients are below fp32's normal range times eps have no relative
        # accuracy to hold)
        live = (scale > TINY / F32_EPS)[:, 0]
        bad = ((got.double() - w).abs() > floor)[live]
        assert not bad.any(), (what, name, ((got.double() - w).abs() / scale)[live].max().item())


def _check_against_rows(loss, g_s, g_t, z_s, z_t, target, valid, cfg, grad_s=True,
                        grad_t=True):
    """The op against the torch row math on the same logits: the loss within 8 roundings of
    the terms it sums (_terms; plus the dtype's smallest normal), the gradients within 8
    roundings of the logits' scale times the row's largest entry; NaN exactly where _rows has
    NaN."""
    want, want_s, want_t = distill._rows(z_s, z_t, target, valid, *cfg, grad_s, grad_t)
    # each gradient's scale: its soft and hard terms' largest finite entries, added
    divergence, beta, temperature, hard_weight, soft_weight = cfg
    parts = [distill._rows(z_s, z_t, target, valid, divergence, beta, temperature, h, s, True,
                           True)[1:] for h, s in ((hard_weight, 0.0), (0.0, soft_weight))]
    scales = [sum(torch.where(torch.isfinite(p[m]), p[m].abs(), 0).amax(1, keepdim=True)
                  for p in parts) for m in (0, 1)]
    eps = torch.finfo(z_s.dtype).eps
    tiny = torch.finfo(z_s.dtype).tiny
    assert torch.equal(torch.isnan(loss), torch.isnan(want))
    assert torch.equal(loss[torch.isinf(want)], want[torch.isinf(want)])
    ok = torch.isfinite(want)
    tol = 8 * eps * _terms(z_s, z_t, target, cfg).to(want.dtype) + tiny
    assert ((loss - want).abs()[ok] <= tol[ok]).all(), \
        ((loss - want).abs()[ok] / tol[ok]).max().item()
    for got, w, z, scale in ((g_s, want_s, z_s, scales[0]), (g_t, want_t, z_t, scales[1])):
        if w is None:
            continue
        assert torch.equal(torch.isnan(got), torch.isnan(w))
        finite = torch.isfinite(w) & torch.isfinite(got)
        zmax = torch.where(torch.isfinite(z), z.abs(), 0).amax(1, keepdim=True)
        floor = 8 * eps * (1 + zmax) * scale + tiny
        assert torch.equal(got[~finite & ~torch.isnan(w)], w[~finite & ~torch.isnan(w)])
        assert ((got - w).abs()[finite] <= floor.expand_as(w)[finite]).all(), \
            ((got - w).abs() / scale).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# the default (the logits as they are, no hard term), then a temperature below and one above 1
# with the hard term (test_collapsed_rows has the hard term at temperature 1)
@pytest.mark.parametrize("temperature,hard_weight,soft_weight", [
    (1.0, 0.0, 1.0), (0.7, 0.4, 0.6), (2.3, 0.4, 0.6)])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_random_rows(divergence, beta, temperature, hard_weight, soft_weight, dtype, device):
    """Every width, against _rows and float64; fp64 inputs to float64's own precision."""
    cfg = (divergence, beta, temperature, hard_weight, soft_weight)
    for v in WIDTHS:
        z_s, z_t, target, valid = _logits(13, v, dtype, seed=v)
        loss, g_s, g_t = _op(z_s, z_t, target, valid, cfg, device=device)
        assert not torch.isnan(loss).any()
        _check_against_rows(loss, g_s, g_t, z_s, z_t, target, valid, cfg)
        ref = _reference(z_s, z_t, target, valid, cfg)
        # (fp64: float64's roundings in place of fp32's)
        eps = torch.finfo(dtype).eps
        _check_against_float64(loss, g_s, g_t, z_s, z_t, ref, 1e-5 if eps == F32_EPS else 1e-13,
                               (v,), 4 * eps * _terms(z_s, z_t, target, cfg), eps)
        assert (loss[~valid] == 0).all() and (g_s[~valid] == 0).all() and \
            (g_t[~valid] == 0).all()


@pytest.mark.parametrize("same", [True, False], ids=["same_class", "different_classes"])
@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_collapsed_rows(divergence, beta, same, device):
    """Margins 0..100 (off-dominant mass down to ~1e-42): the loss within 1e-5 of float64 and
    every gradient entry within 8 roundings of the logits' scale (the API's collapse sweep,
    tests/api/test_distillation.py, holds 4 without the hard term and the temperature, whose
    rounding adds to it; _rows needs the same 8 here)."""
    n, v = 16, 61
    for margin in range(0, 101, 10):
        z_s, z_t, a, b = distill_collapsed(n, v, margin, same, seed=margin)
        valid = torch.ones(n, dtype=torch.bool)
        for cfg, target in (((divergence, beta, 1.0, 0.0, 1.0), a),
                            ((divergence, beta, 1.0, 0.5, 1.0), b),
                            ((divergence, beta, 1.5, 0.5, 0.8), a)):
            loss, g_s, g_t = _op(z_s, z_t, target, valid, cfg, device=device)
            ref = _reference(z_s, z_t, target, valid, cfg)
            _check_against_float64(loss, g_s, g_t, z_s, z_t, ref, 1e-5, (margin, cfg))
            _check_against_rows(loss, g_s, g_t, z_s, z_t, target, valid, cfg)


@pytest.mark.parametrize("divergence,beta,temperature", [
    ("jsd", 0.5, 1.0), ("jsd", 0.8, 2.0), ("jsd", 0.1, 1.0), ("reverse_kl", 0.5, 1.0),
    ("forward_kl", 0.5, 1.0)])
def test_kl_gradient_rows_sum_to_zero(divergence, beta, temperature):
    """A KL-form gradient (both of JSD's, reverse KL's student's, forward KL's teacher's) is a
    softmax's: its rows sum to 0, and the input gradient g @ W takes a row-sum error times W's
    mean row. Flat rows whose models differ at the dominant class (Liger's uniform [0, 1)
    inputs and weights, and a teacher near the student), where c = KL - r_a is far larger than
    the entries: each row's sum within fp32's eps times its sum_j |g_j| (math.h kl_center: up
    to 0.35 eps; with c undivided by sum_j p_j, 2.5 to 11 eps), from the op and from _rows."""
    g = torch.Generator().manual_seed(7)
    x_s, x_t = torch.rand(64, 64, generator=g), torch.rand(64, 128, generator=g)
    w_s, w_t = torch.rand(4096, 64, generator=g), torch.rand(4096, 128, generator=g)
    z = torch.randn(64, 4096, generator=g) * 2
    cases = ((x_s @ w_s.T, x_t @ w_t.T), (z, z + 0.05 * torch.randn(64, 4096, generator=g)))
    cfg = (divergence, beta, temperature, 0.0, 1.0)
    for z_s, z_t in cases:
        target, valid = torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool)
        op = _op(z_s, z_t, target, valid, cfg)[1:]
        rows = distill._rows(z_s, z_t, target, valid, *cfg, True, True)[1:]
        for path, grads in (("op", op), ("_rows", rows)):
            for name, grad in zip(("student", "teacher"), grads):
                if (divergence, name) in (("forward_kl", "student"), ("reverse_kl", "teacher")):
                    continue  # (-(P - R): each term rounded alone)
                grad = grad.double()
                ratio = grad.sum(1).abs() / (F32_EPS * grad.abs().sum(1))
                assert ratio.max() <= 1, (path, name, ratio.max().item())


@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_nan_and_inf_rows(divergence, beta, device):
    """A NaN logit makes its row's loss and gradients NaN, as _rows; +-inf logits give what
    _rows gives; an ignored row is 0 whatever its logits; the other rows are untouched."""
    z_s, z_t, target, valid = _logits(8, 19, torch.float32, seed=3)
    valid[:] = True
    z_s[0, 4] = math.nan
    z_t[1, 0] = math.nan
    z_s[2, 3] = math.inf
    z_t[3, 7] = -math.inf
    z_s[4, :] = -math.inf
    z_s[4, 5] = 1.0
    z_s[5, 2] = math.nan
    valid[5] = False
    for cfg in ((divergence, beta, 1.0, 0.0, 1.0), (divergence, beta, 2.0, 0.5, 1.0)):
        loss, g_s, g_t = _op(z_s, z_t, target, valid, cfg, device=device)
        assert torch.isnan(loss[:2]).all() and torch.isnan(g_s[:2]).all() and \
            torch.isnan(g_t[:2]).all()
        assert loss[5] == 0 and (g_s[5] == 0).all() and (g_t[5] == 0).all()
        assert torch.isfinite(loss[6:]).all()
        _check_against_rows(loss, g_s, g_t, z_s, z_t, target, valid, cfg)


@pytest.mark.parametrize("divergence,beta", DIVERGENCES)
def test_gradients_only_where_wanted(divergence, beta, device):
    """grad_s / grad_t False: that buffer is left exactly as it was, and the rest is the same."""
    z_s, z_t, target, valid = _logits(9, 45, torch.float32, seed=4)
    cfg = (divergence, beta, 1.3, 0.5, 1.0)
    full = _op(z_s, z_t, target, valid, cfg, device=device)
    for grad_s, grad_t in ((True, False), (False, True), (False, False)):
        loss, g_s, g_t = _op(z_s, z_t, target, valid, cfg, grad_s, grad_t, device)
        assert torch.equal(loss, full[0])
        assert torch.equal(g_s, full[1] if grad_s else z_s)
        assert torch.equal(g_t, full[2] if grad_t else z_t)


def test_threads_give_the_same_bits():
    """Rows are independent: one thread and several give the same bits."""
    z_s, z_t, target, valid = _logits(64, 300, torch.float32, seed=5)
    cfg = ("jsd", 0.3, 1.7, 0.2, 1.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op(z_s, z_t, target, valid, cfg)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, _op(z_s, z_t, target, valid, cfg)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(z_t=a["z_t"][:, :5].contiguous()), "one shape"),
    (lambda a: a.update(z_s=a["z_s"].half(), z_t=a["z_t"].half()), "float32 or float64"),
    (lambda a: a.update(z_s=a["z_s"].T.contiguous().T), "contiguous"),
    (lambda a: a.update(loss=a["loss"][:3]), "loss must be"),
    (lambda a: a.update(target=a["target"].int()), "target must be"),
    (lambda a: a.update(valid=a["valid"].int()), "valid must be"),
    (lambda a: a.update(divergence="kl"), "divergence must be"),
    (lambda a: a.update(beta=0.0), "beta in"),
    (lambda a: a.update(target=a["target"] + 100), "outside"),
])
def test_bad_arguments(change, match, device):
    z_s, z_t, target, valid = _logits(6, 10, torch.float32, seed=6)
    args = dict(z_s=z_s, z_t=z_t, loss=torch.empty(6), target=target, valid=valid,
                divergence="jsd", beta=0.5)
    change(args)
    args = {k: x.to(device) if isinstance(x, torch.Tensor) else x for k, x in args.items()}

    def call():
        _ops.ops.distill_rows_(args["z_s"], args["z_t"], args["loss"], args["target"],
                               args["valid"], args["divergence"], args["beta"], 1.0, 0.5, 1.0,
                               True, True)

    if match == "outside" and (_ops.ops is not torch.ops.flce or device == "cuda"):
        # the CUDA backend checks targets without a host sync (the row's loss is NaN meanwhile)
        raises_within_two_calls(call, "out of range")
        return
    with pytest.raises(RuntimeError, match=match):
        call()
