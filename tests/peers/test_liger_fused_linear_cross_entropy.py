"""Liger-Kernel's LigerFusedLinearCrossEntropyLoss cases
(test/transformers/test_fused_linear_cross_entropy.py) on flce.linear_cross_entropy, CPU backend,
against float64 (peer_check.run_lce). Liger passes (lin_weight, input, target, bias); flce takes
input first. lse_square_scale -> z_loss with Liger's z-loss rule (z_loss_weighting="none"),
ce_weight -> class_weight, return_token_accuracy -> return_accuracy; accum_dtype has no
counterpart (flce accumulates in fp32 always). Shapes scaled down for the CPU (README.md)."""

import pytest
import torch

import flce
from helpers import gen
from peer_check import run_lce, seed_of

# Liger's (8, 128, 1024, 4096) and the "random shape" (4, 47, 31, 123)
SHAPES = [(2, 32, 256, 1024), (4, 47, 31, 123)]
RED_DTYPE = [("mean", torch.bfloat16), ("mean", torch.float32), ("sum", torch.bfloat16),
             ("sum", torch.float32)]
# Liger's defaults, and every option at a non-default value once
OPTION_SETS = [
    dict(),
    dict(class_weight=True, label_smoothing=0.1, ignore_index=42, z_loss=1e-4, softcap=30.0,
         return_z_loss=True, z_loss_weighting="none"),
]


