"""Every option and input form of flce.linear_cross_entropy against the float64 reference.

Each case compares every element of the loss (and lse) and of every gradient with
flce.reference in float64 (helpers.check_flce): fp32-level error for the loss, which is fp32
whatever the input dtype, and a few roundings of the output dtype for gradients.
"""
import math

import pytest
import torch

import flce
from helpers import (as_f64, assert_close_to_ref, assert_grad_close, check_flce, gen,
                     poison_allocator, rand_inputs, ref_loss_grads, rel_err, round_floor)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
REDUCTIONS = ["mean", "sum", "none"]


@pytest.mark.parametrize("n,v,d", [(1, 50257, 123), (300, 3001, 64), (257, 2049, 33),
                                   (7, 5, 3), (513, 2047, 17)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_shapes_off_tile(device, n, v, d, bias):
    x, w, t, b = rand_inputs(n, v, d, torch.float32, device, seed=n + v, bias=bias)
    check_flce(x, w, t, b, reduction="none")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(2348, 4500), (5000, 4300)], ids=["rows-split", "vocab-split"])
def test_cpu_recompute_tiles_and_blocks(dtype, n, v):
    """The CPU recompute backward with several tiles per worker in each block and several blocks,
    for either split (rows when N < V; 16-bit tiles are 1024 rows by 2048 columns, fp32 ones 256
    by 256): every gradient accumulator takes its first tile product as a store and the later
    ones as compensated adds (flce_cpu.cpp, GradPass::tile). reduction="none": the recompute
    path, with a random upstream gradient per row."""
    x, w, t, b = rand_inputs(n, v, 16, dtype, "cpu", seed=31, bias=True)
    check_flce(x, w, t, b, reduction="none")


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_low_precision_odd_shapes(device, dtype):
    # Odd D, an odd last row block (257 = 256 + 1) and an odd last vocab tile (2049 = 2048 + 1):
    # the bf16 kernels read k in pairs, so every tile GEMM meets an odd k here.
    x, w, t, b = rand_inputs(257, 2049, 33, dtype, device, seed=11, bias=True)
    check_flce(x, w, t, b, reduction="none")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dtypes_and_reductions(device, dtype, reduction):
    x, w, t, b = rand_inputs(300, 3001, 64, dtype, device, seed=3, bias=True, ignore_frac=0.1)
    check_flce(x, w, t, b, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_3d_input(device, reduction):
    x, w, t, b = rand_inputs((3, 70), 1000, 48, torch.float32, device, seed=5, bias=True)
    loss, _, grads = check_flce(x, w, t, b, reduction=reduction, return_lse=True)
    assert loss.shape == ((3, 70) if reduction == "none" else ())
    assert grads["input"].shape == (3, 70, 48)


def test_non_contiguous(device):
    g = gen(7)
    n, v, d = 200, 1500, 40
    # full buffers on the device first, then the views (a copy to another device would
    # make them contiguous)
    x = torch.randn(d, 2 * n, generator=g).to(device).T[::2]            # transposed + strided
    w = (torch.randn(v, 3 * d, generator=g) / d ** 0.5).to(device)[:, d:2 * d]  # column slice
    t = torch.randint(0, v, (2 * n,), generator=g).to(device)[1::2]
    b = torch.randn(2 * v, generator=g).to(device)[::2]
    assert not (x.is_contiguous() or w.is_contiguous() or t.is_contiguous()
                or b.is_contiguous())
    check_flce(x, w, t, b, reduction="none", return_lse=True)
    # transposed weight: a [D, V] buffer viewed as [V, D]
    wt = (torch.randn(d, v, generator=g) / d ** 0.5).to(device).T
    assert not wt.is_contiguous()
    check_flce(x, wt, t, reduction="sum")


@pytest.mark.parametrize("ignore_index", [-100, 0, 7])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignore_index(device, ignore_index, reduction):
    x, w, t, b = rand_inputs(400, 2100, 32, torch.float32, device, seed=11, bias=True,
                             ignore_frac=0.3, ignore_index=ignore_index)
    if ignore_index >= 0:
        # the ignored id is also a valid column: other rows' logits of it must still count
        assert (t == ignore_index).sum() > 50
    loss, _, grads = check_flce(x, w, t, b, reduction=reduction, ignore_index=ignore_index)
    ign = (t == ignore_index).cpu()
    assert (grads["input"].cpu()[ign] == 0).all()
    if reduction == "none":
        assert (loss.detach().cpu()[ign] == 0).all()
    ref_all = ref_loss_grads(x, w, t, b, reduction="sum", ignore_index=ignore_index)
    kept = torch.where(t == ignore_index, torch.ones_like(t), t)
    ref_kept = ref_loss_grads(x, w, kept, b, reduction="sum", ignore_index=-12345)
    assert rel_err(ref_all[0], ref_kept[0]) > 1e-2  # ignoring changes the answer


@pytest.mark.parametrize("ignore_index", [-100, 7])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored(device, ignore_index, reduction):
    x, w, t, b = rand_inputs(50, 700, 16, torch.float32, device, seed=13, bias=True)
    t = torch.full_like(t, ignore_index)
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
    loss = flce.linear_cross_entropy(xg, wg, t, bias=bg, reduction=reduction,
                                     ignore_index=ignore_index)
    ref = torch.nn.functional.cross_entropy(x @ w.T + b, t, reduction=reduction,
                                            ignore_index=ignore_index)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref)  # 0 / 0, as torch
    else:
        assert (loss == 0).all() and loss.shape == ref.shape
    loss.sum().backward()
    for a in (xg, wg, bg):
        assert torch.equal(a.grad, torch.zeros_like(a)), "ignored rows must give zero gradients"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opts", [
    dict(label_smoothing=0.1), dict(z_loss=1e-2), dict(softcap=3.0),
    dict(label_smoothing=0.2, z_loss=1e-3, softcap=5.0, ignore_index=3),
], ids=["smoothing", "zloss", "softcap", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options(device, dtype, opts, reduction):
    x, w, t, b = rand_inputs(300, 3001, 64, dtype, device, seed=17, bias=True, scale=3.0,
                             ignore_frac=0.1, ignore_index=opts.get("ignore_index", -100))
    check_flce(x, w, t, b, reduction=reduction, return_lse=True, **opts)
    # the option must change the answer by far more than the tolerance
    plain = ref_loss_grads(x, w, t, b, reduction="none",
                           ignore_index=opts.get("ignore_index", -100))
    with_opt = ref_loss_grads(x, w, t, b, reduction="none", **opts)
    assert rel_err(with_opt[0], plain[0]) > 1e-3
    assert rel_err(with_opt[2], plain[2]) > 1e-3


def test_return_lse_gradient(device):
    x, w, t, b = rand_inputs(260, 2500, 32, torch.float32, device, seed=19, bias=True)
    # only the lse feeds the backward: the loss is unused
    xg = x.clone().requires_grad_()
    _, lse = flce.linear_cross_entropy(xg, w, t, bias=b, return_lse=True)
    up = torch.randn(lse.shape, generator=gen(1)).to(device)
    (lse * up).sum().backward()
    x64, w64, b64 = as_f64(x, w, b)
    x64 = x64.cpu().requires_grad_()
    ref = torch.logsumexp(x64 @ w64.cpu().T + b64.cpu(), dim=1)
    assert_close_to_ref(lse, ref, torch.float32, factor=32, what="lse")
    (ref * up.cpu().double()).sum().backward()
    assert_close_to_ref(xg.grad, x64.grad, torch.float32, factor=32, what="grad through lse")
    check_flce(x, w, t, b, reduction="sum", return_lse=True)


def test_master_weight(device):
    """bf16 input with fp32 master weight and bias: fp32 gradients far more accurate than bf16."""
    x, w32, t, b32 = rand_inputs(300, 3001, 64, torch.bfloat16, device, seed=23, bias=True,
                                 weight_dtype=torch.float32)
    _, _, grads = check_flce(x, w32, t, b32, reduction="mean")
    assert grads["weight"].dtype == torch.float32 and grads["bias"].dtype == torch.float32
    ref = ref_loss_grads(x, w32, t, b32)  # as flce computes: weight cast to bf16 first
    err32 = rel_err(grads["weight"], ref[3])
    # bf16 weights (the same values): bf16 gradients
    w16, b16 = w32.to(torch.bfloat16), b32.to(torch.bfloat16)
    _, _, g16 = check_flce(x, w16, t, b16, reduction="mean")
    err16 = rel_err(g16["weight"], ref[3])
    floor16 = round_floor(ref[3], torch.bfloat16)
    assert err32 < 1e-5 and err32 < floor16 / 100, (err32, floor16)
    assert err16 > 10 * err32




@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False],
                                  [False, True, True], [False, False, True]])
