"""exact_bf16_grad: how bf16 inputs' gradients are computed, each mode held to its own bound.

The CPU backend (csrc/cpu/tile_gemm.h bf16_grad) multiplies a bf16 gradient tile as "rounded"
(once to bf16, bf16 GEMMs: dE and dW within 1.5x bf16's rounding floor, norm-wise, the CUDA
backend's contract), "split" (hi + lo bf16 tiles) or "widened" (fp32 GEMMs), the last two at the
floor. Its default is rounded wherever bf16 GEMMs run natively (AMX, AVX512-BF16:
build_info()["cpu_bf16_native"]) and widened elsewhere; True is split on AMX and widened
elsewhere, and FLCE_CPU_BF16_EXACT=split|widened picks either on any CPU, which is how a CPU
without AMX runs the split here. False is rounded on any CPU. The CUDA backend rounds once and
refuses True for bf16. tests/cpu/test_cpu_gemm.py runs these tests with native bf16 held off
where this CPU has it.
"""
import functools

import pytest
import torch

import flce
from helpers import (check_flce, rand_inputs, ref_loss_grads, rel_err, round_floor,
                     rounds_grad_tile)

BF = torch.bfloat16
# mode -> (exact_bf16_grad, FLCE_CPU_BF16_EXACT)
MODES = {"default": (None, None), "rounded": (False, None), "split": (True, "split"),
         "widened": (True, "widened")}


@pytest.fixture(params=list(MODES))
def mode(request, monkeypatch):
    exact, impl = MODES[request.param]
    if impl is None:
        monkeypatch.delenv("FLCE_CPU_BF16_EXACT", raising=False)
    else:
        monkeypatch.setenv("FLCE_CPU_BF16_EXACT", impl)
    return request.param, exact


def test_the_rule(monkeypatch):
    """One rule (cpu::bf16_grad), as build_info reports it: the default rounds once wherever
    bf16 GEMMs run natively, AMX or not; the exact mode splits on AMX alone."""
    monkeypatch.delenv("FLCE_CPU_BF16_EXACT", raising=False)
    amx, native = (flce.build_info()[k] for k in ("cpu_amx", "cpu_bf16_native"))
    assert native or not amx
    grad = torch.ops.flce.cpu_bf16_grad
    assert grad(None) == ("rounded" if native else "widened")
    assert grad(True) == ("split" if amx else "widened")
    assert grad(False) == "rounded"
    info = flce.build_info()
    assert (info["cpu_bf16_grad"], info["cpu_bf16_grad_exact"]) == (grad(None), grad(True))
    for impl in ("split", "widened"):
        monkeypatch.setenv("FLCE_CPU_BF16_EXACT", impl)
        assert (grad(None), grad(True), grad(False)) == (
            "rounded" if native else "widened", impl, "rounded")
    monkeypatch.setenv("FLCE_CPU_BF16_EXACT", "fast")
    x, w, t, _ = rand_inputs(8, 40, 16, BF, seed=1)
    with pytest.raises(ValueError, match="FLCE_CPU_BF16_EXACT must be 'split' or 'widened'"):
        flce.linear_cross_entropy(x.requires_grad_(), w, t, exact_bf16_grad=True).backward()


# Rows split (N < V) and vocabulary split (N >= V) among the workers; 16-bit tiles are 1024 rows
# by 2048 columns, so both shapes cross tile edges.
SHAPES = {"rows-split": (1100, 2300, 48), "vocab-split": (2100, 1500, 48)}
OPTS = {
    "plain": dict(),
    "options": dict(bias=True, softcap=20.0, label_smoothing=0.1, z_loss=1e-3, ignore=0.2,
                    temperature=0.7),
    # fp32 master weights: an fp32 dW, held to fp32's bound in every mode (the rounded mode
    # multiplies hi + lo for dW, as the CUDA backend does)
    "master": dict(weight_dtype=torch.float32, bias=True),
}


