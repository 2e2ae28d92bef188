"""Accuracy against float64 flce.reference, measured against the ideal fp32 computation.

Collapse margins: every row has target margin z_t - max_{j != t} z_j = m (helpers.margin_inputs).
Long sequences: N = 65536 tokens, gradients compared with the ideal (fp32 logits and
probabilities, exact accumulation, one rounding).
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import flce
from helpers import (DEVICES, TORCH_LCE, ideal_fp32_loss, ideal_grads, margin_inputs,
                     rand_inputs, ref_loss_grads, rel_err, round_floor, rounds_grad_tile)

MARGINS = [0, 5, 10, 20, 30, 50, 100, 200]
MARGIN_V, MARGIN_D, MARGIN_N = 32771, 64, 16
# Below fp32's normal range the loss is only representable to the subnormal spacing.
FP32_SUBNORMAL = 2.0 ** -149
# The issue's measured ideal (V=32771, D=64, fp32): loss relative error at a margin.
ISSUE_IDEAL = {20: 5e-7, 50: 4e-6, 200: 3e-5}


def _row_rel_errs(x, ref):
    x, ref = x.detach().cpu().double(), ref.detach().cpu().double()
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


def _row_floors(ref, dtype):
    return _row_rel_errs(ref.to(dtype), ref)


@functools.lru_cache(maxsize=None)
def _margin_case(dtype, margin):
    """CPU inputs, float64 reference (loss, lse, dE, dC, db) and the ideal fp32 per-row loss."""
    x, w, t, b, _ = margin_inputs(MARGIN_N, MARGIN_V, MARGIN_D, margin, dtype, seed=margin)
    ref = ref_loss_grads(x, w, t, b, reduction="none")
    return (x, w, t, b), ref, ideal_fp32_loss(x, w, t, b)


def _ideal_err(dtype, margin):
    """Ideal fp32 loss error: max over rows of |ideal - ref| / ref."""
    _, ref, ideal = _margin_case(dtype, margin)
    return ((ideal - ref[0]).abs() / ref[0]).max().item()


# (dtype, exact_bf16_grad): bf16 in its default mode and in both explicit ones (rounded once,
# exact), whichever the CPU's default is (docs/numerics.md "bf16 gradients").
MARGIN_MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
                "bf16-rounded": (torch.bfloat16, False), "bf16-exact": (torch.bfloat16, True)}


@pytest.mark.parametrize("mode", list(MARGIN_MODES))
@pytest.mark.parametrize("margin", MARGINS)
def test_collapse_margin(device, mode, margin):
    dtype, exact = MARGIN_MODES[mode]
    inputs, (ref_loss, _, ref_gx, _, ref_gb), _ = _margin_case(dtype, margin)
    x, w, t, b = (a.to(device) for a in inputs)
    if exact and flce._ops.is_cuda_backend(x):
        pytest.skip("the CUDA backend has no exact bf16 mode (test_bf16_grad.py)")
    xg = x.clone().requires_grad_()
    bg = b.clone().requires_grad_()
    loss = flce.linear_cross_entropy(xg, w, t, bias=bg, reduction="none", exact_bf16_grad=exact)
    loss.sum().backward()

    ideal = _ideal_err(dtype, margin)
    abs_err = (loss.detach().cpu().double() - ref_loss).abs()
    raw = (abs_err / ref_loss).max().item()
    worst = ((abs_err - FP32_SUBNORMAL).clamp(min=0) / ref_loss).max().item()
    print(f"\nmargin {margin} {dtype}: loss rel err flce {raw:.2e} ({worst:.2e} beyond one "
          f"subnormal ulp), ideal fp32 {ideal:.2e}, ref loss "
          f"{ref_loss.min().item():.2e}..{ref_loss.max().item():.2e}")
    assert worst <= 1e-7 + 3 * ideal
    representable = ref_loss >= FP32_SUBNORMAL
    assert (loss.detach().cpu()[representable] > 0).all(), "flce collapsed"

    if margin <= 50:  # beyond, e^-margin gradients approach fp32 subnormals
        _check_margin_grads(xg.grad, bg.grad, ref_gx, ref_gb, int(t[0]), dtype, margin, exact)


@functools.lru_cache(maxsize=None)
def _tile_ideal_gx(dtype, margin):
    """The best input gradient of the CUDA backend's algorithm: dE from the gradient tile rounded
    once to the 16-bit compute dtype, except the target entry, which it corrects in fp32
    (target_fix_kernel), with exact products and one final rounding. It adds the tile's rounding
    to dE's own: where the row's terms cancel (the non-target mass against the target's), more
    than the floor (measured up to 1.31x per row at margin 20, ~1.01x on average). The CPU
    backend rounds its bf16 tile the same way where it rounds once (helpers.rounds_grad_tile),
    and stays at the floor otherwise."""
    (x, w, t, b), *_ = _margin_case(dtype, margin)
    x64, w64 = x.double(), w.to(dtype).double()
    z = (x64 @ w64.T + b.double()).requires_grad_()
    flce.reference.logits_cross_entropy(z, t, reduction="sum").backward()
    dz = z.grad
    hi = dz.to(dtype).double()
    rows = torch.arange(dz.shape[0])
    hi[rows, t] = dz[rows, t]
    return (hi @ w64).to(dtype)


def _check_margin_grads(gx, gb, ref_gx, ref_gb, tcol, dtype, margin, exact_bf16_grad=None):
    gt_err = rel_err(gb[tcol], ref_gb[tcol])
    gx_err = _row_rel_errs(gx, ref_gx)
    gx_floor = _row_floors(ref_gx, dtype)
    print(f"  target-grad rel err {gt_err:.2e}; input-grad row rel err max "
          f"{gx_err.max().item():.2e} (rounding floor {gx_floor.max().item():.2e})")
    assert gt_err <= 1e-5
    if rounds_grad_tile(gx, exact_bf16_grad):
        ideal = _row_rel_errs(_tile_ideal_gx(dtype, margin), ref_gx)
        print(f"  16-bit tile ideal / floor: max {(ideal / gx_floor).max().item():.3f}")
        assert (gx_err <= 1e-5 + 1.1 * ideal).all()
        assert (ideal <= 1.5 * gx_floor).all()  # what the 3-GEMM design costs (docs/cuda.md)
    else:
        assert (gx_err <= 1e-5 + 1.1 * gx_floor).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("margin", [60, 70, 80])
def test_collapse_margin_grads_near_underflow(device, dtype, margin):
    """Margins 60-80: every gradient element is still a normal fp32 (and bf16) number
    (|dE| ~ 1e-25..1e-33 > 1.2e-38) and the ideal fp32 computation keeps ~3e-6, but the
    non-target probabilities exp(z_j - lse) fall below e^-87.3 for the lower columns: an exp
    that flushes there instead of returning subnormals loses their share of dE."""
    inputs, (_, _, ref_gx, _, ref_gb), _ = _margin_case(dtype, margin)
    x, w, t, b = (a.to(device) for a in inputs)
    assert ref_gx.abs().max() > 1e3 * torch.finfo(torch.float32).tiny
    xg, bg = x.clone().requires_grad_(), b.clone().requires_grad_()
    flce.linear_cross_entropy(xg, w, t, bias=bg, reduction="none").sum().backward()
    _check_margin_grads(xg.grad, bg.grad, ref_gx, ref_gb, int(t[0]), dtype, margin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_margin_ideal_is_sane(dtype):
    """The yardstick itself: of the order the issue measured, and growing with the margin.

    (The issue's 5e-9 at margin 5 is below one fp32 ulp of an O(1) loss, so it cannot be a
    per-row error; it is not checked. Ours: ~4e-7 at margin 5, ~1e-6 at 20, ~2e-6 at 50,
    ~8e-6 at 200.)"""
    ideal = {m: _ideal_err(dtype, m) for m in MARGINS}
    for m, issue in ISSUE_IDEAL.items():
        assert issue / 10 <= ideal[m] <= issue * 10, (m, ideal)
    assert ideal[200] > 3 * ideal[5]
    assert all(v < 1e-4 for v in ideal.values()), ideal


@pytest.mark.parametrize("margin", [30, 50])
def test_torch_cross_entropy_collapses(margin):
    """Documents the peers' failure: fp32 logits + F.cross_entropy (and torch's fused
    F.linear_cross_entropy) return exactly 0 loss and exactly 0 target gradient from margin
    30, while the other columns' gradients stay nonzero; flce stays within the yardstick."""
    (x, w, t, b), (ref_loss, *_), _ = _margin_case(torch.float32, margin)
    logits = (x @ w.T + b).requires_grad_()
    ce = F.cross_entropy(logits, t, reduction="none")
    ce.sum().backward()
    assert (ce == 0).all()
    assert (logits.grad[:, t[0]] == 0).all()
    assert (logits.grad.abs().sum(1) > 0).all()
    if TORCH_LCE:
        assert (F.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none") == 0).all()
    ours = flce.linear_cross_entropy(x, w, t, bias=b, reduction="none")
    assert (ours > 0).all()
    assert ((ours.double() - ref_loss).abs() / ref_loss).max() < 1e-4


# ---------------------------------------------------------------------------------------------
# Long sequences
# ---------------------------------------------------------------------------------------------
LONG_N, LONG_V, LONG_D = 65536, 2048, 64


# The CPU backend's bf16 modes (exact_bf16_grad, csrc/cpu/tile_gemm.h bf16_grad) beside its
# default: rounded once, and the exact split, which FLCE_CPU_BF16_EXACT runs on CPUs without AMX.
BF16_MODES = {"default": (None, None), "rounded": (False, None), "split": (True, "split")}


@functools.lru_cache(maxsize=None)
def _long_ideal(dtype):
    x, w, t, _ = rand_inputs(LONG_N, LONG_V, LONG_D, dtype, "cpu", seed=11)
    return ideal_grads(x, w, t, out_dtype=dtype, scale=1.0 / LONG_N)


# Not on "cuda-host": a module-scoped fixture is set up before the function-scoped routing to the
# emulated backend (conftest.py), so that case ran the CPU backend under the emulation's name;
# and 65536 rows through the emulated row kernels would be too slow for CI. The emulation's
# accuracy at this length is the kernels' (the same code), which tests/cuda/test_cuda.py checks.
@pytest.fixture(scope="module", params=[
    pytest.param((dev.values[0], dt, mode), id=f"{dev.id}-{name}" + (
        "" if mode == "default" else f"-{mode}"), marks=dev.marks)
    for dev in DEVICES if dev.id != "cuda-host"
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    for mode in (BF16_MODES if dt == torch.bfloat16 and dev.id == "cpu" else ("default",))])
def long_run(request):
    """flce, torch eager (logits + F.cross_entropy in the input dtype) and the ideal, once."""
    device, dtype, mode = request.param
    exact, impl = BF16_MODES[mode]
    x, w, t, _ = rand_inputs(LONG_N, LONG_V, LONG_D, dtype, device, seed=11)
    res = {"dtype": dtype, "rounded": rounds_grad_tile(x, exact)}
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as mp:
        if impl is not None:
            mp.setenv("FLCE_CPU_BF16_EXACT", impl)
        flce.linear_cross_entropy(xg, wg, t, exact_bf16_grad=exact).backward()
    res["flce"] = (xg.grad.cpu(), wg.grad.cpu())
    del xg, wg
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.cross_entropy(xe @ we.T, t).backward()
    res["eager"] = (xe.grad.cpu(), we.grad.cpu())
    del xe, we
    res.update(_long_ideal(dtype))
    ratios = {}
    for k, name in ((0, "dE"), (1, "dC")):
        ref = res["ref_" + name]
        ideal = rel_err(res["ideal_" + name], ref)
        ratios[name] = {"flce/ideal": rel_err(res["flce"][k], ref) / ideal,
                        "eager/ideal": rel_err(res["eager"][k], ref) / ideal,
                        "ideal/floor": ideal / round_floor(ref, dtype),
                        "flce/floor": rel_err(res["flce"][k], ref) / round_floor(ref, dtype),
                        "flce": rel_err(res["flce"][k], ref), "ideal": ideal}
    res["ratios"] = ratios
    print(f"\nlong sequence {device} {dtype} {mode}: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items())
        for name, r in ratios.items()))
    return res


