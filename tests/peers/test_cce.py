"""Cut Cross Entropy's cases (apple/ml-cross-entropy tests/test_cce_loss_forward.py,
test_cce_loss_backward.py, test_cce_lse.py, test_compute_z_loss.py, test_vocab_parallel.py) on
flce.linear_cross_entropy and flce.parallel.vocab_parallel_linear_cross_entropy, CPU backend,
against float64 (peer_check.run_lce).

CCE's linear_cross_entropy(e, c, targets, bias=, ignore_index=, softcap=, reduction=, shift=,
return_lse=) maps one to one (docs/api.md). Its impl ("cce", "torch_compile", "cce_exact") and
the options behind them (filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad)
have no counterpart: flce has one implementation per backend, never filters a gradient and
accumulates in fp32, the stance of "cce_exact", which is what float64 holds it to here. So each
grid runs once where CCE runs it per impl. CCE's shapes are CPU-sized already; its
vocab-parallel grid runs on 4 gloo ranks (tests/dist_launch.py), this file being their script.
"""
import sys

import pytest
import torch

from helpers import LOSS_FACTOR, gen
from peer_check import grads_close, compare, ref_outputs, run_lce, seed_of

IGNORE = -100
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(256, 512, 128), (252, 507, 128), (252, 507, 123)]


