"""``python -m flce.check``: is flce right, and how fast, on this machine's device?

Run it after installing or building flce (a wheel for your GPU: docs/build.md). Two parts:

1. **Correctness**, on small shapes against the float64 oracle (``flce.reference``, the
   collapse-safe formula): every path the device takes (training's default, the single pass
   and the recompute path, forward only without gradients, per-token outputs, every option,
   probability targets, ``flce.cross_entropy`` on given logits and its in-place backward,
   vocab-parallel with one rank, the backend's opt-in paths, distillation) and the collapse at
   target margins 0-100 (of distillation too). Tolerances are relative to the floor, the error
   of rounding the float64 answer to the output's dtype (the test suite's, tests/helpers.py).
   Each path prints one line; a wrong one prints ``FAIL <path>: <what>`` and makes the exit
   status 1.
2. **Speed and memory** at a shape that fits the device (on a GPU the anchor
   [N=4096 x D=4096 x V=128256] bf16 where memory allows): flce's default training step
   against the floor (the step's 3 GEMMs alone), eager PyTorch and the peers that are
   installed (Liger-Kernel, Cut Cross Entropy; on CUDA), the forward without gradients against
   its one logits GEMM, and ``flce.cross_entropy`` against the time its bytes take at the
   measured copy rate. A table with the ratios to the floor; with ``--out PATH`` one JSON record
   per configuration (benchmarks/results' format, flce.build_info() included) appended the
   moment it is measured.

``--quick``: fewer margins and repeats, no second shape (sized for about a minute on an H100,
a few on a 2-core CPU). No network; nothing is written but ``--out`` and ``--partial``.
"""
import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

import flce
from flce import _ops, reference

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
GIB = 2.0 ** 30

# Tolerances in units of eps(dtype), the test suite's too (tests/helpers.py's check_flce
# imports them): element-wise relative to max(|ref|, rms(ref)) (garbage anywhere), norm-wise
# ||x - ref|| / ||ref|| (precision).
LOSS_FACTOR = 32.0  # the loss, lse and entropy are fp32 whatever the input dtype
GRAD_FACTOR = {F32: 1024.0, BF16: 1.0, F16: 1.0}
GRAD_NORM_FACTOR = {F32: 64.0, BF16: 0.35, F16: 0.35}
# Collapse (tests/api/test_accuracy.py): the loss within 3x the error of exact math on fp32
# logits (plus 1e-7), one fp32 subnormal spacing allowed per row; the target gradient relatively
# within 1e-5 while it is a normal fp32 number (margins <= 80).
FP32_SUBNORMAL = 2.0 ** -149
# The CUDA backend's fused target distributions (FLCE_CUDA_OPT_IN=distributions) with 16-bit
# gradients: docs/api.md's "within 1.5x bf16's rounding floor", measured up to 1.50x on the host
# emulation of its kernels (16 cases at two shapes), every element within 2 eps.
SOFT_TILE_FLOORS, SOFT_TILE_FACTOR = 1.6, 2.0


class Wrong(AssertionError):
    """A result outside its tolerance."""


# ---- the floor and the comparisons -----------------------------------------------------------

def rel_err(x, ref):
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    n = ref.norm()
    return ((x - ref).norm() / n).item() if n > 0 else (x - ref).norm().item()


def floor(ref, dtype):
    """The error of rounding the float64 answer to ``dtype``: what no implementation beats."""
    return rel_err(ref.to(dtype), ref)


