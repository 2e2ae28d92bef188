"""Liger-Kernel's LigerCrossEntropyLoss cases (test/transformers/test_cross_entropy.py) on
flce.cross_entropy, CPU backend, against float64 (peer_check.run_ce). Liger's names map as
docs/api.md says: lse_square_scale -> z_loss, its z-loss rule -> z_loss_weighting="none",
return_token_accuracy -> return_accuracy. Shapes scaled down for the CPU (README.md)."""

import pytest
import torch

import flce
from helpers import gen
from peer_check import run_ce, seed_of

# Liger's (2, 4096, 32000) "llama" and (3, 423, 32000) "weird" shapes, scaled down
BIG = [(2, 32, 2048), (3, 23, 2053)]
DTYPES = [torch.bfloat16, torch.float32]
REDUCTIONS = ["sum", "mean", "none"]


def logits_and_targets(b, t, v, dtype, seed, *, scalar=1.0, ignore_index=None):
    """Liger's inputs: randn logits times ``scalar``; targets uniform, then a random count
    (1 to N/2) of them set to ``ignore_index``."""
    g = gen(seed)
    n = b * t
    z = (torch.randn(n, v, generator=g, dtype=torch.float64) * scalar).to(dtype)
    tgt = torch.randint(0, v, (n,), generator=g)
    if ignore_index is not None:
        k = int(torch.randint(1, max(2, n // 2), (1,), generator=g))
        tgt[torch.randperm(n, generator=g)[:k]] = ignore_index
    return z, tgt


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness(B, T, V, reduction, dtype):
    s = seed_of("correctness", B, T, V, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    run_ce(z, t, seed=s, reduction=reduction)


@pytest.mark.parametrize("B, T, V", [(2, 2, 8), (9, 7, 41)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_functional(B, T, V, dtype):
    # ignore_index=0 with targets drawn from [0, V): class 0's tokens are ignored
    s = seed_of("functional", B, T, V, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    out, _ = run_ce(z, t, seed=s, ignore_index=0, z_loss=1e-4, label_smoothing=0.1,
                    reduction="mean", softcap=30.0, return_z_loss=True,
                    z_loss_weighting="none")
    assert out["z_loss"].shape == ()


@pytest.mark.parametrize("B, T, V, ignore_index", [BIG[0] + (2,), BIG[1] + (-123,)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_ignore_index(B, T, V, ignore_index, reduction, dtype):
    s = seed_of("ignore", B, T, V, ignore_index, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    out, grad = run_ce(z, t, seed=s, ignore_index=ignore_index, reduction=reduction)
    ignored = t == ignore_index
    assert torch.all(grad[ignored] == 0)
    if reduction == "none":
        assert torch.all(out["loss"][ignored] == 0)


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_label_smoothing(B, T, V, dtype):
    s = seed_of("ls", B, T, V, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    run_ce(z, t, seed=s, label_smoothing=0.1)


@pytest.mark.parametrize("B, T, V, ignore_index, label_smoothing",
                         [BIG[0] + (1, 0.1), BIG[1] + (-300, 0.2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_label_smoothing_with_ignore_index(B, T, V, ignore_index,
                                                            label_smoothing, dtype):
    s = seed_of("ls_ignore", B, T, V, ignore_index, label_smoothing, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    run_ce(z, t, seed=s, ignore_index=ignore_index, label_smoothing=label_smoothing)


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_softcap(B, T, V, reduction, dtype):
    s = seed_of("softcap", B, T, V, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    run_ce(z, t, seed=s, softcap=30.0, reduction=reduction)


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("return_z_loss", [True, False])
@pytest.mark.parametrize("z_loss", [1e-4, 1e-5])  # Liger's PaLM and Chameleon scales
def test_correctness_with_z_loss(B, T, V, dtype, return_z_loss, z_loss):
    s = seed_of("z", B, T, V, dtype, return_z_loss, z_loss)
    z, t = logits_and_targets(B, T, V, dtype, s)
    out, _ = run_ce(z, t, seed=s, z_loss=z_loss, return_z_loss=return_z_loss,
                    z_loss_weighting="none")
    assert ("z_loss" in out) == return_z_loss


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("return_z_loss, z_loss", [(True, 1e-4), (False, 1e-5)])
@pytest.mark.parametrize("label_smoothing, ignore_index, reduction",
                         [(0.1, 42, "mean"), (0.2, -42, "sum")])
def test_correctness_with_z_loss_with_other_params(B, T, V, dtype, return_z_loss, z_loss,
                                                   label_smoothing, ignore_index, reduction):
    s = seed_of("z_other", B, T, V, dtype, return_z_loss, z_loss, label_smoothing, ignore_index,
                reduction)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    run_ce(z, t, seed=s, z_loss=z_loss, return_z_loss=return_z_loss,
           label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction,
           z_loss_weighting="none")


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_weight(B, T, V, reduction, dtype):
    # (Liger draws the class weights in the logits' dtype)
    s = seed_of("weight", B, T, V, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    w = torch.rand(V, generator=gen(s + 1), dtype=torch.float64).to(dtype)
    run_ce(z, t, seed=s, class_weight=w, reduction=reduction)


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index, z_loss, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("return_z_loss", [False, True])
def test_correctness_with_weight_with_other_params(B, T, V, reduction, ignore_index, z_loss,
                                                   label_smoothing, softcap, dtype,
                                                   return_z_loss):
    s = seed_of("weight_other", B, T, V, reduction, ignore_index, z_loss, label_smoothing,
                softcap, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    w = torch.rand(V, generator=gen(s + 1), dtype=torch.float32)
    run_ce(z, t, seed=s, class_weight=w, reduction=reduction, ignore_index=ignore_index,
           z_loss=z_loss, label_smoothing=label_smoothing, softcap=softcap,
           z_loss_weighting="none", return_z_loss=return_z_loss)


def _not_last_layer(seed):
    """Liger's loss * 3 under a random upstream gradient."""
    def objective(out):
        g = gen(seed)
        return (out["loss"] * 3 * torch.rand((), generator=g, dtype=torch.float64)).sum()
    return objective


@pytest.mark.parametrize("B, T, V", BIG)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_not_last_layer(B, T, V, reduction, dtype):
    s = seed_of("not_last", B, T, V, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    run_ce(z, t, seed=s, reduction=reduction, objective=_not_last_layer(s))


@pytest.mark.parametrize("B, T, V", [(2, 16, 2048), BIG[1]])
@pytest.mark.parametrize("ignore_index, z_loss, label_smoothing, softcap",
                         [(-100, 1e-4, 0.1, 30.0), (42, 1e-5, 0.2, 40.0)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_not_last_layer_with_other_params(B, T, V, ignore_index, z_loss,
                                                      label_smoothing, softcap, reduction, dtype):
    s = seed_of("not_last_other", B, T, V, ignore_index, z_loss, label_smoothing, softcap,
                reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    run_ce(z, t, seed=s, reduction=reduction, ignore_index=ignore_index, z_loss=z_loss,
           label_smoothing=label_smoothing, softcap=softcap, z_loss_weighting="none",
           objective=_not_last_layer(s))


def test_float32_internal():
    """Liger's kernel-level check that bf16 logits are reduced in fp32: bf16 logits and the
    same values in fp32 give the same (float32) loss and each is at float64's."""
    s = seed_of("fp32_internal")
    z, t = logits_and_targets(4, 1, 128256, torch.bfloat16, s)
    out16, g16 = run_ce(z, t, seed=s)
    out32, g32 = run_ce(z.float(), t, seed=s)
    assert g16.dtype == torch.bfloat16 and g32.dtype == torch.float32


@pytest.mark.parametrize("B, T, V, ignore_index", [BIG[0] + (2,), BIG[1] + (-123,)])
def test_correctness_with_out_of_bounds_target(B, T, V, ignore_index):
    s = seed_of("oob", B, T, V, ignore_index)
    z, t = logits_and_targets(B, T, V, torch.bfloat16, s, ignore_index=ignore_index)
    g = gen(s + 1)
    k = int(torch.randint(1, B * T // 2, (1,), generator=g))
    t[torch.randperm(B * T, generator=g)[:k]] = torch.randint(V, 2 * V, (k,), generator=g)
    with pytest.raises(IndexError, match="out of range"):
        flce.cross_entropy(z.requires_grad_(), t, ignore_index=ignore_index)


@pytest.mark.parametrize("B, T, V, ignore_index", [BIG[0] + (-100,), BIG[1] + (2,)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_correctness_with_forward_only(B, T, V, ignore_index, reduction, dtype):
    s = seed_of("fwd_only", B, T, V, ignore_index, reduction, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s, ignore_index=ignore_index)
    with torch.no_grad():
        out, _ = run_ce(z, t, seed=s, ignore_index=ignore_index, reduction=reduction,
                        backward=False)
    assert not out["loss"].requires_grad


@pytest.mark.parametrize("return_z_loss, return_accuracy, return_predicted_tokens",
                         [(z, a, p) for z in (False, True) for a in (False, True)
                          for p in (False, True)])
def test_structured_output(return_z_loss, return_accuracy, return_predicted_tokens):
    s = seed_of("structured", return_z_loss, return_accuracy, return_predicted_tokens)
    z, t = logits_and_targets(1, 3, 3, torch.float32, s)
    more = dict(return_predicted_tokens=True) if return_predicted_tokens else {}
    out = flce.cross_entropy(z, t, return_z_loss=return_z_loss, return_accuracy=return_accuracy,
                             **more)
    if not (return_z_loss or return_accuracy or return_predicted_tokens):
        assert isinstance(out, torch.Tensor) and out.shape == ()
        return
    # a NamedTuple, the loss first (tuple unpacking keeps working)
    assert isinstance(out, tuple) and out[0] is out.loss and out.loss.shape == ()
    assert hasattr(out, "z_loss") == return_z_loss
    assert hasattr(out, "accuracy") == return_accuracy
    assert hasattr(out, "predicted_tokens") == return_predicted_tokens
    run_ce(z, t, seed=s, return_z_loss=return_z_loss, return_accuracy=return_accuracy)


@pytest.mark.parametrize("B, T, V", [(2, 128, 512), (3, 47, 31)])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_correctness_with_predicted_tokens(B, T, V, ignore_index, dtype):
    s = seed_of("predicted", B, T, V, ignore_index, dtype)
    z, t = logits_and_targets(B, T, V, dtype, s)
    t[torch.randperm(t.numel(), generator=gen(s + 1))[:t.numel() // 4]] = ignore_index
    out = flce.cross_entropy(z.requires_grad_(), t, ignore_index=ignore_index,
                             return_predicted_tokens=True)
    pred = out.predicted_tokens
    assert pred.dtype == torch.int64 and pred.shape == t.shape
    keep = t != ignore_index
    # the largest logit's index (bf16 logits can tie: then any of the tied ones)
    zk = z.detach()[keep]
    assert torch.equal(zk.gather(1, pred[keep][:, None])[:, 0], zk.amax(1))
    out.loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_correctness_true_class_grad_confident_predictions(dtype, label_smoothing, reduction):
    """Confident rows (target logit 10 above the row's largest): the target's gradient, a small
    difference of large terms in p_t - 1, held to float64 like every other element."""
    s = seed_of("confident", dtype, label_smoothing, reduction)
    z, t = logits_and_targets(2, 32, 2048, torch.float32, s)
    rows = torch.arange(t.numel())
    z[rows, t] = z.max(dim=-1).values + 10.0
    run_ce(z.to(dtype), t, seed=s, label_smoothing=label_smoothing, reduction=reduction)
