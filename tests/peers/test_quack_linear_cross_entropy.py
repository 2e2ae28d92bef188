"""quack's linear cross-entropy cases (Dao-AILab/quack tests/test_linear_cross_entropy.py) on
flce.linear_cross_entropy, CPU backend, against float64 (peer_check.run_lce).

quack's ``chunked_linear_cross_entropy(x, weight, target, chunk_size=, ignore_index=,
reduction=, tuned=, use_scaled_exp=)`` and ``scaled_exp_linear_cross_entropy`` map onto
``flce.linear_cross_entropy(x, weight, target, ignore_index=, reduction=)``. ``chunk_size``,
``tuned`` and ``use_scaled_exp`` choose among quack's kernels and have no counterpart (flce
picks its own row chunks): each grid runs once where quack runs it per choice. quack holds its
result to twice the error of bf16 torch against fp32; here every element against float64.
Shapes scaled down for the CPU (README.md): hidden sizes / 4, vocabularies above 2048 / 16,
token counts above 100 / 4.
"""
import pytest
import torch

import flce
from helpers import gen
from peer_check import compare, grads_close, run_lce, seed_of

IGNORE = -100


def scaled_v(v):
    return v if v <= 2048 else v // 16


def scaled_n(n):
    return n if n <= 100 else n // 4


def quack_inputs(n, d, v, seed, *, ignore_frac=0.0, ignore_index=IGNORE, lead=None):
    """quack's inputs: bf16 x ~ 0.1 randn, weight ~ randn / sqrt(d), uniform targets, about
    ``ignore_frac`` of them set to ``ignore_index``."""
    g = gen(seed)
    x = (0.1 * torch.randn(n, d, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore_frac:
        t[torch.rand(n, generator=g) < ignore_frac] = ignore_index
    if lead is not None:
        x, t = x.view(*lead, d), t.view(lead)
    return x, w, t


def loss_only(out):
    return out["loss"]


@pytest.mark.parametrize("B_L", [8, 16, 24])
@pytest.mark.parametrize("d", [768, 1024])
@pytest.mark.parametrize("V", [32000, 50264, 128256])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_linear_cross_entropy(B_L, d, V, reduction):
    s = seed_of("chunked", B_L, d, V, reduction)
    x, w, t = quack_inputs(B_L, d // 4, scaled_v(V), s)
    run_lce(x, w, t, seed=s, reduction=reduction, objective=loss_only)


@pytest.mark.parametrize("B_L", [128, 600, 1024])
@pytest.mark.parametrize("d", [512, 768])
@pytest.mark.parametrize("V", [1536, 2048])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_scaled_exp_linear_cross_entropy(B_L, d, V, reduction):
    """quack's scaled-exp shapes (a ragged last chunk among them), 15% of the targets ignored."""
    s = seed_of("scaled_exp", B_L, d, V, reduction)
    x, w, t = quack_inputs(scaled_n(B_L), d // 4, V, s, ignore_frac=0.15)
    run_lce(x, w, t, seed=s, reduction=reduction, objective=loss_only)


def test_scaled_exp_linear_cross_entropy_batched():
    """(B, L, d) input: the gradients keep the batch shape."""
    s = seed_of("batched")
    x, w, t = quack_inputs(3 * 100, 768 // 4, 1536, s, lead=(3, 100))
    _, leaves = run_lce(x, w, t, seed=s, objective=loss_only)
    assert leaves["input"].grad.shape == x.shape


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_chunked_linear_cross_entropy_torch_compile(reduction):
    """torch.compile(fullgraph=True) of the loss: compiled and eager each at float64's, their
    gradients bitwise equal (quack asks it of the sum's, and the mean's within 1e-2 relative).
    The loss is not asked to be bitwise eager's: the compiled sum's was measured 2 ulp off,
    both at float64's."""
    s = seed_of("compile", reduction)
    x, w, t = quack_inputs(256, 512 // 4, 2048, s)
    t[::7] = IGNORE

    def loss(x, w):
        # (exact math: the rounded bf16 gradient tile has its own bound, peer_check.run_lce)
        return flce.linear_cross_entropy(x, w, t, reduction=reduction, exact_bf16_grad=True)

    torch._dynamo.reset()
    x64, w64 = (a.double().requires_grad_() for a in (x, w))
    ref = flce.reference.linear_cross_entropy(x64, w64, t, reduction=reduction)
    ref.backward()
    results = []
    for fn in (torch.compile(loss, fullgraph=True), loss):
        leaves = {"input": x.clone().requires_grad_(), "weight": w.clone().requires_grad_()}
        out = fn(leaves["input"], leaves["weight"])
        compare({"loss": out}, {"loss": ref.detach()}, dtype_in=x.dtype, names=["loss"])
        out.backward()
        grads_close(leaves, {"input": x64.grad, "weight": w64.grad})
        results.append((out.detach(), leaves["input"].grad, leaves["weight"].grad))
    for compiled, eager in zip(results[0][1:], results[1][1:]):
        assert torch.equal(compiled, eager)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_linear_cross_entropy_ignore_index(reduction):
    """A class id as the ignore index (V - 1), about 20% of the targets set to it."""
    s = seed_of("ignore", reduction)
    v = 2048
    x, w, t = quack_inputs(scaled_n(1024), 512 // 4, v, s, ignore_frac=0.2, ignore_index=v - 1)
    run_lce(x, w, t, seed=s, reduction=reduction, ignore_index=v - 1, objective=loss_only)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_linear_cross_entropy_no_grad(reduction):
    """The loss under no_grad (and with nothing requiring grad) at float64's, as the training
    call's, and not requiring grad."""
    s = seed_of("no_grad", reduction)
    x, w, t = quack_inputs(scaled_n(1024), 512 // 4, 2048, s)
    run_lce(x, w, t, seed=s, reduction=reduction, objective=loss_only)
    with torch.no_grad():
        out, _ = run_lce(x, w, t, seed=s, reduction=reduction, objective=loss_only)
    assert not out["loss"].requires_grad
    out, _ = run_lce(x, w, t, seed=s, reduction=reduction, requires=())
    assert not out["loss"].requires_grad


@pytest.mark.parametrize("frozen", ["input", "weight"])
def test_chunked_linear_cross_entropy_partial_grad(frozen):
    """One of x and weight frozen: it gets no gradient, the other its float64 one."""
    s = seed_of("partial", frozen)
    x, w, t = quack_inputs(scaled_n(1024), 512 // 4, 2048, s)
    requires = [k for k in ("input", "weight") if k != frozen]
    _, leaves = run_lce(x, w, t, seed=s, requires=requires, objective=loss_only)
    assert leaves[frozen].grad is None