def close(what, got, ref, dtype, factor):
    """Every element within ``factor`` eps(dtype) of max(|ref|, rms(ref))."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    if got.shape != ref.shape:
        raise Wrong(f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise Wrong(f"{what}: {int((~torch.isfinite(got)).sum())} non-finite elements")
    if ref.numel() == 0:
        return
    scale = torch.maximum(ref.abs(), ref.pow(2).mean().sqrt()) * torch.finfo(dtype).eps
    ratio = ((got - ref).abs() / scale).max().item()
    if ratio > factor:
        raise Wrong(f"{what}: an element {ratio:.3g} eps off (tolerance {factor:g} eps)")


def grad_ok(what, got, ref, tile=None, tile_dtype=None, soft_tile=False):
    """A gradient at its dtype's floor (close element-wise, and norm-wise within
    GRAD_NORM_FACTOR), or as good as the backend's 16-bit gradient tile allows (the CUDA
    backend's 16-bit GEMMs; the CPU backend's rounded bf16 mode): with ``tile`` (the ideal of a
    tile rounded once to ``tile_dtype``) element-wise at it and norm-wise within 1.1x its error;
    with ``soft_tile`` (the CUDA backend's fused target distributions) element-wise within
    SOFT_TILE_FACTOR eps and norm-wise within SOFT_TILE_FLOORS times the floor."""
    dt = got.dtype
    try:
        close(what, got, ref, dt, GRAD_FACTOR[dt])
        err = rel_err(got, ref) / torch.finfo(dt).eps
        if err > GRAD_NORM_FACTOR[dt]:
            raise Wrong(f"{what}: norm-wise {err:.3g} eps (tolerance {GRAD_NORM_FACTOR[dt]} eps,"
                        f" the floor is {floor(ref, dt) / torch.finfo(dt).eps:.3g})")
    except Wrong:
        if tile is not None:
            close(f"{what} (16-bit tile ideal)", got, tile, tile_dtype, GRAD_FACTOR[tile_dtype])
            ideal, err = rel_err(tile.to(dt), ref), rel_err(got, ref)
            if err > 1.1 * ideal + 1e-6:
                raise Wrong(f"{what}: norm-wise {err:.3g}, 1.1x the 16-bit tile ideal's is "
                            f"{1.1 * ideal:.3g}") from None
        elif soft_tile:
            close(what, got, ref, dt, SOFT_TILE_FACTOR)
            ratio = rel_err(got, ref) / floor(ref, dt)
            if ratio > SOFT_TILE_FLOORS:
                raise Wrong(f"{what}: norm-wise {ratio:.3g}x the floor (tolerance "
                            f"{SOFT_TILE_FLOORS}x)") from None
        else:
            raise


def tile_ideal(dz, t, x_dtype, fix_target):
    """The gradient of the logits as a 16-bit gradient tile holds it (float64): rounded once to
    the input's dtype (fp16 scaled by a power of two that puts max |dz| in (2^13, 2^14]), each
    row's target entry kept in fp32 where the backend corrects it (class targets)."""
    mx = dz.abs().max().item()
    s = 2.0 ** (14 - math.ceil(math.log2(mx))) if x_dtype == F16 and mx > 0 else 1.0
    hi = (dz * s).to(x_dtype).double() / s
    if fix_target:
        rows = torch.nonzero((t >= 0) & (t < dz.shape[1]))[:, 0]
        hi[rows, t[rows]] = dz[rows, t[rows]]
    return hi


# ---- inputs ------------------------------------------------------------------------------------

def gen(seed):
    return torch.Generator().manual_seed(seed)


def inputs(n, v, d, dtype, seed, *, w_dtype=None, ignore=0.15, soft=False):
    """Fresh random (x, w, target, bias) on the CPU; logits of std ~2. Targets uniform, a
    fraction ``ignore`` of them -100; ``soft``: probability rows instead (a random
    distribution with most mass on one class)."""
    g = gen(seed)
    x = (torch.randn(n, d, generator=g, dtype=F64) * 2 ** 0.5 / d ** 0.25).to(dtype)
    w = (torch.randn(v, d, generator=g, dtype=F64) * 2 ** 0.5 / d ** 0.25).to(w_dtype or dtype)
    b = (torch.randn(v, generator=g, dtype=F64) * 0.5).to(w_dtype or dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if soft:
        q = torch.rand(n, v, generator=g, dtype=F64) ** 4
        q[torch.arange(n), t] += q.sum(1)
        return x, w, (q / q.sum(1, keepdim=True)).float(), b
    t[torch.rand(n, generator=g) < ignore] = -100
    return x, w, t, b


def margin_inputs(n, v, d, margin, dtype, seed):
    """Rows whose float64 target margin z_t - max_{j != t} z_j is ``margin`` (tests/helpers.py's
    construction): one target column for every row, its bias carrying the margin and its
    classifier row solved (least norm) to absorb the rows' spread. Returns x (dtype), w (fp32
    holding dtype's values: master weights), t, b (fp32)."""
    g = gen(seed)
    s = 2 ** 0.5 / d ** 0.25
    e = (torch.randn(n, d, generator=g, dtype=F64) * s).to(dtype).double()
    c = (torch.randn(v, d, generator=g, dtype=F64) * s).to(dtype).double()
    b = (torch.randn(v, generator=g, dtype=F64) * 0.5).float().double()
    col = int(torch.randint(0, v, (1,), generator=g))
    others = torch.arange(v) != col
    mx = (e @ c[others].T + b[others]).max(1).values
    b[col] = float(torch.tensor(margin + mx.mean().item()).float())
    c[col] = (torch.linalg.pinv(e) @ (mx + margin - b[col])).to(dtype).double()
    return e.to(dtype), c.float(), torch.full((n,), col), b.float()


# ---- one call of flce against float64 ---------------------------------------------------------

LOGIT_OPTS = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "temperature")


def run_linear(dev, x, w, t, b=None, *, fn=None, grad=True, **opts):
    """flce.linear_cross_entropy (or ``fn`` with its signature) on ``dev`` against float64:
    the loss and the per-token outputs asked for, and with ``grad`` the gradients of input,
    weight and bias under random upstream gradients."""
    fn = fn or flce.linear_cross_entropy
    leaves = [a.detach().to(dev).requires_grad_(grad) if a is not None else None
              for a in (x, w, b)]
    out = fn(leaves[0], leaves[1], t.to(dev), bias=leaves[2], **opts)
    per = [k for k in ("return_lse", "return_entropy", "return_accuracy") if opts.get(k)]
    out = list(out) if per else [out]
    # float64: the weight (and bias) in the input's dtype first, as flce computes with them
    x64 = x.double()
    w64 = w.to(x.dtype).double()
    b64 = None if b is None else b.double()
    u = (x64 @ w64.T + (0 if b64 is None else b64)).requires_grad_()
    soft = t.is_floating_point()
    tt = t
    if opts.get("shift"):
        tt = torch.cat([t[1:], torch.full((1,), opts.get("ignore_index", -100))])
    kw = {k: opts[k] for k in LOGIT_OPTS if k in opts}
    cw = opts.get("class_weight")
    cw = None if cw is None else cw.double()
    red = kw.get("reduction", "mean")
    if soft:
        kw.pop("ignore_index", None)
        r = reference.soft_cross_entropy(u, tt.double(), weight=cw, **{**kw, "reduction": "none"})
        rloss, rlse, rent = r
        rloss = rloss if red == "none" else (rloss.sum() if red == "sum" else rloss.mean())
    else:
        rloss, rlse, rent = reference.logits_cross_entropy(
            u, tt, return_lse=True, return_entropy=True, weight=cw, **kw)
    refs = {"loss": rloss, "lse": rlse, "entropy": rent}
    names = ["loss"] + [k[len("return_"):] for k in per]
    g = gen(7)
    total_got, total_ref = 0.0, 0.0
    for name, got in zip(names, out):
        if name == "accuracy":
            check_accuracy(got, u.detach(), tt, kw.get("ignore_index", -100), red)
            continue
        if got.dtype != F32:
            raise Wrong(f"{name}: dtype {got.dtype}, expected float32")
        close(name, got, refs[name], F32, LOSS_FACTOR)
        # upstream: 2 for a reduced loss (a power of two: the single pass's scaling is exact),
        # fresh random values per token
        up = torch.full((), 2.0, dtype=F64) if got.dim() == 0 else \
            torch.rand(got.shape, generator=g, dtype=F64) + (0.5 if name == "loss" else -0.5)
        total_got = total_got + (got * up.float().to(dev)).sum()
        total_ref = total_ref + (refs[name] * up).sum()
    if not grad:
        return
    total_got.backward()
    total_ref.backward()
    dz = u.grad
    ref = {"input": dz @ w64, "weight": dz.T @ x64, "bias": dz.sum(0)}
    # 16-bit gradients from a gradient tile rounded once (tests/helpers.py rounds_grad_tile):
    # the CUDA backend's, and the CPU backend's bf16 in its rounded mode; the rest at the floor
    cuda = _ops.is_cuda_backend(leaves[0])
    rounded = x.dtype != F32 and (cuda or x.dtype == BF16 and torch.ops.flce.cpu_bf16_grad(
        opts.get("exact_bf16_grad")) == "rounded")
    tile = None
    if rounded and not soft:
        hi = tile_ideal(dz, tt, x.dtype, True)
        tile = {"input": hi @ w64, "weight": hi.T @ x64, "bias": hi.sum(0)}
    for name, leaf in zip(("input", "weight", "bias"), leaves):
        if leaf is None:
            continue
        if leaf.grad is None or leaf.grad.dtype != leaf.dtype:
            raise Wrong(f"grad {name}: {None if leaf.grad is None else leaf.grad.dtype}, "
                        f"expected {leaf.dtype}")
        # fp32 master weights' dW is held to fp32's floor (the tile reaches it as hi + lo)
        use_tile = tile is not None and leaf.dtype != F32
        grad_ok(f"grad {name}", leaf.grad, ref[name], tile[name] if use_tile else None, x.dtype,
                soft_tile=soft and cuda and leaf.dtype != F32)


def check_accuracy(got, u, t, ignore_index, reduction):
    """The accuracy output against the float64 logits' argmax (rows whose two largest logits are
    within 1e-4 may go either way)."""
    valid = t != ignore_index
    safe = torch.where(valid, t, 0)
    top2 = u.topk(2, dim=1).values
    hit = (u.argmax(1) == safe) & valid
    tie = (top2[:, 0] - top2[:, 1]) < 1e-4
    if reduction == "none":
        bad = ((got.cpu().double() != hit.double()) & ~tie).sum().item()
        if bad:
            raise Wrong(f"accuracy: {bad} tokens wrong")
        return
    count = hit.double().sum()
    want = count / valid.sum() if reduction == "mean" else count
    slack = tie.sum().item() / (valid.sum().item() if reduction == "mean" else 1)
    if abs(got.item() - want.item()) > slack + 1e-6:
        raise Wrong(f"accuracy: {got.item():.6g}, expected {want.item():.6g}")


def run_logits(dev, z, t, *, inplace=False, **opts):
    """flce.cross_entropy on given logits ``z`` against float64: the loss and per-token outputs,
    the gradient of the logits at its dtype's floor."""
    leaf = z.detach().to(dev).requires_grad_()
    zin = leaf * 1 if inplace else leaf  # in place: the logits must not be a leaf
    per = [k for k in ("return_lse", "return_entropy") if opts.get(k)]
    out = flce.cross_entropy(zin, t.to(dev), inplace_backward=inplace, **opts)
    out = list(out) if per else [out]
    u = z.double().requires_grad_()
    kw = {k: opts[k] for k in LOGIT_OPTS if k in opts}
    w = opts.get("weight")
    w = None if w is None else w.double()
    if t.is_floating_point():
        kw.pop("ignore_index", None)
        red = kw.pop("reduction", "mean")
        rloss, rlse, rent = reference.soft_cross_entropy(u, t.double(), weight=w,
                                                         reduction="none", **kw)
        rloss = rloss if red == "none" else (rloss.sum() if red == "sum" else rloss.mean())
    else:
        rloss, rlse, rent = reference.logits_cross_entropy(u, t, return_lse=True,
                                                           return_entropy=True, weight=w, **kw)
    refs = {"loss": rloss, "lse": rlse, "entropy": rent}
    g = gen(8)
    tot, rtot = 0.0, 0.0
    for name, got in zip(["loss"] + [k[len("return_"):] for k in per], out):
        close(name, got, refs[name], F32, LOSS_FACTOR)
        up = torch.full((), 2.0, dtype=F64) if got.dim() == 0 else \
            torch.rand(got.shape, generator=g, dtype=F64) - 0.5
        tot = tot + (got * up.float().to(dev)).sum()
        rtot = rtot + (refs[name] * up).sum()
    tot.backward()
    rtot.backward()
    grad_ok("grad logits", leaf.grad, u.grad)


def run_collapse(dev, dtype, margins, n, v, d, training):
    """Every row at target margin m: the loss relatively accurate (no collapse to 0) and the
    target's gradient too. ``training``: the single pass (reduction="sum"), else
    reduction="none" (the forward and recompute path)."""
    for m in margins:
        x, w, t, b = margin_inputs(n, v, d, m, dtype, seed=100 + m)
        xl, bl = x.detach().to(dev).requires_grad_(), b.detach().to(dev).requires_grad_()
        loss = flce.linear_cross_entropy(xl, w.to(dev), t.to(dev), bias=bl,
                                         reduction="sum" if training else "none",
                                         single_pass=True if training else None)
        (loss if training else loss.sum()).backward()
        x64, w64 = x.double(), w.to(dtype).double()
        u = (x64 @ w64.T + b.double()).requires_grad_()
        ref = reference.logits_cross_entropy(u, t, reduction="none")
        ref.sum().backward()
        # the best an fp32-logit implementation can do: exact math on fp32 logits
        z32 = (x.float() @ w.to(dtype).float().T + b).double()
        ideal = ((reference.logits_cross_entropy(z32, t, reduction="none") - ref).abs()
                 / ref).max().item()
        got = loss.detach().cpu().double()
        want = ref.detach().sum() if training else ref.detach()
        rows = n if training else 1
        err = ((got - want).abs() - rows * FP32_SUBNORMAL).clamp(min=0) / want
        tol = 1e-7 + 3 * ideal + (n * 2.0 ** -24 if training else 0.0)  # (+ the sum's rounding)
        if err.max().item() > tol:
            raise Wrong(f"margin {m}: loss relative error {err.max().item():.3g} > {tol:.3g}")
        if ((got <= 0) & (want >= FP32_SUBNORMAL)).any():
            raise Wrong(f"margin {m}: the loss collapsed to 0")
        if m > 80:  # beyond, e^-m gradients are fp32 subnormals
            continue
        col = int(t[0])
        gt = bl.grad[col].item()
        want_gt = u.grad[:, col].sum().item()
        if abs(gt - want_gt) > 1e-5 * abs(want_gt):
            raise Wrong(f"margin {m}: target gradient {gt:.6g}, float64 {want_gt:.6g}")
        dz = u.grad
        ref_gx = dz @ w64
        gx = xl.grad.cpu().double()
        row = (gx - ref_gx).norm(dim=1) / ref_gx.norm(dim=1)
        fl = (ref_gx.to(dtype).double() - ref_gx).norm(dim=1) / ref_gx.norm(dim=1)
        ok = row <= 1e-5 + 1.1 * fl
        if not ok.all() and dtype != F32 and (_ops.is_cuda_backend(xl) or dtype == BF16 and
                                              torch.ops.flce.cpu_bf16_grad(None) == "rounded"):
            ideal_gx = (tile_ideal(dz, t, dtype, True) @ w64).to(dtype).double()
            ok = row <= 1e-5 + 1.1 * (ideal_gx - ref_gx).norm(dim=1) / ref_gx.norm(dim=1)
        if not ok.all():
            raise Wrong(f"margin {m}: input gradient rows {row.max().item():.3g} off "
                        f"(floor {fl.max().item():.3g})")


def distill_inputs(n, v, d, dtype, seed):
    """Fresh random student (x, w, b) and teacher (x, w, b), the teacher of hidden size d + 16
    (fp32 master weights and biases for 16-bit inputs), and targets with a fraction ignored."""
    g = gen(seed)
    wdt = F32 if dtype in (BF16, F16) else dtype

    def r(shape, dt, scale):
        return (torch.randn(shape, generator=g, dtype=F64) * scale).to(dt)

    out = []
    for width in (d, d + 16):
        s = 2 ** 0.5 / width ** 0.25
        out += [r((n, width), dtype, s), r((v, width), wdt, s), r((v,), wdt, 0.3)]
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.15] = -100
    return (*out, t)