def test_ops_backward_poisoned(device, mask):
    """Direct calls of torch.ops.flce.{forward,backward}: every element written and right,
    unrequested outputs empty."""
    n, v, d = 300, 3001, 48
    x, w, t, b = rand_inputs(n, v, d, torch.float32, device, seed=29, bias=True,
                             ignore_frac=0.1)
    poison_allocator(((n,), torch.float32), ((n, 2), torch.float32), device=device)
    loss, lse, stats, _ = flce.ops.forward(x, w, t, b, -100, 0.1, 1e-3, 0.0)
    ref_loss, ref_lse = flce.reference.linear_cross_entropy(
        *as_f64(x, w)[:2], t, bias=b.double(), reduction="none", label_smoothing=0.1,
        z_loss=1e-3, return_lse=True)
    assert_close_to_ref(loss, ref_loss, torch.float32, factor=32, what="loss")
    assert_close_to_ref(lse, ref_lse, torch.float32, factor=32, what="lse")
    g = gen(31)
    gl = (torch.rand(n, generator=g) + 0.5).to(device)
    glse = (torch.rand(n, generator=g) - 0.5).to(device)
    poison_allocator(((n, d), torch.float32), ((v, d), torch.float32), ((v,), torch.float32),
                     device=device)
    gi, gw, gb = flce.ops.backward(gl, glse, x, w, t, b, stats, 0, v, -100, 0.1, 1e-3, 0.0,
                                   mask)
    x64, w64, b64 = (a.double().cpu().requires_grad_() for a in (x, w, b))
    rl, rs = flce.reference.linear_cross_entropy(x64, w64, t.cpu(), bias=b64, reduction="none",
                                                 label_smoothing=0.1, z_loss=1e-3,
                                                 return_lse=True)
    ((rl * gl.cpu().double()).sum() + (rs * glse.cpu().double()).sum()).backward()
    for want, got, ref, like in ((mask[0], gi, x64.grad, x), (mask[1], gw, w64.grad, w),
                                 (mask[2], gb, b64.grad, b)):
        if want:
            assert got.shape == like.shape and got.dtype == like.dtype
            assert_grad_close(got, ref)
        else:
            assert got.numel() == 0