def cce_inputs(shape, dtype, seed, *, bias_scale, invalids):
    """CCE's inputs: e ~ randn / sqrt(D), c ~ randn, the first min(N, V) / 2 classifier rows
    equal to input rows (large logits on their own class), bias ~ randn * bias_scale, 20% of
    the targets ignored when ``invalids``; e as (4, N / 4, D) and targets as (4, N / 4)."""
    n, v, d = shape
    g = gen(seed)
    e = (torch.randn(n, d, generator=g, dtype=torch.float64) / d ** 0.5).to(dtype)
    c = torch.randn(v, d, generator=g, dtype=torch.float64).to(dtype)
    c[:min(n, v) // 2] = e[:min(n, v) // 2]
    b = (torch.randn(v, generator=g, dtype=torch.float64) * bias_scale).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if invalids:
        t[torch.randperm(n, generator=g)[:int(0.2 * n)]] = IGNORE
    return e.view(4, -1, d), c, b, t.view(4, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shift", [0, 2])
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_loss_forward(dtype, softcap, has_bias, shift, invalids, shape):
    s = seed_of("forward", dtype, softcap, has_bias, shift, invalids, shape)
    e, c, b, t = cce_inputs(shape, dtype, s, bias_scale=0.01, invalids=invalids)
    out, _ = run_lce(e, c, t, b if has_bias else None, seed=s, softcap=softcap, shift=shift,
                     reduction="none", requires=())
    # CCE's shape with a shift: the positions that have a target
    assert out["loss"].shape == (4, e.shape[1] - shift)


def cce_objective(reduction, z_loss, targets):
    """CCE's backward test: the loss ("sum" divided by the valid count), its mean, plus with
    z_loss CCE's compute_z_loss of the returned lse (mean of lse^2 over the valid tokens)."""
    valid = targets != IGNORE

    def objective(out):
        loss = out["loss"]
        if reduction == "sum":
            loss = loss / valid.sum()
        loss = loss.mean()
        if z_loss:
            lse = out["lse"]
            loss = loss + torch.where(valid, lse * lse, 0.0).sum() / valid.sum()
        return loss
    return objective


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("z_loss", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_loss_backward(dtype, softcap, has_bias, shift, invalids, reduction, z_loss, shape):
    s = seed_of("backward", dtype, softcap, has_bias, shift, invalids, reduction, z_loss, shape)
    e, c, b, t = cce_inputs(shape, dtype, s, bias_scale=0.02, invalids=invalids)
    ts = t[..., 1:] if shift else t
    out, _ = run_lce(e, c, t, b if has_bias else None, seed=s, softcap=softcap,
                     shift=int(shift), reduction=reduction, return_lse=z_loss,
                     objective=cce_objective(reduction, z_loss, ts))
    assert ("lse" in out) == z_loss


@pytest.mark.parametrize("compute_de, compute_dc, compute_dbias",
                         [(True, False, True), (False, True, False), (False, False, True)])
def test_loss_partials(compute_de, compute_dc, compute_dbias):
    """Only the leaves that require grad get one."""
    s = seed_of("partials", compute_de, compute_dc, compute_dbias)
    e, c, b, t = cce_inputs((256, 512, 128), torch.bfloat16, s, bias_scale=0.01,
                            invalids=False)
    requires = [k for k, on in (("input", compute_de), ("weight", compute_dc),
                                ("bias", compute_dbias)) if on]
    _, leaves = run_lce(e, c, t, b, seed=s, reduction="mean", requires=requires)
    for name, leaf in leaves.items():
        assert (leaf.grad is not None) == (name in requires), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shape", [(256, 512, 128), (255, 507, 128), (255, 507, 123)])
def test_lse(dtype, softcap, has_bias, shape):
    """CCE's lse kernel: flce's return_lse (one row of e per token)."""
    s = seed_of("lse", dtype, softcap, has_bias, shape)
    n, v, d = shape
    g = gen(s)
    e = (torch.randn(n, d, generator=g, dtype=torch.float64) / d ** 0.5).to(dtype)
    c = torch.randn(v, d, generator=g, dtype=torch.float64).to(dtype)
    c[:min(n, v) // 2] = e[:min(n, v) // 2]
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.02).to(dtype) if has_bias else None
    t = torch.randint(0, v, (n,), generator=g)
    out, _ = run_lce(e, c, t, b, seed=s, softcap=softcap, return_lse=True, requires=())
    assert out["lse"].shape == (n,)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("invalids", [False, True])
def test_compute_z_loss(reduction, shift, invalids):
    """CCE's compute_z_loss (lse^2 over the valid tokens after the shift, reduced): flce's
    z_loss=1 with return_z_loss, the z-loss part reduced as the loss."""
    s = seed_of("z_loss", reduction, shift, invalids)
    e, c, b, t = cce_inputs((40, 64, 32), torch.float32, s, bias_scale=0.02, invalids=False)
    if invalids:
        # CCE's: every target ignored but two
        keep = t.view(-1)[[3, 5]].clone()
        t.fill_(IGNORE)
        t.view(-1)[[3, 5]] = keep
    out, _ = run_lce(e, c, t, b, seed=s, shift=int(shift), reduction=reduction, z_loss=1.0,
                     return_z_loss=True, return_lse=True)
    lse = out["lse"].detach().double()
    ts = t[..., 1:] if shift else t
    valid = ts != IGNORE
    z = torch.where(valid, lse * lse, 0.0)
    want = {"none": z, "sum": z.sum(), "mean": z.sum() / valid.sum()}[reduction]
    # (float32 sums of the squares: LOSS_FACTOR roundings, as the loss)
    torch.testing.assert_close(out["z_loss"].double(), want,
                               rtol=LOSS_FACTOR * torch.finfo(torch.float32).eps, atol=0)


# CCE's test_vocab_parallel: 4 ranks, torch_compile and cce_exact (one flce), fp16 / bf16,
# invalids, z_loss (CCE's compute_z_loss of the returned lse added to the loss)
VP_WORLD = 4
VP_GRID = [(dtype, invalids, z_loss) for dtype in (torch.float16, torch.bfloat16)
           for invalids in (False, True) for z_loss in (True, False)]


def test_vocab_parallel():
    from dist_launch import run_checked

    run_checked(__file__, VP_WORLD, timeout=180.0)


def vocab_range(v, rank, world):
    """CCE's partition of the vocabulary (partition_n_into_range): the first v % world ranks
    one row more, in rank order (flce's default layout)."""
    start = rank * (v // world) + min(rank, v % world)
    return start, start + v // world + (1 if rank < v % world else 0)


def vocab_parallel_case(rank, world, dtype, invalids, z_loss):
    import flce.parallel

    n, v, d = 252, 507, 123
    s = seed_of("vocab_parallel", dtype, invalids, z_loss)
    g = gen(s)  # the same inputs on every rank
    e = (torch.randn(n, d, generator=g, dtype=torch.float64) / d ** 0.5).to(dtype)
    c = torch.randn(v, d, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    if invalids:
        t[torch.randperm(n, generator=g)[:int(0.2 * n)]] = IGNORE
    e, t = e.view(4, -1, d), t.view(4, -1)
    start, stop = vocab_range(v, rank, world)
    leaves = {"input": e.clone().requires_grad_(), "weight": c[start:stop].clone().requires_grad_()}
    out = flce.parallel.vocab_parallel_linear_cross_entropy(
        leaves["input"], leaves["weight"], t, return_lse=z_loss)
    x64, c64 = e.double().requires_grad_(), c.double().requires_grad_()
    ref = ref_outputs(x64.reshape(n, d) @ c64.T, t.reshape(-1))
    ref["lse"] = ref["lse"].reshape(t.shape)
    got = {"loss": out[0], "lse": out[1]} if z_loss else {"loss": out}
    compare(got, ref, dtype_in=dtype, names=list(got))
    valid = t != IGNORE

    def objective(o):
        if not z_loss:
            return o["loss"]
        return o["loss"] + torch.where(valid, o["lse"] ** 2, 0.0).sum() / valid.sum()

    objective(got).backward()
    objective(ref).backward()
    grads_close(leaves, {"input": x64.grad, "weight": c64.grad[start:stop]})


def _worker_main():
    from dist_launch import finish_worker, init_worker

    rank, world = init_worker()
    for case in VP_GRID:
        vocab_parallel_case(rank, world, *case)
    print("ALL CHECKS PASSED")
    finish_worker()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main()
