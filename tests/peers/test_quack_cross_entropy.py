"""quack's cross-entropy cases (Dao-AILab/quack tests/test_cross_entropy.py) on
flce.cross_entropy, CPU backend, against float64 (peer_check.run_ce).

quack's ``cross_entropy(x, target, weight=, reduction=, ignore_index=)`` on logits ``(M, N)``
maps one to one; ``cross_entropy_fwd(..., return_lse=True, return_dx=True,
inplace_backward=)``, its forward that also returns the gradient under an upstream of 1, maps
onto flce's ``return_lse`` and ``inplace_backward`` with a backward of the per-token loss
under ones; ``cross_entropy_bwd(x, target, dloss, lse)`` onto a backward with that upstream
gradient. ``lse_partial`` (a precomputed per-128-column lse) has no counterpart. quack's
``use_compile`` runs each case under ``torch.compile(fullgraph=True)`` too: here three cases
(a compile costs seconds on the CPU). Shapes scaled down for the CPU (README.md).
"""
import pytest
import torch

import flce
from helpers import gen
from peer_check import grads_close, run_ce, seed_of

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IGNORE = -100


def scaled(n):
    """quack's vocabularies above 4096 divided by 8 (32768 -> 4096, 128256 -> 16032,
    262144 -> 32768); the smaller ones as they are."""
    return n if n <= 4096 else n // 8


