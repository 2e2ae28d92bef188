"""Liger-Kernel's distillation tests, their case grids run on flce.linear_distillation against
float64 (flce.reference.distillation), with the suite's floor-relative tolerances.

Mapped from linkedin/Liger-Kernel (facts only, no code):
- test/chunked_loss/test_jsd_loss.py at 449f5cbadfec07daf9eca5685b39fcafb84d7edf
  (LigerFusedLinearJSDLoss): shapes (B, T, H, V) (8, 128, 1024, 4096) and (3, 47, 31, 123), the
  student's hidden size H // 2 and the teacher's H; bf16 and fp32; bias or not; (temperature,
  weight_hard_loss, weight_soft_loss, beta) (1.0, 0.5, 0.5, 0.5), (2.0, 0.0, 1.0, 0.8),
  (0.5, 1.0, 0.0, 0.2); the functional grid (2, 2, 8, 8), (9, 7, 41, 41) with (1.0, 0.5, 0.5,
  0.5, ignore_index -100) and (2.0, 0.1, 0.9, 0.5, 42). Inputs and weights uniform in [0, 1)
  (logits of a few units' spread and margins of 10-20 at H = 1024). Liger divides both terms by
  every token N; with no token ignored that is flce's "mean", which is checked too.
- test/transformers/test_fused_linear_jsd.py at f7a7b5df30edf77873859b8a2c0dc4259e532909
  (the Triton LigerFusedLinearJSD: soft term only, no bias, the mean over non-ignored tokens):
  shapes (8, 128, 1024, 4096) and (4, 423, 167, 1423); (temperature, beta) (1.0, 0.5),
  (2.0, 0.1), (1.0, 0.0) forward KL, (1.0, 1.0) reverse KL; with ignore_index 2 or 42 on a
  random part (up to half) of the tokens; every token ignored (loss 0, gradients 0); autocast
  bf16 / fp16 inputs with fp32 weights, here 16-bit inputs with fp32 master weights (B, T, H,
  V) = (2, 4, 2048, 3200).
- test/transformers/test_fused_linear_kl_div.py at c4ab4435825df0a4933645508835fc0f1c073822
  scores a student against given probabilities, not a teacher's classifier: that is
  flce.linear_cross_entropy with probability targets (tests/api/test_soft_targets.py), not
  mapped here.
Shapes scaled to CPU size: B * T at most 256 rows and H at most 256, V kept where it is small.
"""
import pytest
import torch

import flce
from flce import reference
from helpers import (GRAD_NORM_FACTOR, LOSS_FACTOR, assert_close_to_ref, assert_grad_close,
                     fp32_logits, rel_err)

DTYPES = [torch.bfloat16, torch.float32]


def _uniform(shape, dtype, g):
    return torch.rand(shape, generator=g, dtype=torch.float64).to(dtype)