@pytest.mark.parametrize("grad", ["dE", "dC"])
def test_long_sequence_gradients(long_run, grad):
    """Within 1.5x the ideal; bf16 gradients from a tile rounded once within 1.5x the rounding
    floor (the CUDA backend's contract, docs/numerics.md), and at the floor otherwise (today's
    bound: within 1.1x it, as the ideal)."""
    r = long_run["ratios"][grad]
    assert r["flce/ideal"] <= 1.5, r
    if long_run["dtype"] == torch.bfloat16:
        assert r["flce/floor"] <= (1.5 if long_run["rounded"] else 1.1), r


@pytest.mark.parametrize("grad", ["dE", "dC"])
def test_long_sequence_beats_eager(long_run, grad):
    r = long_run["ratios"][grad]
    assert r["flce/ideal"] < r["eager/ideal"], r


def test_long_sequence_ideal_is_sane(long_run):
    """The ideal is near the rounding floor: within 1.1x for bf16 outputs; a few times it for
    fp32 outputs, where fp32 logits already carry rounding error (issue: 1.3x dC, 2.1x dE)."""
    for grad in ("dE", "dC"):
        r = long_run["ratios"][grad]["ideal/floor"]
        if long_run["dtype"] == torch.bfloat16:
            assert 1.0 <= r <= 1.1, (grad, r)
        else:
            assert 1.05 <= r <= 4.0, (grad, r)