def rows(m):
    """quack's row counts above 32 divided by 8, rounded up to odd (77 -> 11, 289 -> 37)."""
    return m if m <= 32 else (m // 8) | 1


def quack_inputs(m, n, dtype, seed, *, has_weight):
    """quack's inputs: logits 0.1 * randn in ``dtype``, uniform targets, class weights
    rand + 0.1 in fp32."""
    g = gen(seed)
    x = (0.1 * torch.randn(m, n, generator=g, dtype=torch.float64)).to(dtype)
    t = torch.randint(0, n, (m,), generator=g)
    w = (torch.rand(n, generator=g, dtype=torch.float64) + 0.1).float() if has_weight else None
    return x, t, w


def with_ignored(t, seed, frac):
    """About ``frac`` of the targets set to -100 (quack's rand < frac mask)."""
    t = t.clone()
    t[torch.rand(t.shape, generator=gen(seed)) < frac] = IGNORE
    return t


def randn_upstream(seed):
    """quack's dloss: randn (both signs) per token."""
    def objective(out):
        loss = out["loss"]
        u = torch.randn(loss.shape, generator=gen(seed), dtype=torch.float64)
        return (loss * u.to(loss.dtype)).sum()
    return objective


def ones_upstream(out):
    return out["loss"].sum()


def compiled():
    """A fresh torch.compile(fullgraph=True) of flce.cross_entropy (dynamo's caches reset: the
    compiled cases must not run into its recompile limit and fall back to eager)."""
    torch._dynamo.reset()
    return torch.compile(flce.cross_entropy, fullgraph=True)


def check_cross_entropy(m, n, dtype, has_weight, seed, fn=None):
    """Per-token loss and gradient under randn upstream gradients, without and with ~30% of
    the targets ignored."""
    x, t, w = quack_inputs(m, n, dtype, seed, has_weight=has_weight)
    for target in (t, with_ignored(t, seed + 1, 0.3)):
        out, grad = run_ce(x, target, seed=seed, class_weight=w, reduction="none",
                           objective=randn_upstream(seed + 2), fn=fn)
        loss = out["loss"]
        assert loss.shape == (m,) and grad.shape == x.shape
        assert torch.all(loss >= 0)
        ignored = target == IGNORE
        assert torch.all(loss[ignored] == 0) and torch.all(grad[ignored] == 0)


@pytest.mark.parametrize("has_weight", [False, True])
@pytest.mark.parametrize("M", [1, 289])
@pytest.mark.parametrize("N", [192, 668, 1024, 1128, 4096, 32768, 128256, 262144])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(M, N, dtype, has_weight):
    check_cross_entropy(rows(M), scaled(N), dtype, has_weight,
                        seed_of("ce", M, N, dtype, has_weight))


# quack runs every case of its grids compiled too; here one shape of them (a compile costs
# seconds on the CPU)
@pytest.mark.parametrize("has_weight", [False, True])
def test_cross_entropy_compiled(has_weight):
    check_cross_entropy(rows(289), 1024, torch.bfloat16, has_weight,
                        seed_of("ce_compiled", has_weight), fn=compiled())


def test_cross_entropy_lse_partial():
    pytest.skip("quack's lse_partial (a precomputed lse per 128 columns): no flce counterpart")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cross_entropy_extreme_values(dtype):
    """Equal logits (10 or -10: the loss is log N) and one-hot-like rows (the target at 10, the
    others at -10: a loss of about (N - 1) e^-20, held relatively to float64 where
    F.cross_entropy rounds it to 0 or 1e-7's)."""
    m, n = 16, 1024
    s = seed_of("extreme", dtype)
    t = torch.randint(0, n, (m,), generator=gen(s))
    for value in (10.0, -10.0):
        # (float64's loss here is log N to the last bit)
        run_ce(torch.full((m, n), value, dtype=dtype), t, seed=s, reduction="none",
               objective=ones_upstream)
    x = torch.full((m, n), -10.0, dtype=dtype)
    x[torch.arange(m), t] = 10.0
    out, _ = run_ce(x, t, seed=s, reduction="none", objective=ones_upstream)
    assert torch.all(out["loss"] < 1.0)


def test_cross_entropy_numerical_stability():
    """Logits and the same plus 100 (in fp32: a different tensor), each at float64's."""
    m, n = 8, 512
    s = seed_of("stability")
    g = gen(s)
    x = torch.randn(m, n, generator=g, dtype=torch.float64).float()
    t = torch.randint(0, n, (m,), generator=g)
    run_ce(x, t, seed=s, reduction="none")
    run_ce(x + 100.0, t, seed=s, reduction="none")


@pytest.mark.parametrize("target", ["first", "last"])
def test_cross_entropy_edge_targets(target):
    m, n = 16, 1024
    s = seed_of("edge", target)
    x, _, _ = quack_inputs(m, n, torch.float32, s, has_weight=False)
    t = torch.full((m,), 0 if target == "first" else n - 1)
    run_ce(x, t, seed=s, reduction="none")


def test_cross_entropy_ignore_index_edge_cases():
    """Every target ignored (ignore_index=0, targets 0): a zero loss and gradient; none
    ignored (ignore_index=-1); the default -100 on one target."""
    m, n = 16, 1024
    s = seed_of("ignore_edges")
    x, t, _ = quack_inputs(m, n, torch.float32, s, has_weight=False)
    out, grad = run_ce(x, torch.zeros(m, dtype=torch.int64), seed=s, reduction="none",
                       ignore_index=0)
    assert torch.all(out["loss"] == 0) and torch.all(grad == 0)
    run_ce(x, t, seed=s, reduction="none", ignore_index=-1)
    t[0] = IGNORE
    out, grad = run_ce(x, t, seed=s, reduction="none")
    assert out["loss"][0] == 0 and torch.all(grad[0] == 0)


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("has_weight", [False, True])
@pytest.mark.parametrize("M", [1, 77, 289])
@pytest.mark.parametrize("N", [192, 1024, 32768, 128256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_fwd_with_grad(M, N, dtype, has_weight, inplace_backward):
    """quack's cross_entropy_fwd(return_lse=True, return_dx=True): the per-token loss, the lse
    and the gradient under an upstream of ones, without and with ~30% ignored; with
    inplace_backward the gradient takes the logits' storage, without it the logits stay."""
    m, n = rows(M), scaled(N)
    s = seed_of("fwd_with_grad", M, N, dtype, has_weight, inplace_backward)
    x, t, w = quack_inputs(m, n, dtype, s, has_weight=has_weight)
    for target in (t, with_ignored(t, s + 1, 0.3)):
        out, _ = run_ce(x, target, seed=s, class_weight=w, reduction="none", return_lse=True,
                        inplace_backward=inplace_backward, objective=ones_upstream)
        assert out["lse"].shape == (m,)
    logits = x.clone().requires_grad_() * 1
    seen = {}
    logits.register_hook(lambda g: seen.update(ptr=g.data_ptr()))
    before = logits.detach().clone()
    flce.cross_entropy(logits, t, w, reduction="none",
                       inplace_backward=inplace_backward).sum().backward()
    assert (seen["ptr"] == logits.data_ptr()) == inplace_backward
    if not inplace_backward:
        assert torch.equal(logits.detach(), before)


def test_cross_entropy_fwd_empty():
    x = torch.randn(0, 4096, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    t = torch.empty(0, dtype=torch.int64)
    loss, lse = flce.cross_entropy(x, t, reduction="none", return_lse=True)
    assert loss.shape == (0,) and lse.shape == (0,)
    (loss.sum() + lse.sum()).backward()
    assert x.grad.shape == x.shape


def test_cross_entropy_bwd_empty():
    x = torch.randn(0, 4096, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    t = torch.empty(0, dtype=torch.int64)
    loss = flce.cross_entropy(x, t, reduction="none")
    loss.backward(torch.empty(0, dtype=torch.float32))
    assert x.grad.shape == x.shape and x.grad.numel() == 0


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("M", [77, 289])
@pytest.mark.parametrize("N", [1024, 32768, 128256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_weight_reduction(M, N, dtype, reduction, fn=None):
    """Class weights under each reduction (torch's: "mean" divided by the targets' weights)."""
    m, n = rows(M), scaled(N)
    s = seed_of("weight_reduction", M, N, dtype, reduction, fn is None)
    x, t, w = quack_inputs(m, n, dtype, s, has_weight=True)
    # (quack differentiates the reduced losses only)
    run_ce(x, t, seed=s, class_weight=w, reduction=reduction, fn=fn,
           backward=reduction != "none")


def test_cross_entropy_weight_reduction_compiled():
    test_cross_entropy_weight_reduction(289, 1024, torch.float32, "mean", fn=compiled())


def test_cross_entropy_bwd_stride0_dloss():
    """An upstream gradient of stride 0 (a scalar expanded over the tokens), handed to the
    backward directly; ``ones_upstream``'s sum hands one over too."""
    m, n = 77, 1024
    s = seed_of("stride0")
    x, t, _ = quack_inputs(m, n, torch.bfloat16, s, has_weight=False)
    run_ce(x, t, seed=s, reduction="none", objective=ones_upstream)
    leaf = x.clone().requires_grad_()
    dloss = torch.ones((), dtype=torch.float32).expand(m)
    assert dloss.stride() == (0,)
    flce.cross_entropy(leaf, t, reduction="none").backward(dloss)
    z64 = x.double().requires_grad_()
    flce.reference.logits_cross_entropy(z64, t, reduction="none").sum().backward()
    grads_close({"input": leaf}, {"input": z64.grad})