def _case(n, h, v, dtype, *, bias, seed, weight_dtype=None, ignore_index=-100, ignored=0.0):
    """Liger's inputs: uniform [0, 1) hidden states, weights and biases, the student's hidden
    size h // 2, the teacher's h; labels uniform, ``ignored`` of them (a fraction, or "all")
    set to ignore_index."""
    g = torch.Generator().manual_seed(seed)
    wdt = weight_dtype or dtype
    xs, ws = _uniform((n, h // 2), dtype, g), _uniform((v, h // 2), wdt, g)
    xt, wt = _uniform((n, h), dtype, g), _uniform((v, h), wdt, g)
    bs = _uniform((v,), wdt, g) if bias else None
    bt = _uniform((v,), wdt, g) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignored == "all":
        t[:] = ignore_index
    elif ignored:
        k = int(torch.randint(1, max(2, int(n * ignored)), (1,), generator=g))
        t[torch.randperm(n, generator=g)[:k]] = ignore_index
    return xs, ws, bs, xt, wt, bt, t


def _check(case, *, teacher_grad=False, liger_mean=False, **kw):
    """flce against float64 (the weights' values in their input's dtype, as flce computes):
    loss and every gradient that is asked for; with ``liger_mean``, Liger's normalization too
    (both terms summed over the tokens, divided by all of them)."""
    xs, ws, bs, xt, wt, bt, t = case
    leaves = [None if x is None else x.detach().clone().requires_grad_(i < 3 or teacher_grad)
              for i, x in enumerate((xs, ws, bs, xt, wt, bt))]
    loss = flce.linear_distillation(leaves[0], leaves[1], leaves[3], leaves[4], t,
                                    student_bias=leaves[2], teacher_bias=leaves[5], **kw)
    loss.backward()
    def reference_grads(fp32_gemm):
        """float64 loss and leaves; fp32_gemm: the logits' values those of fp32 GEMMs (the
        ideal fp32 implementation: its logits, then exact math)."""
        wide = [None if x is None else x.to(xs.dtype if i in (1, 4) else x.dtype).double()
                .requires_grad_() for i, x in enumerate((xs, ws, bs, xt, wt, bt))]
        zs = wide[0] @ wide[1].T + (0 if wide[2] is None else wide[2])
        zt = wide[3] @ wide[4].T + (0 if wide[5] is None else wide[5])
        if fp32_gemm:
            zs = zs + (fp32_logits(xs, ws, bs).double() - zs).detach()
            zt = zt + (fp32_logits(xt, wt, bt).double() - zt).detach()
        ref = reference.distillation(zs, zt, t, **kw)
        ref.backward()
        return ref, wide, zs, zt

    ref, wide, zs, zt = reference_grads(False)
    ideal_loss, ideal = reference_grads(True)[:2]
    if xs.dtype != torch.float32:
        ideal = None  # (16-bit gradients: their own rounding is the floor)
    assert loss.dtype == torch.float32
    # within the suite's floor or twice the ideal fp32 implementation's error (a small JSD
    # of similar distributions keeps only the relative accuracy of its logits' differences)
    assert_close_to_ref(loss, ref, torch.float32, factor=LOSS_FACTOR, what="loss",
                        abs_floor=2 * float((ideal_loss - ref).abs().detach()))
    names = ("student_input", "student_weight", "student_bias", "teacher_input",
             "teacher_weight", "teacher_bias")
    for i, (name, leaf, r) in enumerate(zip(names, leaves, wide)):
        if leaf is None:
            continue
        if not leaf.requires_grad:
            assert leaf.grad is None, name
            continue
        # fp32: norm-wise within twice the ideal fp32 implementation's error (its fp32 logits
        # carry |z| 2^-24 each: Liger's uniform inputs make |z| ~ 30 here) or the suite's floor
        norm = None if ideal is None else max(
            GRAD_NORM_FACTOR[torch.float32],
            2 * rel_err(ideal[i].grad, r.grad) / torch.finfo(torch.float32).eps)
        assert_grad_close(leaf.grad, r.grad, what=name, norm_factor=norm)
    if liger_mean:
        assert (t != kw.get("ignore_index", -100)).all()  # (Liger's soft term counts them)
        # each term alone (the other's weight 0), summed over the tokens
        hard, soft = (reference.distillation(zs.detach(), zt.detach(), t,
                                             **{**kw, "reduction": "sum", other: 0.0})
                      for other in ("soft_weight", "hard_weight"))
        liger = (hard + soft) / t.numel()
        torch.testing.assert_close(ref.detach(), liger, rtol=1e-12, atol=0)
    return loss


# test/chunked_loss/test_jsd_loss.py: test_correctness (B * T and H scaled down)
@pytest.mark.parametrize("n,h,v", [(256, 256, 4096), (141, 31, 123)],
                         ids=["8x128x1024x4096_scaled", "3x47x31x123"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature,hard,soft,beta", [(1.0, 0.5, 0.5, 0.5),
                                                        (2.0, 0.0, 1.0, 0.8),
                                                        (0.5, 1.0, 0.0, 0.2)])
def test_chunked_jsd(n, h, v, dtype, bias, temperature, hard, soft, beta):
    _check(_case(n, h, v, dtype, bias=bias, seed=n + v), liger_mean=True, divergence="jsd",
           beta=beta, temperature=temperature, hard_weight=hard, soft_weight=soft)


# test/chunked_loss/test_jsd_loss.py: test_correctness_functional
@pytest.mark.parametrize("n,h,v", [(4, 8, 8), (63, 41, 41)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature,hard,soft,beta,ignore_index",
                         [(1.0, 0.5, 0.5, 0.5, -100), (2.0, 0.1, 0.9, 0.5, 42)])
def test_chunked_jsd_functional(n, h, v, dtype, bias, temperature, hard, soft, beta,
                                ignore_index):
    # (ignore_index 42 is no class of V = 8 or 41: nothing is ignored, as in Liger's test)
    _check(_case(n, h, v, dtype, bias=bias, seed=n), liger_mean=True, divergence="jsd",
           beta=beta, temperature=temperature, hard_weight=hard, soft_weight=soft,
           ignore_index=ignore_index)


TRANSFORMERS_SHAPES = [(256, 256, 4096), (212, 167, 1423)]
TRANSFORMERS_IDS = ["8x128x1024x4096_scaled", "4x423x167x1423_scaled"]


# test/transformers/test_fused_linear_jsd.py: test_correctness (the soft term alone)
@pytest.mark.parametrize("n,h,v", TRANSFORMERS_SHAPES, ids=TRANSFORMERS_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,beta", [(1.0, 0.5), (2.0, 0.1), (1.0, 0.0), (1.0, 1.0)])
def test_fused_linear_jsd(n, h, v, dtype, temperature, beta):
    _check(_case(n, h, v, dtype, bias=False, seed=v), divergence="jsd", beta=beta,
           temperature=temperature)


# test/transformers/test_fused_linear_jsd.py: test_correctness_with_ignore_index
@pytest.mark.parametrize("n,h,v", TRANSFORMERS_SHAPES, ids=TRANSFORMERS_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,beta,ignore_index",
                         [(1.0, 0.5, 2), (1.0, 0.0, 2), (2.0, 0.1, 42), (1.0, 1.0, 2)])
def test_fused_linear_jsd_ignore_index(n, h, v, dtype, temperature, beta, ignore_index):
    case = _case(n, h, v, dtype, bias=False, seed=v + 1, ignore_index=ignore_index,
                 ignored=0.5)
    assert (case[-1] == ignore_index).any()
    _check(case, divergence="jsd", beta=beta, temperature=temperature,
           ignore_index=ignore_index)


# test/transformers/test_fused_linear_jsd.py: test_correctness_functional (scalar 0.5). The
# first shape at temperature 2 has divergences of ~1e-3 between flat distributions (entropy
# ~2), which flce's fp32 row math forms from terms of the entropy's size: the CPU op's loss is
# 2.0e-6 relative off float64 where the check allows 3.9e-6 (exact math on the same fp32
# logits: 5e-8; docs/numerics.md, "Distillation", a known gap).
@pytest.mark.parametrize("n,h,v", [(4, 8, 8), (63, 41, 41)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,beta,ignore_index", [(1.0, 0.5, -100), (2.0, 0.1, 42)])
def test_fused_linear_jsd_functional(n, h, v, dtype, temperature, beta, ignore_index):
    xs, ws, bs, xt, wt, bt, t = _case(n, h, v, dtype, bias=False, seed=n + 2,
                                      ignore_index=ignore_index, ignored=0.5)
    half = (xs.double() * 0.5).to(dtype), (xt.double() * 0.5).to(dtype)
    _check((half[0], ws, bs, half[1], wt, bt, t), divergence="jsd", beta=beta,
           temperature=temperature, ignore_index=ignore_index)


# test/transformers/test_fused_linear_jsd.py: test_correctness_all_ignored
@pytest.mark.parametrize("n,h,v", TRANSFORMERS_SHAPES, ids=TRANSFORMERS_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,beta,ignore_index", [(1.0, 0.5, 2), (2.0, 0.1, 42)])
def test_fused_linear_jsd_all_ignored(n, h, v, dtype, temperature, beta, ignore_index):
    xs, ws, bs, xt, wt, bt, t = _case(n, h, v, dtype, bias=False, seed=3,
                                      ignore_index=ignore_index, ignored="all")
    x = xs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    loss = flce.linear_distillation(x, w, xt, wt, t, divergence="jsd", beta=beta,
                                    temperature=temperature, ignore_index=ignore_index)
    loss.backward()
    assert loss.item() == 0.0
    assert (x.grad == 0).all() and (w.grad == 0).all()


# test/transformers/test_fused_linear_jsd.py: test_amp (autocast: 16-bit inputs, fp32 weights)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_linear_jsd_amp(dtype):
    case = _case(8, 256, 3200, dtype, bias=False, seed=4, weight_dtype=torch.float32,
                 ignored=0.5)
    _check(case, divergence="jsd", beta=0.5)