@pytest.mark.parametrize("single_pass", [True, False], ids=["single-pass", "recompute"])
@pytest.mark.parametrize("opts", list(OPTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_mode_against_float64(mode, shape, opts, single_pass):
    """Every gradient element within the output rounding of its mode's ideal (the rounded
    tile's, helpers.tile_ideal_grads, or the float64 reference), and norm-wise within the
    mode's bound (1.1x the rounded tile's error, or GRAD_NORM_FACTOR of the floor)."""
    name, exact = mode
    n, v, d = SHAPES[shape]
    o = dict(OPTS[opts])
    x, w, t, b = rand_inputs(n, v, d, BF, seed=len(name) + n, scale=6.0,
                             bias=o.pop("bias", False), ignore_frac=o.pop("ignore", 0.0),
                             weight_dtype=o.pop("weight_dtype", None))
    if single_pass:
        check_flce(x, w, t, b, single_pass=True, exact_bf16_grad=exact, **o)
    else:
        check_flce(x, w, t, b, return_lse=True, return_entropy=True, exact_bf16_grad=exact, **o)


@functools.lru_cache(maxsize=1)
def _long_case():
    """N = 65536 tokens, V = 2048, D = 64, logits of std 8, and the float64 dE and dW."""
    x, w, t, _ = rand_inputs(65536, 2048, 64, BF, seed=9, scale=8.0)
    _, _, ref_x, ref_w, _ = ref_loss_grads(x, w, t)
    return (x, w, t), (ref_x, ref_w)


@pytest.mark.parametrize("single_pass", [True, False], ids=["single-pass", "recompute"])
def test_each_mode_to_its_bound(mode, single_pass):
    """A long sequence whose logits have std 8 (p_j far from uniform: the non-target terms of
    dE and dW weigh as much as the target's, so the tile's rounding shows; at std 1 the target
    term dominates and every mode is at the floor): rounded once, dE and dW within 1.5x bf16's
    rounding floor, and dE measurably above it (the mode is the one asked for; dW sums N rows'
    independent roundings, which average out to ~1.02x); exact, at the floor."""
    name, exact = mode
    (x, w, t), refs = _long_case()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    flce.linear_cross_entropy(xg, wg, t, single_pass=single_pass,
                              exact_bf16_grad=exact).backward()
    de, dw = (rel_err(g, r) / round_floor(r, BF) for g, r in zip((xg.grad, wg.grad), refs))
    print(f"\n{name} (exact_bf16_grad={exact}, {torch.ops.flce.cpu_bf16_grad(exact)}): "
          f"dE {de:.3f}x, dW {dw:.3f}x the floor")
    if rounds_grad_tile(x, exact):
        assert 1.05 <= de <= 1.5 and dw <= 1.5, (de, dw)
    else:
        assert de <= 1.01 and dw <= 1.01, (de, dw)


def test_modules_and_entry_points_pass_it_on(monkeypatch):
    """LinearCrossEntropy(exact_bf16_grad=...) and the recompute path's backward get the
    argument: their gradients are the functional call's, bit for bit, and rounded differs from
    exact."""
    monkeypatch.delenv("FLCE_CPU_BF16_EXACT", raising=False)
    x, w, t, _ = rand_inputs(600, 900, 32, BF, seed=4, scale=8.0)

    def grads(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xg, wg).backward()
        return xg.grad, wg.grad

    for single_pass in (True, False):
        got = {}
        for exact in (False, True):
            f = grads(lambda a, b: flce.linear_cross_entropy(a, b, t, exact_bf16_grad=exact,
                                                             single_pass=single_pass))
            m = grads(lambda a, b: flce.LinearCrossEntropy(
                exact_bf16_grad=exact, single_pass=single_pass)(a, b, t))
            assert all(torch.equal(p, q) for p, q in zip(f, m))
            got[exact] = f
        assert not torch.equal(got[False][0], got[True][0])


def test_split_and_widened_both_run(monkeypatch):
    """FLCE_CPU_BF16_EXACT reaches the kernel: the fp32 deferred gradients of the two exact
    implementations differ in their last bits (hi + lo carries ~16 mantissa bits, not 24),
    while both round to the same bf16 gradient almost everywhere."""
    x, w, t, _ = rand_inputs(300, 700, 32, BF, seed=8, scale=4.0)
    out = {}
    for impl in ("split", "widened"):
        monkeypatch.setenv("FLCE_CPU_BF16_EXACT", impl)
        out[impl] = flce.ops.sum_and_grad(x, w, t, None, -100, 0.0, 0.0, 0.0, [True, True, False],
                                          True, exact_bf16_grad=True)[2:4]
    for a, b in zip(out["split"], out["widened"]):
        assert not torch.equal(a, b)
        assert rel_err(a, b.double()) < 1e-4


@pytest.mark.parametrize("bad", ["yes", 2, 0.5])
def test_bad_values_name_the_argument(bad):
    x, w, t, _ = rand_inputs(8, 40, 16, BF, seed=2)
    with pytest.raises(TypeError, match="exact_bf16_grad must be None, True or False"):
        flce.linear_cross_entropy(x, w, t, exact_bf16_grad=bad)
    with pytest.raises(TypeError, match="exact_bf16_grad must be None, True or False"):
        flce.LinearCrossEntropy(exact_bf16_grad=bad)


def test_cuda_backend_refuses_exact(device):
    """The CUDA backend rounds bf16 gradient tiles once and has no exact mode: True raises for
    bf16 inputs (the API, and the op itself), False and None take its one mode, and fp32 or
    fp16 inputs, which the argument does not concern, ignore it."""
    x, w, t, _ = rand_inputs(24, 90, 16, BF, device, seed=3)
    if not flce._ops.is_cuda_backend(x):
        pytest.skip("the CPU backend has the exact mode (the tests above)")
    with pytest.raises(ValueError, match="exact_bf16_grad=True: the CUDA backend"):
        flce.linear_cross_entropy(x, w, t, exact_bf16_grad=True)
    with pytest.raises(ValueError, match="exact_bf16_grad=True: the CUDA backend"):
        flce._ops.ops.sum_and_grad(x, w, t, None, -100, 0.0, 0.0, 0.0, [True, True, False],
                                   True, exact_bf16_grad=True)
    check_flce(x, w, t, exact_bf16_grad=False)
    check_flce(x.float(), w.float(), t, exact_bf16_grad=True)