def head(bt, h, v, dtype, seed, *, bias, scalar=1.0, ignore_index=None):
    """Liger's head: uniform [0, 1) classifier and bias (every logit shares a large positive
    offset), randn hidden states times ``scalar``; a random count (1 to N/2) of the targets
    set to ``ignore_index``."""
    g = gen(seed)
    x = (torch.randn(bt, h, generator=g, dtype=torch.float64) * scalar).to(dtype)
    w = torch.rand(v, h, generator=g, dtype=torch.float64).to(dtype)
    b = torch.rand(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, v, (bt,), generator=g)
    if ignore_index is not None:
        k = int(torch.randint(1, max(2, bt // 2), (1,), generator=g))
        t[torch.randperm(bt, generator=g)[:k]] = ignore_index
    return x, w, b, t


def _options(opts, v, seed):
    opts = dict(opts)
    if opts.pop("class_weight", False):
        opts["class_weight"] = torch.rand(v, generator=gen(seed + 1))
    return opts


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, dtype", RED_DTYPE)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("opts", OPTION_SETS, ids=["defaults", "all_options"])
def test_correctness(B, T, H, V, reduction, dtype, bias, opts):
    s = seed_of("correctness", B, T, H, V, reduction, dtype, bias, sorted(opts))
    x, w, b, t = head(B * T, H, V, dtype, s, bias=bias,
                      ignore_index=opts.get("ignore_index", -100))
    out, _ = run_lce(x, w, t, b, seed=s, reduction=reduction, **_options(opts, V, s))
    assert ("z_loss" in out) == bool(opts.get("return_z_loss"))


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, dtype", RED_DTYPE)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("opts", OPTION_SETS, ids=["defaults", "all_options"])
def test_correctness_with_forward_only(B, T, H, V, reduction, dtype, bias, opts):
    s = seed_of("fwd_only", B, T, H, V, reduction, dtype, bias, sorted(opts))
    x, w, b, t = head(B * T, H, V, dtype, s, bias=bias,
                      ignore_index=opts.get("ignore_index", -100))
    with torch.no_grad():
        out, _ = run_lce(x, w, t, b, seed=s, reduction=reduction, **_options(opts, V, s))
    assert not out["loss"].requires_grad


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ce_weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_correctness_functional(B, T, H, V, dtype, ce_weight, bias):
    """Liger's functional call: randn classifier, bias and class weights (some negative)."""
    s = seed_of("functional", B, T, H, V, dtype, ce_weight, bias)
    g = gen(s)
    x = torch.randn(B * T, H, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, V, (B * T,), generator=g)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
    cw = torch.randn(V, generator=g) if ce_weight else None
    run_lce(x, w, t, b, seed=s, class_weight=cw, ignore_index=-100, z_loss=1e-4,
            label_smoothing=0.1, reduction="mean", softcap=30.0, return_z_loss=True,
            z_loss_weighting="none", requires=("input",))


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_accuracy", [True, False])
def test_correctness_with_token_accuracy(B, T, H, V, dtype, bias, return_accuracy):
    s = seed_of("accuracy", B, T, H, V, dtype, bias, return_accuracy)
    x, w, b, t = head(B * T, H, V, dtype, s, bias=bias, ignore_index=-100)
    out, _ = run_lce(x, w, t, b, seed=s, reduction="mean", return_accuracy=return_accuracy)
    if return_accuracy:
        assert out["accuracy"].shape == () and not out["accuracy"].requires_grad
    else:
        assert set(out) == {"loss"}


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cast_dtype", [torch.bfloat16, torch.float16])
def test_amp(B, T, H, V, bias, cast_dtype):
    """fp32 leaves under torch.autocast: computed in the cast dtype, held to its floor."""
    s = seed_of("amp", B, T, H, V, bias, cast_dtype)
    x, w, b, t = head(B * T, H, V, torch.float32, s, bias=bias)
    run_lce(x, w, t, b, seed=s, autocast=cast_dtype)


@pytest.mark.parametrize("case", ["token_scaling", "consistency", "functional", "module",
                                  "with_ignore_index"])
def test_token_scaling(case):
    pytest.skip("Liger's use_token_scaling (each token's loss times its detached p_t): no flce "
                "counterpart")


@pytest.mark.parametrize("return_z_loss, return_accuracy",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_structured_output(return_z_loss, return_accuracy):
    s = seed_of("structured", return_z_loss, return_accuracy)
    g = gen(s)
    x = torch.randn(3, 2, generator=g)
    w = torch.randn(3, 2, generator=g)
    b = torch.randn(3, generator=g)
    t = torch.randint(0, 3, (3,), generator=g)
    for out in (flce.linear_cross_entropy(x, w, t, bias=b, return_z_loss=return_z_loss,
                                          return_accuracy=return_accuracy),
                flce.LinearCrossEntropy(return_z_loss=return_z_loss,
                                        return_accuracy=return_accuracy)(x, w, t, b)):
        if not (return_z_loss or return_accuracy):
            assert isinstance(out, torch.Tensor)
            continue
        assert isinstance(out, tuple) and out[0] is out.loss
        assert hasattr(out, "z_loss") == return_z_loss
        assert hasattr(out, "accuracy") == return_accuracy
    run_lce(x, w, t, b, seed=s, return_z_loss=return_z_loss, return_accuracy=return_accuracy)


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_correctness_with_predicted_tokens(B, T, H, V, dtype, bias, ignore_index):
    s = seed_of("predicted", B, T, H, V, dtype, bias, ignore_index)
    g = gen(s)
    x = torch.randn(B * T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
    t = torch.randint(0, V, (B * T,), generator=g)
    t[torch.randperm(B * T, generator=g)[:B * T // 4]] = ignore_index
    out = flce.linear_cross_entropy(x, w, t, bias=b, ignore_index=ignore_index,
                                    return_predicted_tokens=True)
    pred = out.predicted_tokens
    assert pred.dtype == torch.int64 and pred.shape == t.shape
    keep = t != ignore_index
    z = x.detach().double() @ w.double().T + (0 if b is None else b.double())
    zk = z[keep]
    # the largest logit's index, or one within the fp32 GEMM's rounding of it
    gap = zk.amax(1) - zk.gather(1, pred[keep][:, None])[:, 0]
    assert torch.all(gap <= 64 * torch.finfo(torch.float32).eps * H ** 0.5 * zk.abs().amax())
    out.loss.backward()


@pytest.mark.parametrize("B, T, H, V", [(2, 16, 32, 64), (1, 32, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_correctness_reduction_none_per_token_grad_output(B, T, H, V, bias):
    """reduction="none" under a per-token upstream gradient that is not uniform."""
    s = seed_of("none_upstream", B, T, H, V, bias)
    g = gen(s)
    x = torch.randn(B * T, H, generator=g) * 0.1
    w = torch.randn(V, H, generator=g) * 0.1
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    t = torch.randint(0, V, (B * T,), generator=g)
    run_lce(x, w, t, b, seed=s, reduction="none")