def run_distill(dev, xs, ws, bs, xt, wt, bt, t, *, teacher_grad=False, **opts):
    """flce.linear_distillation on ``dev`` against float64 flce.reference.distillation: the
    loss (under random upstream gradients per token for reduction="none") and the gradients
    of the student's tensors, and of the teacher's with ``teacher_grad``."""
    tensors = (xs, ws, bs, xt, wt, bt)
    grad = [True] * 3 + [teacher_grad] * 3
    leaves = [a.detach().to(dev).requires_grad_(g) for a, g in zip(tensors, grad)]
    loss = flce.linear_distillation(leaves[0], leaves[1], leaves[3], leaves[4], t.to(dev),
                                    student_bias=leaves[2], teacher_bias=leaves[5], **opts)
    # float64: the weights' values in their input's dtype, the biases' in their own
    wide = [a.to(xs.dtype if i in (1, 4) else a.dtype).double().requires_grad_()
            for i, a in enumerate(tensors)]
    zs = wide[0] @ wide[1].T + wide[2]
    zt = wide[3] @ wide[4].T + wide[5]
    ref = reference.distillation(zs, zt, t, **opts)
    if loss.dtype != F32:
        raise Wrong(f"loss: dtype {loss.dtype}, expected float32")
    close("loss", loss, ref, F32, LOSS_FACTOR)
    up = torch.rand(ref.shape, generator=gen(7), dtype=F64) + 0.5
    (loss * up.float().to(dev)).sum().backward()
    (ref * up).sum().backward()
    names = ("student input", "student weight", "student bias", "teacher input",
             "teacher weight", "teacher bias")
    for name, leaf, w, g in zip(names, leaves, wide, grad):
        if not g:
            if leaf.grad is not None:
                raise Wrong(f"grad {name}: computed, though it does not require grad")
            continue
        if leaf.grad is None or leaf.grad.dtype != leaf.dtype:
            raise Wrong(f"grad {name}: {None if leaf.grad is None else leaf.grad.dtype}, "
                        f"expected {leaf.dtype}")
        grad_ok(f"grad {name}", leaf.grad, w.grad)