def test_vocab_shards_compose(device):
    """partial_stats over vocabulary shards + combine, and per-shard backward, equal the
    single-device op (the vocab-parallel contract on one process)."""
    n, v, d = 300, 5001, 32
    x, w, t, b = rand_inputs(n, v, d, torch.float32, device, seed=37, bias=True,
                             ignore_frac=0.1)
    cuts = [0, 1234, 2048 + 7, v]
    parts = [flce.ops.partial_stats(x, w[lo:hi], t, b[lo:hi], lo, -100, 4.0)
             for lo, hi in zip(cuts, cuts[1:])]
    loss, lse, stats, _ = flce.ops.combine(torch.stack(parts), t, v, -100, 0.1, 1e-3)
    full = flce.ops.forward(x, w, t, b, -100, 0.1, 1e-3, 4.0)
    for a, f in zip((loss, lse, stats), full):
        fin = torch.isfinite(f)
        assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[~fin], f[~fin])
        assert_close_to_ref(a[fin], f[fin].double(), torch.float32, factor=8)
    gl = torch.rand(n, generator=gen(2)).to(device) + 0.5
    gi_full, gw_full, gb_full = flce.ops.backward(gl, None, x, w, t, b, stats, 0, v, -100, 0.1,
                                                  1e-3, 4.0, [True, True, True])
    gi = torch.zeros_like(x, dtype=torch.float64)
    for lo, hi in zip(cuts, cuts[1:]):
        gi_s, gw_s, gb_s = flce.ops.backward(gl, None, x, w[lo:hi], t, b[lo:hi], stats, lo, v,
                                             -100, 0.1, 1e-3, 4.0, [True, True, True])
        gi += gi_s.double()
        assert_grad_close(gw_s, gw_full[lo:hi].double(), norm_factor=8)
        assert_grad_close(gb_s, gb_full[lo:hi].double(), norm_factor=8)
    assert_grad_close(gi_full, gi, norm_factor=8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_vocabulary(device, temperature):
    """A -inf bias on padded vocabulary rows (a common way to mask them) leaves those columns
    out: the loss and gradients of the unpadded vocabulary, never NaN (the CUDA backend's bias
    and temperature transform once took inf - inf there)."""
    g = torch.Generator().manual_seed(31)
    n, v, pad, d = 40, 200, 24, 16
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v + pad, d, generator=g) / d ** 0.5
    b = torch.randn(v + pad, generator=g) * 0.1
    b[v:] = -math.inf
    t = torch.randint(0, v, (n,), generator=g)
    xs, ws = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
    loss = flce.linear_cross_entropy(xs, ws, t.to(device), bias=b.to(device),
                                     temperature=temperature)
    loss.backward()
    xr, wr = x.clone().requires_grad_(), w[:v].clone().requires_grad_()
    ref = flce.reference.linear_cross_entropy(xr.double(), wr.double(), t, bias=b[:v].double(),
                                              temperature=temperature)
    ref.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    torch.testing.assert_close(xs.grad.cpu().double(), xr.grad.double(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws.grad.cpu()[:v].double(), wr.grad.double(), rtol=1e-4,
                               atol=1e-6)
    assert (ws.grad.cpu()[v:] == 0).all()


def test_plus_inf_logits_give_nan_on_every_path(device):
    """A +inf logit makes its row's loss NaN (inf - inf, as torch's log_softmax), in the target
    column or not, on the fused path and the float64 composite alike (the composite returned
    +inf where the fused path had NaN), and so the lse of a row whose +inf is not its target;
    a +inf target's lse is +inf on both."""
    inf = math.inf
    z = torch.tensor([[1.0, inf, 0.0], [inf, 1.0, 0.0], [inf, 1.0, 0.0], [2.0, 1.0, 0.0]])
    t = torch.tensor([0, 0, -100, 0])
    for dtype in (torch.float32, torch.float64):
        loss, lse = flce.cross_entropy(z.to(device, dtype), t.to(device), reduction="none",
                                       return_lse=True)
        assert loss[:2].isnan().all() and lse[[0, 2]].isnan().all(), (dtype, loss, lse)
        assert lse[1] == math.inf, (dtype, lse)
        assert torch.isfinite(loss[3]) and loss[2] == 0, (dtype, loss)


def test_nan_logits_in_a_tile_of_their_own_propagate(device):
    """A NaN logit is NaN in the loss (and lse, entropy) wherever it sits, also where every other
    non-target logit of its tile is NaN or -inf: the CPU's tile fold took such a tile's max as
    -inf (the max skips NaN) and added nothing, a loss of 0 for [[nan, 5.]] and a finite loss
    beside NaN gradients for a classifier whose last 256 rows are NaN."""
    z = torch.tensor([[math.nan, 5.0], [math.nan, -math.inf], [1.0, 2.0]], device=device)
    t = torch.tensor([1, 1, 1], device=device)
    loss, lse, ent = flce.cross_entropy(z, t, reduction="none", return_lse=True,
                                        return_entropy=True)
    assert loss[:2].isnan().all() and lse[:2].isnan().all() and ent[:2].isnan().all(), loss
    assert torch.isfinite(loss[2])
    g = torch.Generator().manual_seed(33)
    x = torch.randn(6, 16, generator=g)
    w = torch.randn(1024, 16, generator=g) / 4
    w[-256:] = math.nan
    t = torch.randint(0, 512, (6,), generator=g)
    loss = flce.linear_cross_entropy(x.to(device), w.to(device), t.to(device), reduction="none")
    assert loss.isnan().all(), loss


def test_entropy_of_a_row_whose_target_logit_is_minus_inf(device):
    """p_t = 0: the entropy is the non-target distribution's, and its gradient finite (the
    target's term p_t nll was 0 * inf = NaN in the kernels)."""
    z = torch.tensor([[0.5, -math.inf, 0.25], [0.5, 1.0, 0.25]], device=device,
                     requires_grad=True)
    t = torch.tensor([1, 1], device=device)
    _, ent = flce.cross_entropy(z, t, reduction="none", return_entropy=True)
    ent.sum().backward()
    z64 = z.detach().double().cpu().requires_grad_()
    want = torch.distributions.Categorical(logits=z64).entropy()
    want.sum().backward()
    torch.testing.assert_close(ent.detach().cpu().double(), want.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(z.grad.cpu().double(), z64.grad, rtol=1e-5, atol=1e-7)


def test_rows_with_only_their_target_unmasked(device):
    """Rows whose every non-target logit is -inf (a vocabulary masked but for the target): loss
    0 and zero gradients on every path, the float64 composite included (the logsumexp of -inf
    alone has exp(-inf - -inf) = NaN in its backward, which the GEMM spread over dE and dW)."""
    g = torch.Generator().manual_seed(32)
    x = torch.randn(4, 4, generator=g)
    w = torch.randn(3, 4, generator=g)
    b = torch.tensor([-math.inf, 0.0, -math.inf])
    t = torch.tensor([1, 1, -100, 1])
    for dtype in (torch.float32, torch.float64):
        xs = x.to(device, dtype, copy=True).requires_grad_()
        ws = w.to(device, dtype, copy=True).requires_grad_()
        loss = flce.linear_cross_entropy(xs, ws, t.to(device), bias=b.to(device, dtype),
                                         reduction="sum")
        loss.backward()
        assert loss.item() == 0.0, dtype
        assert (xs.grad == 0).all() and (ws.grad[[0, 2]] == 0).all(), dtype
        assert torch.isfinite(ws.grad).all(), dtype
