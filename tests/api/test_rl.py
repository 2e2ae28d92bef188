"""Outputs for reinforcement learning: the sampling temperature, the per-token entropy and the
per-token log-probability, on every backend, against float64.

The entropy is held to the same yardstick as the loss: the error of the ideal computation on
fp32 logits (exact math in float64 on the logits an fp32 GEMM gives), across target margins
0-200, where H -> (1 + m) e^-m (V - 1) and the textbook lse - sum p z cancels to 0 in fp32.
"""
import math

import pytest
import torch

import flce
from helpers import (as_f64, check_flce, fp32_logits, margin_inputs, rand_inputs)

MARGINS = [0, 5, 10, 20, 30, 50, 88, 100, 150, 200]
FLT_MIN = torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("margin", MARGINS)
def test_entropy_at_margins(device, dtype, margin):
    x, w, t, b, _ = margin_inputs(16, 8195, 64, margin, dtype, seed=margin)
    x, w, t, b = (a.to(device) for a in (x, w, t, b))
    loss, ent = flce.linear_cross_entropy(x, w, t, bias=b, reduction="none",
                                          return_entropy=True)
    assert ent.dtype == torch.float32 and ent.shape == t.shape
    x64, w64, b64 = (a.cpu() for a in as_f64(x, w, b))
    ref = flce.reference.linear_cross_entropy(x64, w64, t.cpu(), bias=b64, reduction="none",
                                              return_entropy=True)[1]
    z = fp32_logits(x, w, b).double().cpu()
    ideal = flce.reference.logits_cross_entropy(z, t.cpu(), reduction="none",
                                                return_entropy=True)[1]
    # where H is a normal fp32 number (from margin ~100 it is not; it must then be >= 0, tiny)
    normal = ref > 1e3 * FLT_MIN
    got = ent.detach().cpu().double()
    rel = ((got - ref).abs() / ref)[normal]
    ideal_rel = ((ideal - ref).abs() / ref)[normal]
    print(f"\nmargin {margin} {dtype}: entropy {ref.min().item():.3e}..{ref.max().item():.3e}, "
          f"rel err flce {rel.max().item() if normal.any() else 0:.2e} ideal "
          f"{ideal_rel.max().item() if normal.any() else 0:.2e}")
    if normal.any():
        assert rel.max() <= 2e-6 + 3 * ideal_rel.max(), (rel.max(), ideal_rel.max())
        assert (got[normal] > 0).all(), "the entropy collapsed to 0"
    assert (got >= 0).all() and torch.isfinite(got).all()
    # The textbook form, in fp32 on the same logits, collapses where flce does not.
    if margin >= 30:
        zf = z.float()
        p = torch.softmax(zf, dim=1)
        naive = torch.logsumexp(zf, dim=1) - (p * zf).sum(1)
        assert ((naive.double() - ref).abs() / ref)[normal].max() > 0.5 if normal.any() else True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opts", [
    dict(reduction="none"),
    dict(reduction="mean", temperature=0.7),
    dict(reduction="sum", temperature=1.6, softcap=10.0, label_smoothing=0.1),
    dict(reduction="none", temperature=0.5, z_loss=1e-3, ignore_index=3),
], ids=["plain", "mean-T0.7", "sum-T1.6-softcap-smoothing", "none-T0.5-zloss"])
def test_entropy_and_temperature_gradients(device, dtype, opts):
    x, w, t, b = rand_inputs(200, 2051, 48, dtype, device, seed=41, bias=True, scale=3.0,
                             ignore_frac=0.1, ignore_index=opts.get("ignore_index", -100))
    check_flce(x, w, t, b, return_entropy=True, return_lse=opts["reduction"] == "none", **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_temperature_training_path(device, dtype):
    # mean/sum without per-token outputs: the single pass on the CUDA backend.
    x, w, t, b = rand_inputs(300, 3001, 64, dtype, device, seed=43, bias=True, scale=2.0)
    check_flce(x, w, t, b, reduction="mean", temperature=0.8)
    check_flce(x, w, t, b, reduction="sum", temperature=2.5, softcap=20.0)
    # The option changes the answer by far more than the tolerance.
    plain = flce.linear_cross_entropy(x, w, t, bias=b)
    hot = flce.linear_cross_entropy(x, w, t, bias=b, temperature=0.8)
    assert abs(plain.item() - hot.item()) > 1e-3 * abs(plain.item())


@pytest.mark.parametrize("temperature", [0.05, 0.3])
def test_low_temperature_fp16(device, temperature):
    # The fp16 gradient tile is stored times a power-of-two scale from a bound on |dz| that must
    # include the chain rule's 1/T: missing it, the CUDA tile overflowed to inf at T = 0.05.
    x, w, t, b = rand_inputs(96, 1031, 32, torch.float16, device, seed=59, bias=True, scale=0.5)
    check_flce(x, w, t, b, reduction="none", temperature=temperature, return_entropy=True)
    check_flce(x, w, t, b, reduction="mean", temperature=temperature)


def test_entropy_of_ignored_rows_is_zero_and_gradient_free(device):
    x, w, t, b = rand_inputs(50, 300, 32, torch.float32, device, seed=47, bias=True)
    t[::2] = -100
    xg = x.clone().requires_grad_()
    _, ent = flce.linear_cross_entropy(xg, w, t, bias=b, reduction="none", return_entropy=True)
    assert (ent[::2] == 0).all() and (ent[1::2] > 0).all()
    ent[::2].sum().backward()
    assert torch.equal(xg.grad, torch.zeros_like(xg))


def test_logprob_scoring_saves_nothing(device):
    """Rollout scoring: per-token log-probabilities of the targets are -loss (reduction="none");
    under no_grad the forward keeps no tensors for a backward."""
    x, w, t, _ = rand_inputs(64, 500, 32, torch.bfloat16, device, seed=53)
    with torch.no_grad():
        logp = -flce.linear_cross_entropy(x.requires_grad_(), w, t, reduction="none",
                                          temperature=0.9)
    assert logp.grad_fn is None and logp.shape == t.shape
    z = fp32_logits(x, w).double().cpu() / 0.9
    want = torch.log_softmax(z, dim=1).gather(1, t.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logp.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_temperature_raises(bad):
    x, w, t, _ = rand_inputs(4, 10, 8)
    with pytest.raises(ValueError, match="temperature"):
        flce.linear_cross_entropy(x, w, t, temperature=bad)


def test_entropy_refuses_the_single_pass():
    x, w, t, _ = rand_inputs(4, 10, 8)
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x.requires_grad_(), w, t, return_entropy=True,
                                  single_pass=True)


def test_grpo_example_matches_materialized_logits(device):
    """examples/grpo.py: a GRPO loss from flce's log-probabilities and entropy equals the
    logits-materializing one, loss and every gradient (it returns 0 when they agree)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                        "grpo.py")
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    assert grpo.main(["--device", device, "--vocab", "1024", "--length", "16"]) == 0


@pytest.mark.parametrize("target", [0, 1, 2])
def test_entropy_where_a_non_target_class_dominates(device, target):
    """Logits [32, 8, -10]: H = 9.4378366e-10 whichever class is the target. Where the target
    dominates (0), H >= q = 1 - p_t and the fused kernels are relatively accurate; where another
    class does (1, 2), their error is bounded by a few 2^-24 times q (docs/numerics.md), while the
    composite path (class weights with label smoothing, float64) and the reference pivot on the
    largest non-target logit and stay relatively accurate."""
    z = torch.tensor([[32.0, 8.0, -10.0]])
    exact = 9.437836607578037e-10  # mpmath, 50 digits
    t = torch.tensor([target], device=device)
    q = 1.0 - math.exp(32.0 * (target == 0) + 8.0 * (target == 1) - 10.0 * (target == 2)
                       - math.log(math.exp(32.0) + math.exp(8.0) + math.exp(-10.0)))
    _, h = flce.cross_entropy(z.to(device), t, reduction="none", return_entropy=True)
    bound = 4e-7 * exact if target == 0 else 8 * 2.0 ** -24 * q
    assert abs(h.item() - exact) <= bound, (h.item(), exact)
    # composite paths: relatively accurate whichever class dominates
    for zz, kw in ((z.double(), {}),
                   (z, {"weight": torch.ones(3), "label_smoothing": 0.1})):
        _, h = flce.cross_entropy(zz.to(device), t, reduction="none", return_entropy=True,
                                  **{k: (v.to(device) if torch.is_tensor(v) else v)
                                     for k, v in kw.items()})
        tol = 1e-12 if zz.dtype == torch.float64 else 4e-7
        assert abs(h.item() - exact) <= tol * exact, (kw, h.item(), exact)