def distill_collapsed(n, v, margin, same, seed):
    """Logits [n, v] (fp32) where the teacher's class a leads its other logits by ``margin``
    and the student's class (a where ``same``, else another one) by ``margin`` times 1 to 1.1:
    (student's logits, teacher's logits, a, the student's class)."""
    g = gen(seed)
    zs, zt = torch.randn(n, v, generator=g), torch.randn(n, v, generator=g)
    a = torch.randint(0, v, (n,), generator=g)
    b = a if same else (a + 1 + torch.randint(0, v - 1, (n,), generator=g)) % v
    rows = torch.arange(n)
    zt[rows, a] += margin
    zs[rows, b] += margin * (1 + 0.1 * torch.rand(n, generator=g))
    return zs, zt, a, b


def run_distill_collapse(dev, margins, n, v, same, **opts):
    """Both models confident (the teacher's class leads by margin m, the student's, the same
    class or another, by m to 1.1 m), the hidden states the logits (an identity classifier,
    exact in fp32): the fp32 loss within 1e-5 of float64 wherever it is a normal fp32 number,
    the student's gradient within a few roundings of its logits' scale (an fp32 logit z
    carries |z| 2^-24: the floor of any fp32-logit implementation)."""
    eye = torch.eye(v)
    for m in margins:
        zs, zt, _, _ = distill_collapsed(n, v, m, same, 200 + m)
        xs = zs.clone().to(dev).requires_grad_()
        loss = flce.linear_distillation(xs, eye.to(dev), zt.to(dev), eye.to(dev),
                                        reduction="none", **opts)
        loss.sum().backward()
        s64 = zs.double().requires_grad_()
        ref = reference.distillation(s64, zt.double(), reduction="none", **opts)
        ref.sum().backward()
        got = loss.detach().cpu().double()
        tiny = torch.finfo(F32).tiny
        normal = ref.abs() > tiny
        err = ((got - ref).abs() / ref.abs())[normal]
        if err.numel() and err.max().item() > 1e-5:
            raise Wrong(f"margin {m}: loss relative error {err.max().item():.3g} > 1e-5")
        if ((got - ref).abs()[~normal] > tiny).any():
            raise Wrong(f"margin {m}: a loss below fp32's normal range off by more than its "
                        f"smallest normal")
        want = s64.grad
        scale = want.abs().amax(1, keepdim=True)
        live = (scale > tiny / torch.finfo(F32).eps)[:, 0]
        bound = 4 * torch.finfo(F32).eps * (1 + zs.double().abs().amax(1, keepdim=True)) * scale
        bad = ((xs.grad.cpu().double() - want).abs() > bound)[live]
        if bad.any():
            raise Wrong(f"margin {m}: {int(bad.sum())} student gradient entries beyond a few "
                        f"roundings of the logits' scale")


# ---- the paths ---------------------------------------------------------------------------------

@contextlib.contextmanager
def env(**values):
    """Environment variables flce reads at every call, set for one path."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def one_rank_group(dev):
    """A process group of one rank in this process (gloo, nccl on CUDA), over a FileStore: no
    network. Yields None when torch.distributed is missing or already initialized."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        backends = ["nccl", "gloo"] if dev == "cuda" and dist.is_nccl_available() else ["gloo"]
        for k, backend in enumerate(backends):
            try:
                store = dist.FileStore(os.path.join(tmp, f"store{k}"), 1)
                dist.init_process_group(backend, store=store, rank=0, world_size=1)
                break
            except Exception:  # noqa: BLE001  (NCCL that cannot start here: gloo's group)
                if backend == backends[-1]:
                    raise
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def paths(dev, size):
    """[(name, thunk)]: every path the device takes, each a call against float64."""
    n, v, d = size
    # (flce's own test of the backend that serves the device)
    cuda = _ops.is_cuda_backend(torch.empty(0, device=dev))
    out = []

    def add(name, fn, *a, **kw):
        out.append((name, lambda: fn(dev, *a, **kw)))

    def lin(dtype, seed, **kw):
        return inputs(n, v, d, dtype, seed, w_dtype=kw.pop("w_dtype", None),
                      soft=kw.pop("soft", False))

    # Training: the default path, the single pass, the recompute path.
    for dtype, dn in ((F32, "fp32"), (BF16, "bf16")):
        add(f"train default {dn}", run_linear, *lin(dtype, 1))
        add(f"train single_pass=True {dn}", run_linear, *lin(dtype, 2), single_pass=True)
        add(f"train recompute (single_pass=False) {dn}", run_linear, *lin(dtype, 3),
            single_pass=False)
    add("train recompute fp16", run_linear, *lin(F16, 4))
    add("train bf16 input, fp32 master weights", run_linear, *lin(BF16, 5, w_dtype=F32))
    add("train bf16 master weights, single_pass=False", run_linear, *lin(BF16, 6, w_dtype=F32),
        single_pass=False)
    if not cuda:
        for exact in (True, False):
            add(f"train bf16 exact_bf16_grad={exact}", run_linear, *lin(BF16, 7), single_pass=False,
                exact_bf16_grad=exact)
    # Forward only (no gradients: rollout scoring) and the per-token outputs.
    for dtype, dn in ((F32, "fp32"), (BF16, "bf16")):
        add(f"forward only (no grad) {dn}", run_linear, *lin(dtype, 10), grad=False,
            reduction="none", temperature=0.7)
    add("per-token lse, entropy, accuracy", run_linear, *lin(F32, 11), reduction="none",
        return_lse=True, return_entropy=True, return_accuracy=True)
    add("accuracy, mean", run_linear, *lin(F32, 12), return_accuracy=True)
    # The options, each on both training paths (the single pass is the default at training
    # sizes; small shapes stay within what the CPU's default gives the recompute path).
    cw = torch.rand(v, generator=gen(13), dtype=F32) + 0.5
    options = {"label_smoothing": dict(label_smoothing=0.1), "z_loss": dict(z_loss=1e-3),
               "softcap": dict(softcap=5.0), "temperature": dict(temperature=0.7),
               "reduction=sum": dict(reduction="sum"), "shift": dict(shift=True),
               "ignore_index=7": dict(ignore_index=7), "class_weight": dict(class_weight=cw),
               "class_weight + label_smoothing": dict(class_weight=cw, label_smoothing=0.1),
               "no bias": None}
    for k, (name, o) in enumerate(options.items()):
        for sp in (True, False):
            x, w, t, b = lin(F32, 20 + k)
            if name == "ignore_index=7":
                t = torch.where(t == -100, 7, t)
            add(f"option {name}, single_pass={sp}", run_linear, x, w, t, None if o is None else b,
                single_pass=sp, **(o or {}))
    add("options all together bf16", run_linear, *lin(BF16, 40), label_smoothing=0.1, z_loss=1e-3,
        softcap=8.0, temperature=0.9)
    # Probability targets.
    soft_env = [({}, "")] + ([({"FLCE_CUDA_OPT_IN": "distributions"},
                               " (FLCE_CUDA_OPT_IN=distributions)")] if cuda else [])
    for e, tag in soft_env:
        for dtype, dn in ((F32, "fp32"), (BF16, "bf16")):
            add(f"probability targets {dn}{tag}", _in_env, e, run_linear,
                *lin(dtype, 41, soft=True))
            add(f"probability targets, recompute {dn}{tag}", _in_env, e, run_linear,
                *lin(dtype, 42, soft=True), single_pass=False, label_smoothing=0.1)
        add(f"probability targets, per token{tag}", _in_env, e, run_linear,
            *lin(F32, 43, soft=True), reduction="none", return_lse=True, return_entropy=True)
    # Cross-entropy on given logits.
    for dtype, dn in ((F32, "fp32"), (BF16, "bf16"), (F16, "fp16")):
        z, t = logits_inputs(2 * n, v, dtype, 50)
        add(f"cross_entropy {dn}", run_logits, z, t)
        add(f"cross_entropy in place (inplace_backward) {dn}", run_logits, z, t, inplace=True)
    z, t = logits_inputs(2 * n, v, F32, 51)
    add("cross_entropy options", run_logits, z, t, label_smoothing=0.1, z_loss=1e-3, softcap=6.0,
        temperature=0.8, reduction="none", return_lse=True, return_entropy=True)
    add("cross_entropy class weights", run_logits, z, t, weight=cw)
    zs, _ = logits_inputs(2 * n, v, F32, 52)
    q = inputs(2 * n, v, 1, F32, 53, soft=True)[2]
    add("cross_entropy probability targets", run_logits, zs, q, label_smoothing=0.05)
    # Vocab-parallel over a group of one rank.
    add("vocab-parallel (1 rank) train, single pass", run_parallel, *lin(F32, 60), single_pass=True)
    add("vocab-parallel (1 rank) bf16 recompute, per token", run_parallel, *lin(BF16, 61),
        reduction="none", return_lse=True, single_pass=False)
    add("vocab-parallel (1 rank) cross_entropy", run_parallel_logits, *logits_inputs(n, v, F32, 62))
    add("vocab-parallel (1 rank) DTensor weight", run_dtensor, *lin(F32, 63))
    # Distillation (flce.linear_distillation): each divergence, 16-bit inputs, teacher gradients;
    # on the CUDA backend its torch row math and its fused op (FLCE_CUDA_OPT_IN=distill).
    for e, tag in distill_env(cuda):
        add(f"distillation jsd fp32, teacher gradients{tag}", _in_env, e, run_distill,
            *distill_inputs(n, v, d, F32, 80), teacher_grad=True, beta=0.3)
        add(f"distillation forward_kl bf16, temperature, hard loss{tag}", _in_env, e,
            run_distill, *distill_inputs(n, v, d, BF16, 81), divergence="forward_kl",
            temperature=2.0, hard_weight=0.5, soft_weight=0.5)
        add(f"distillation reverse_kl fp32, per token{tag}", _in_env, e, run_distill,
            *distill_inputs(n, v, d, F32, 82), divergence="reverse_kl", reduction="none")
    # The CUDA backend's opt-ins and its row chunks (a workspace small enough for several).
    if cuda:
        add("train fp32, FLCE_CUDA_OPT_IN=fp64_grad", _in_env, {"FLCE_CUDA_OPT_IN": "fp64_grad"},
            run_linear, *lin(F32, 70))
        big = inputs(8 * n, v, d, BF16, 72)
        small_ws = {"FLCE_CUDA_WORKSPACE_MB": f"{max(v * 4 * 32 / 2 ** 20, 0.01):.4f}"}
        for name, kw in (("train", {}), ("recompute", dict(single_pass=False)),
                         ("forward only", dict(grad=False, reduction="none"))):
            add(f"{name} bf16, row chunks (small FLCE_CUDA_WORKSPACE_MB)", _in_env, small_ws,
                run_linear, *big, **kw)
    return out


def distill_env(cuda):
    """[(environment, name tag)] of the distillation paths: the default, and on the CUDA
    backend its fused row math, opt-in until a GPU has run it (docs/cuda.md "Distillation")."""
    return [({}, "")] + ([({"FLCE_CUDA_OPT_IN": "distill"}, " (FLCE_CUDA_OPT_IN=distill)")]
                         if cuda else [])


def _in_env(dev, values, fn, *a, **kw):
    with env(**values):
        return fn(dev, *a, **kw)


def logits_inputs(n, v, dtype, seed):
    g = gen(seed)
    z = (torch.randn(n, v, generator=g, dtype=F64) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.15] = -100
    return z, t


def run_parallel(dev, x, w, t, b, **opts):
    from flce import parallel

    with one_rank_group(dev) as group:
        if group is None:
            raise RuntimeError("torch.distributed is unavailable or already initialized")

        def fn(x, w, t, bias=None, **kw):
            return parallel.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                                bias_local=bias, **kw)
        run_linear(dev, x, w, t, b, fn=fn, **opts)


def run_parallel_logits(dev, z, t):
    from flce import parallel

    with one_rank_group(dev) as group:
        if group is None:
            raise RuntimeError("torch.distributed is unavailable or already initialized")
        leaf = z.detach().to(dev).requires_grad_()
        loss = parallel.cross_entropy(leaf, t.to(dev), group=group, label_smoothing=0.1)
        (2 * loss).backward()
        u = z.double().requires_grad_()
        ref = reference.logits_cross_entropy(u, t, label_smoothing=0.1)
        (2 * ref).backward()
        close("loss", loss, ref, F32, LOSS_FACTOR)
        grad_ok("grad logits", leaf.grad, u.grad)


def run_dtensor(dev, x, w, t, b):
    """flce.linear_cross_entropy with a DTensor classifier Shard(0) over a mesh of one rank
    (TorchTitan's models): the vocab-parallel dispatch."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    with one_rank_group(dev) as group:
        if group is None:
            raise RuntimeError("torch.distributed is unavailable or already initialized")
        mesh = init_device_mesh(dev, (1,))
        xl = x.detach().to(dev).requires_grad_()
        wd = distribute_tensor(w.detach().to(dev), mesh, [Shard(0)]).requires_grad_()
        loss = flce.linear_cross_entropy(xl, wd, t.to(dev), label_smoothing=0.1)
        (2 * loss).backward()
        x64, w64 = x.double(), w.double()
        u = (x64 @ w64.T).requires_grad_()
        ref = reference.logits_cross_entropy(u, t, label_smoothing=0.1)
        (2 * ref).backward()
        close("loss", loss, ref, F32, LOSS_FACTOR)
        grad_ok("grad input", xl.grad, u.grad @ w64)
        grad_ok("grad weight", wd.grad.full_tensor(), u.grad.T @ x64)


def correctness(dev, quick, tiny):
    """Run every path; returns the names of the wrong ones."""
    size = (24, 259, 32) if tiny else (64, 1031, 80)
    cases = paths(dev, size)
    margins = [0, 10, 20, 50, 80, 100] if quick or tiny else list(range(0, 101, 5))
    mv = 1031 if tiny else 8209
    for dtype, dn in ((F32, "fp32"), (BF16, "bf16")):
        for training in (False, True):
            name = f"collapse margins 0-100 {dn}, " + ("single pass" if training else "forward")
            cases.append((name, (lambda dt, tr: lambda: run_collapse(
                dev, dt, margins, 16, mv, 64, tr))(dtype, training)))
    for e, tag in distill_env(_ops.is_cuda_backend(torch.empty(0, device=dev))):
        for same in (True, False):
            name = "distillation collapse margins 0-100 fp32, jsd, " + \
                ("one class" if same else "different classes") + tag
            cases.append((name, (lambda sm, e: lambda: _in_env(
                dev, e, run_distill_collapse, margins, 16, 64, sm, beta=0.1))(same, e)))
    failed = []
    print(f"correctness: {len(cases)} paths against float64 ({dev})", flush=True)
    for name, fn in cases:
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a crash on a path is a wrong path too)
            failed.append(name)
            what = str(e) if isinstance(e, Wrong) else \
                f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            print(f"FAIL  {name}: {what}", flush=True)
            continue
        print(f"ok    {name}  ({time.perf_counter() - start:.1f} s)", flush=True)
    return failed


# ---- speed and memory --------------------------------------------------------------------------

def gemm3_candidates(dev):
    """The floor: the training step's 3 GEMMs alone (logits z = x w^T, dE = z w, dW = z^T x, in
    the inputs' dtype), on each GEMM engine this device has; the fastest one is the floor.
    {name: fn(x, w)}. (cuBLAS through torch.mm on CUDA; on the CPU torch.mm, whatever BLAS /
    oneDNN torch dispatches to, and flce's own tile-GEMM engine, which can be the faster one:
    torch.mm's bf16 GEMMs are slow on CPUs without native bf16, fp32 ones on some AMD CPUs.)"""
    def torch_mm(x, w):
        z = x @ w.T
        return z @ w, z.T @ x
    engines = {"torch.mm": torch_mm}
    if dev == "cpu":
        tile_gemm, operands = torch.ops.flce.cpu_tile_gemm, {}

        def flce_tile_gemm(x, w):
            # Its products are fp32: a 16-bit step's backward multiplies an [N, V] operand in
            # the inputs' dtype (as the step's gradient tile is), made once, not a conversion
            # timed with the GEMMs.
            z = tile_gemm(x, w, trans_b=True)
            key = (z.shape, x.dtype)
            if x.dtype != F32 and key not in operands:
                operands[key] = torch.randn(z.shape, dtype=x.dtype)
            g = z if x.dtype == F32 else operands[key]
            return tile_gemm(g, w), tile_gemm(g, x, trans_a=True)
        engines["flce tile GEMM"] = flce_tile_gemm
    return engines


def logits_gemm(x, w):
    """The forward's floor: its one logits GEMM."""
    return x @ w.T


class Peak:
    """Peak bytes allocated during the block beyond what was allocated at its start (``bytes``)
    and in all (``total``): the CUDA caching allocator's statistics; on the CPU the resident
    set's high-water mark (Linux; None elsewhere), whose growth page reuse makes approximate.
    benchmarks/ measures with it too."""

    def __init__(self, dev):
        self.dev, self.bytes, self.total = dev, None, None

    def __enter__(self):
        gc.collect()
        if self.dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = None
            try:
                # freed heap pages back to the kernel first, so that reusing them shows as growth
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")  # resets VmHWM to the current RSS
                self.base = _status_kb("VmRSS")
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.dev == "cuda":
            torch.cuda.synchronize()
            self.total = torch.cuda.max_memory_allocated()
            self.bytes = self.total - self.base
        elif self.base is not None:
            self.total = _status_kb("VmHWM")
            self.bytes = max(0, self.total - self.base)
        return False


def _status_kb(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(field)


def measure(dev, fn, warmup, repeats):
    """(median, fastest, slowest) ms of ``fn()`` after ``warmup`` calls (CUDA events on CUDA),
    and its peak bytes beyond the state after the warm-up (whose gradients each step replaces:
    beyond the inputs and the gradients)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    with Peak(dev) as peak:
        for _ in range(repeats):
            if dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                start = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), min(times), max(times), peak.bytes


def peers(dev):
    """{name: loss fn(x, w, t) or the reason it cannot run here}: eager PyTorch and the fused
    linear cross-entropies of other libraries that are installed."""
    out = {"eager": lambda x, w, t: F.cross_entropy((x @ w.T).float(), t)}
    if dev != "cuda":
        out["liger"] = out["cce"] = "measured on CUDA only (Triton kernels)"
        return out
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as e:  # noqa: BLE001  (a peer that does not import is skipped, and said so)
        out["liger"] = f"not available: {type(e).__name__}: {e}"[:120]
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["cce"] = lambda x, w, t: cce(x, w, t)
    except Exception as e:  # noqa: BLE001
        out["cce"] = f"not available: {type(e).__name__}: {e}"[:120]
    return out


def copy_rate(dev, nbytes):
    """Bytes per second of a device copy (read + write) of ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=F32, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = measure(dev, lambda: dst.copy_(src), 3, 10)[0]
    return 2 * src.numel() * 4 / (ms / 1e3)


def shapes(dev, quick, tiny, linear=None):
    """[(op, n, v, d)]: the configurations measured, to fit the device; ``linear``: the linear
    step's shapes [(n, v, d)] alone, as given."""
    if linear:
        return [("linear_cross_entropy", n, v, d) for n, v, d in linear]
    if tiny:
        return [("cross_entropy", 512, 4096, None), ("linear_cross_entropy", 256, 4096, 128)]
    if dev == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        if total >= 24:
            lce = [(4096, 128256, 4096)] + ([] if quick or total < 60 else [(16384, 128256, 4096)])
        else:
            lce = [(4096, 32768, 2048)]
        ce = [(16384, 64128)] if total >= 24 else [(4096, 32768)]
    else:
        lce = [(512, 16384, 256)] if quick else [(1024, 32768, 512)]
        ce = [(2048, 16384)] if quick else [(4096, 32768)]
    # (cross-entropy first: seconds, where the peers' kernels of the linear step may take their
    # compilation and autotuning's time last)
    return [("cross_entropy", n, v, None) for n, v in ce] + \
        [("linear_cross_entropy", n, v, d) for n, v, d in lce]


def speed(dev, quick, tiny, dtype, out_path, partial, base_record, linear=None, repeats=None):
    """Measure each configuration, print its table, append its record; returns the records."""
    warmup, default = (1, 3) if dev == "cpu" else ((3, 10) if quick else (5, 20))
    repeats = repeats or default
    records = []
    for op, n, v, d in shapes(dev, quick, tiny, linear):
        rec = Record(partial, base_record, op=op, n=n, v=v, d=d, repeats=repeats,
                     dtype=str(dtype).replace("torch.", ""))
        rows = (measure_lce if op == "linear_cross_entropy" else measure_ce)(
            dev, n, v, d, dtype, warmup, repeats, quick, rec)
        print_table(rec, rows)
        rec["complete"] = True
        if out_path:
            append(out_path, rec)
        if partial and os.path.exists(partial):
            os.remove(partial)
        records.append(rec)
    return records


class Record(dict):
    """One configuration's record. With ``partial`` (a path), each measurement rewrites it
    there (``"complete": false``), so that a caller who has to cut the run mid-configuration
    (benchmarks/gpu/check.sh) keeps what was measured."""

    def __init__(self, partial, base, **fields):
        super().__init__(base, **fields, ms={}, ms_range={}, peak_gib={}, skipped={},
                         complete=False)
        self.partial = partial

    def put(self, name, result):
        med, lo, hi, peak = result
        self["ms"][name] = round(med, 4)
        self["ms_range"][name] = [round(lo, 4), round(hi, 4)]
        self["peak_gib"][name] = None if peak is None else round(peak / GIB, 4)
        self.save()

    def attempt(self, name, thunk, put=True):
        """Measure ``name`` (into the record unless ``put`` is False); an error (out of memory,
        a peer's failure) is recorded, not raised. Returns the measurement or None."""
        try:
            result = thunk()
            if put:
                self.put(name, result)
            return result
        except Exception as e:  # noqa: BLE001
            self["skipped"][name] = f"{type(e).__name__}: {e}"[:200]
            self.save()
            return None
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def save(self):
        if self.partial:
            tmp = self.partial + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(json.dumps(self, allow_nan=False) + "\n")
            os.replace(tmp, self.partial)


def measure_lce(dev, n, v, d, dtype, warmup, repeats, quick, rec):
    """The training step (forward + backward) of each method at [n x d x v]; the forward
    without gradients against its logits GEMM."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, d, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)

    def step(loss_fn):
        def run():
            x.grad = w.grad = None
            loss_fn(x, w, t).backward()
        return run

    engines = {}
    with torch.no_grad():
        for name, fn in gemm3_candidates(dev).items():
            got = rec.attempt(f"gemm3 on {name}",
                              lambda: measure(dev, lambda: fn(x, w), warmup, repeats), put=False)
            if got is not None:
                engines[name] = got
    if engines:
        best = min(engines, key=lambda k: engines[k][0])
        rec["gemm3_engine"] = best
        rec["gemm3_engines"] = {k: round(e[0], 4) for k, e in engines.items()}
        rec.put("gemm3", engines[best])
    methods = {"flce": lambda x, w, t: flce.linear_cross_entropy(x, w, t)}
    if not quick:
        methods["flce_recompute"] = lambda x, w, t: flce.linear_cross_entropy(x, w, t,
                                                                              single_pass=False)
    others = peers(dev)
    methods["eager"] = others.pop("eager")

    def steps(methods):
        for name, fn in methods.items():
            if isinstance(fn, str):
                rec["skipped"][name] = fn
            else:
                rec.attempt(name, lambda: measure(dev, step(fn), warmup, repeats))
        x.grad = w.grad = None
    steps(methods)
    with torch.no_grad():
        rec.attempt("gemm1", lambda: measure(dev, lambda: logits_gemm(x, w), warmup, repeats))
        rec.attempt("fwd_flce", lambda: measure(dev, lambda: flce.linear_cross_entropy(
            x, w, t, reduction="none", temperature=0.7), warmup, repeats))
        rec.attempt("fwd_eager", lambda: measure(dev, lambda: -torch.log_softmax(
            (x @ w.T).float() / 0.7, dim=-1).gather(1, t[:, None]), warmup, repeats))
    steps(others)  # last: their kernels' compilation and autotuning take the longest
    return [("gemm3", "the step's 3 GEMMs alone: the floor"), ("flce", "flce, default"),
            ("flce_recompute", "flce, single_pass=False"), ("eager", "logits + F.cross_entropy"),
            ("liger", "Liger-Kernel"), ("cce", "Cut Cross Entropy"),
            ("gemm1", "forward: the logits GEMM alone"), ("fwd_flce", "forward, no grad: flce"),
            ("fwd_eager", "forward, no grad: eager")]


def measure_ce(dev, n, v, d, dtype, warmup, repeats, quick, rec):
    """flce.cross_entropy on given logits [n, v] (forward + backward) against eager and the
    time its bytes take (one read forward, one read and one write backward) at the measured
    copy rate."""
    g = torch.Generator(device=dev).manual_seed(1)
    z = torch.randn(n, v, device=dev, dtype=dtype, generator=g).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    size = z.numel() * z.element_size()
    rate = copy_rate(dev, min(size, 2 ** 30))
    rec["copy_gb_s"] = round(rate / 1e9, 2)
    rec["ms"]["bytes"] = round(1e3 * 3 * size / rate, 4)

    def step(fn):
        def run():
            z.grad = None
            fn().backward()
        return run

    for name, fn in (("flce", lambda: flce.cross_entropy(z, t)),
                     ("eager", lambda: F.cross_entropy(z.float(), t))):
        rec.attempt(name, lambda: measure(dev, step(fn), warmup, repeats))
    z.grad = None
    return [("bytes", "its bytes at the copy rate: the floor"), ("flce", "flce.cross_entropy"),
            ("eager", "F.cross_entropy(logits.float())")]


def print_table(rec, rows):
    head = f"{rec['op']}  N={rec['n']} V={rec['v']}" + (f" D={rec['d']}" if rec["d"] else "") + \
        f"  {rec['dtype']}  ({rec['device']}, median of {rec['repeats']})"
    floor_name = "gemm3" if rec["op"] == "linear_cross_entropy" else "bytes"
    fl = rec["ms"].get(floor_name)
    print(f"\n{head}\n{'method':<16}{'ms':>11}{'x floor':>9}{'peak GiB':>10}  what", flush=True)
    for name, what in rows:
        if name in rec["ms"]:
            ms = rec["ms"][name]
            # the forward's floor is its one logits GEMM
            ref = rec["ms"].get("gemm1") if name.startswith("fwd_") else fl
            ratio = f"{ms / ref:.2f}" if ref else "-"
            peak = rec["peak_gib"].get(name)
            print(f"{name:<16}{ms:>11.3f}{ratio:>9}{'-' if peak is None else f'{peak:.3f}':>10}"
                  f"  {what}")
        elif name in rec["skipped"]:
            print(f"{name:<16}{'-':>11}{'':>9}{'':>10}  {what}: {rec['skipped'][name]}")
    if floor_name == "gemm3" and "gemm3_engine" in rec:
        print(f"(floor: the 3 GEMMs on {rec['gemm3_engine']})")
    elif "copy_gb_s" in rec:
        print(f"(floor: 3 x N x V x {torch.finfo(getattr(torch, rec['dtype'])).bits // 8} bytes "
              f"at the copy rate, {rec['copy_gb_s']} GB/s)")
    rec["vs_floor"] = {k: round(v / fl, 4) for k, v in rec["ms"].items()
                       if fl and not k.startswith("fwd_") and k != "gemm1"}
    if rec["ms"].get("gemm1"):
        rec["vs_floor"].update({k: round(rec["ms"][k] / rec["ms"]["gemm1"], 4)
                                for k in ("fwd_flce", "fwd_eager") if k in rec["ms"]})


def append(path, rec):
    """Append ``rec`` as one JSON line, on disk when this returns."""
    with open(path, "a") as fh:
        fh.write(json.dumps(rec, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def commit(info):
    """The commit measured: the build's, FLCE_COMMIT, or the source checkout's (``+dirty`` with
    uncommitted changes) when flce runs from one; else None."""
    found = info.get("commit") or os.environ.get("FLCE_COMMIT", "").strip()
    if found:
        return found
    pkg = os.path.dirname(os.path.abspath(__file__))
    try:
        git = lambda *a: subprocess.run(["git", "-C", pkg, *a], capture_output=True, text=True,
                                        timeout=20, check=True).stdout.strip()  # noqa: E731
        if os.path.realpath(os.path.join(git("rev-parse", "--show-toplevel"), "python",
                                         "flce")) != os.path.realpath(pkg):
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def driver_version():
    """The NVIDIA driver's version as nvidia-smi prints it, or None (no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def device_name(dev):
    """The GPU's name, or the CPU's as /proc/cpuinfo has it (as benchmarks/results' records)."""
    if dev == "cuda":
        return torch.cuda.get_device_name()
    fields = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = (s.strip() for s in line.partition(":"))
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    return fields["model name"] + (f", family {fields['cpu family']} model {fields['model']}"
                                   if "cpu family" in fields else "")


def _shape_list(text):
    try:
        out = [tuple(int(a) for a in s.split(",")) for s in text.split(";") if s.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != 3 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected N,V,D;N,V,D... of positive integers, "
                                         f"got {text!r}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m flce.check", description="Is flce right, and how fast, on this "
        "machine's device? Every path against float64, then the training step against its 3 "
        "GEMMs, eager and the installed peers (docs/build.md).")
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="fewer margins and repeats, one shape (about a minute on an H100)")
    ap.add_argument("--only", choices=("correctness", "speed"),
                    help="run one part (default: both, correctness first)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                    help="the speed part's dtype (default: bf16 on CUDA, fp32 on the CPU, "
                    "where torch's bf16 GEMMs are slow without native bf16 instructions)")
    ap.add_argument("--shapes", metavar="N,V,D;...", type=_shape_list,
                    help="the speed part: the training step at these shapes alone (default: "
                    "cross-entropy on given logits and the step at shapes that fit the device)")
    ap.add_argument("--repeats", type=int, metavar="K",
                    help="timed steps per method (default: 3 on the CPU; 10 on a GPU with "
                    "--quick, else 20)")
    ap.add_argument("--out", metavar="PATH",
                    help="append one JSON record per measured configuration to PATH")
    ap.add_argument("--partial", metavar="PATH",
                    help="keep the configuration being measured in PATH (\"complete\": false), "
                    "rewritten after each measurement, removed once it is appended to --out")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CI: smallest shapes
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    info = flce.build_info()
    if dev == "cuda":
        try:  # (a build without code for this GPU: one message naming it, not a FAIL per path)
            flce._build.check_cuda_device(torch.device("cuda"))
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
    torch.manual_seed(0)
    name = device_name(dev)
    where = (f"threads {torch.get_num_threads()}" if dev == "cpu"
             else f"CUDA {torch.version.cuda}")
    print(f"flce {info.get('version')} on {name} (torch {torch.__version__}, {where})",
          flush=True)
    failed = []
    if args.only != "speed":
        start = time.perf_counter()
        failed = correctness(dev, args.quick, args.tiny)
        print(f"correctness: {'FAILED ' + str(len(failed)) if failed else 'all'} paths "
              f"{'wrong' if failed else 'right'} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    if args.only != "correctness":
        cmd = "python -m flce.check" + (" --quick" if args.quick else "") + (
            " --shapes " + ";".join(",".join(map(str, t)) for t in args.shapes)
            if args.shapes else "")
        base = {"date": datetime.date.today().isoformat(), "device": name,
                "torch": torch.__version__, "commit": commit(info),
                "threads": torch.get_num_threads() if dev == "cpu" else None,
                "cuda": torch.version.cuda if dev == "cuda" else None,
                "driver": driver_version() if dev == "cuda" else None,
                "run": os.environ.get("FLCE_RUN") or None,
                "python": platform.python_version(), "source": cmd,
                "correctness": None if args.only == "speed" else
                ("failed: " + "; ".join(failed) if failed else "passed"),
                "build": info}
        dtype = {"bf16": BF16, "fp16": F16, "fp32": F32}[
            args.dtype or ("bf16" if dev == "cuda" else "fp32")]
        speed(dev, args.quick, args.tiny, dtype, args.out, args.partial, base, args.shapes,
              args.repeats)
        if args.out:
            print(f"\nrecords appended to {args.out}")
    if failed:
        print("\nWRONG on this device: " + "; ".join(failed), file=sys.stderr)
        print("flce computed a wrong result on these paths: do not train with them; report "
              "the lines above with flce.build_info() and the device", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
