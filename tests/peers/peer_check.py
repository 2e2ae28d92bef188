"""What the peers' case grids are checked with: flce's outputs and gradients against float64
references of the collapse-safe formula (``flce.reference``), every element, tolerances from
tests/helpers.py relative to each output dtype's rounding floor.

``run_ce``  flce.cross_entropy on given logits; ``run_lce`` flce.linear_cross_entropy.
Both take flce's option names (the peers' spellings map as docs/api.md's "Coming from
Liger / CCE / torch" table says), an ``objective`` of the outputs (the scalar both sides
differentiate; default: fresh random upstream gradients), and return flce's outputs and
gradients for a test's own extra checks.
"""
import zlib

import torch

import flce
from helpers import (GRAD_FACTOR, GRAD_NORM_FACTOR, LOSS_FACTOR, as_f64, assert_close_to_ref,
                     gen, rel_err, round_floor, rounds_grad_tile)

FIELDS = ("loss", "lse", "accuracy", "z_loss")


def seed_of(*params):
    """A fixed seed per case: each case draws its own fresh inputs, the same on every run."""
    return zlib.crc32(repr(params).encode())


def ref_outputs(z64, t, *, class_weight=None, ignore_index=-100, reduction="mean",
                label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                z_loss_weighting="target"):
    """float64 (loss, lse, accuracy, z_loss) of logits ``z64`` [N, V] and targets ``t`` [N].

    The loss is flce.reference's collapse-safe loss plus the z-loss ``z_loss * lse^2`` per
    token, weighted by the target's class weight (``"target"``, flce's default) or unweighted
    (``"none"``, Liger's rule); under ``"mean"`` each part is divided by the sum of its
    tokens' weights. The accuracy is float64 here; ``check_accuracy`` compares it."""
    if ignore_index is None:
        ignore_index = -100
    w64 = None if class_weight is None else class_weight.double()
    ce, lse = flce.reference.logits_cross_entropy(
        z64, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing,
        softcap=softcap, temperature=temperature, weight=w64, return_lse=True)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    ones = valid.double()
    row_w = ones if w64 is None else torch.where(valid, w64[safe_t], 0.0)
    z_w = row_w if z_loss_weighting == "target" else ones
    zl = torch.where(valid, z_loss * lse * lse * z_w, 0.0)
    zc = z64.detach()
    if softcap is not None:
        zc = softcap * torch.tanh(zc / softcap)
    others = zc.scatter(1, safe_t[:, None], float("-inf")).amax(1)
    margin = torch.where(valid, zc.gather(1, safe_t[:, None])[:, 0] - others, float("nan"))
    if reduction == "none":
        loss, zpart = ce + zl, zl
    elif reduction == "sum":
        loss, zpart = ce.sum() + zl.sum(), zl.sum()
    else:
        loss, zpart = ce.sum() / row_w.sum() + zl.sum() / z_w.sum(), zl.sum() / z_w.sum()
    return {"loss": loss, "lse": lse, "margin": margin, "z_loss": zpart}


def as_dict(out):
    if isinstance(out, dict):
        return out
    return out._asdict() if isinstance(out, tuple) else {"loss": out}


def random_objective(seed):
    """sum of each output times a fresh random upstream gradient of its shape."""
    def objective(out):
        g = gen(seed)
        total = 0.0
        for name in ("loss", "lse"):
            if name in out:
                v = out[name]
                u = torch.rand(v.shape, generator=g, dtype=torch.float64) + 0.5
                total = total + (v * u.to(v.dtype)).sum()
        return total
    return objective


def check_accuracy(acc, margin, reduction, *, tol):
    """flce's accuracy against the float64 margins ``z_t - max_{j != t} z_j``: a hit where the
    margin is above ``tol``, a miss below ``-tol`` (a tie is a miss); tokens within ``tol`` of
    a tie (the logits' own rounding) may go either way."""
    valid = ~torch.isnan(margin)
    sure = (margin > tol).double()
    maybe = (margin > -tol).double()
    acc = acc.detach().cpu().double()
    if reduction == "none":
        assert torch.all((acc >= sure.reshape(acc.shape)) & (acc <= maybe.reshape(acc.shape)))
        assert torch.all(acc[~valid.reshape(acc.shape)] == 0)
        return
    scale = valid.sum() if reduction == "mean" else 1
    # (a fraction rounded to float32)
    slack = torch.finfo(torch.float32).eps
    assert sure.sum() / scale * (1 - slack) <= acc <= maybe.sum() / scale * (1 + slack), \
        (acc, sure.sum(), maybe.sum())


def compare(got, ref, *, dtype_in, names):
    for name in names:
        g = got[name]
        assert g.dtype == torch.float32, (name, g.dtype)
        r = ref[name]
        assert g.shape == r.shape, (name, g.shape, r.shape)
        if name == "loss" and r.dim() == 0 and torch.isnan(r):
            assert torch.isnan(g), name
            continue
        assert_close_to_ref(g, r, torch.float32, factor=LOSS_FACTOR, what=name)


def grads_close(leaves, refs, *, low_dtype=None):
    """Every element within GRAD_FACTOR roundings (relative to max(|ref|, rms(ref)), plus half
    the dtype's smallest subnormal spacing: fp16 gradients below 6e-5 are subnormal), and
    norm-wise within GRAD_NORM_FACTOR or just above the floor where the gradient's own
    rounding exceeds that (a few large elements: bf16 gradients at 0.41 eps seen)."""
    for name, leaf in leaves.items():
        if not leaf.requires_grad:
            assert leaf.grad is None, name
            continue
        g = leaf.grad
        assert g is not None and g.shape == leaf.shape and g.dtype == leaf.dtype, name
        ref = refs[name]
        # autocast: the input's gradient is computed in low_dtype (then cast to the fp32
        # leaf's), held to low_dtype's floor
        dt = low_dtype if low_dtype is not None and name == "input" else g.dtype
        fi = torch.finfo(dt)
        assert_close_to_ref(g, ref, dt, factor=GRAD_FACTOR[dt], abs_floor=fi.smallest_normal *
                            fi.eps / 2, what=f"grad {name}")
        if ref.abs().sum() > 0:
            err = rel_err(g, ref) / fi.eps
            floor = round_floor(ref, dt) / fi.eps
            assert err <= max(GRAD_NORM_FACTOR[dt], 1.1 * floor), (name, err, floor)


def run_ce(logits, target, *, seed, class_weight=None, objective=None, backward=True,
           inplace_backward=False, return_lse=False, return_accuracy=False,
           return_z_loss=False, fn=None, **opts):
    """flce.cross_entropy on ``logits`` [N, V] against the float64 reference.

    ``fn(logits, target, class_weight, **options)``: another entry point in its place, which
    lays the [N, V] logits out as its peer does and returns per-token outputs as [N]."""
    objective = objective or random_objective(seed)
    fn = fn or flce.cross_entropy
    leaf = logits.detach().clone().requires_grad_(backward)
    # inplace_backward writes over the logits: a non-leaf view of the leaf takes it
    x = leaf * 1 if inplace_backward else leaf
    out = as_dict(fn(x, target, class_weight, return_lse=return_lse,
                     return_accuracy=return_accuracy, return_z_loss=return_z_loss,
                     inplace_backward=inplace_backward, **opts))
    z64 = logits.detach().double().requires_grad_(backward)
    ref = ref_outputs(z64, target, class_weight=class_weight, **opts)
    names = [n for n in FIELDS if n in out and n != "accuracy"]
    compare(out, ref, dtype_in=logits.dtype, names=names)
    if return_accuracy:
        check_accuracy(out["accuracy"], ref["margin"], opts.get("reduction", "mean"), tol=0.0)
    if backward:
        objective(out).backward()
        objective({k: ref[k] for k in names}).backward()
        grads_close({"input": leaf}, {"input": z64.grad})
    return out, leaf.grad


def run_lce(x, w, t, b=None, *, seed, class_weight=None, shift=0, objective=None,
            requires=("input", "weight", "bias"), autocast=None, return_lse=False,
            return_accuracy=False, return_z_loss=False, **opts):
    """flce.linear_cross_entropy(x, w, t, bias=b) against the float64 reference.

    ``shift=k``: flce takes the full sequence, the reference the sliced one
    (``x[..., :-k, :]`` against ``t[..., k:]``). ``autocast``: a 16-bit dtype to run flce
    under torch.autocast with, fp32 leaves, the hidden states cast to it as flce's integrations
    do (docs/integrations.md), the weight and bias fp32 master weights.
    """
    objective = objective or random_objective(seed)
    leaves = {"input": x, "weight": w}
    if b is not None:
        leaves["bias"] = b
    leaves = {k: v.detach().clone().requires_grad_(k in requires) for k, v in leaves.items()}
    if x.dtype == torch.bfloat16 and rounds_grad_tile(x):
        # exact math is what the peers compare with; the rounded tile has its own bound
        # (tests/api/test_bf16_grad.py)
        opts["exact_bf16_grad"] = True
    call = dict(bias=leaves.get("bias"), class_weight=class_weight, return_lse=return_lse,
                return_accuracy=return_accuracy, return_z_loss=return_z_loss, **opts)
    if shift:
        call["shift"] = shift
    if autocast is not None:
        with torch.autocast("cpu", dtype=autocast):
            out = as_dict(flce.linear_cross_entropy(leaves["input"].to(autocast),
                                                    leaves["weight"], t, **call))
    else:
        out = as_dict(flce.linear_cross_entropy(leaves["input"], leaves["weight"], t, **call))
    opts.pop("exact_bf16_grad", None)
    # flce computes with the weight in the input's dtype
    x64, w64, b64 = (None if a is None else a.detach().requires_grad_(k in requires)
                     for k, a in zip(("input", "weight", "bias"),
                                     as_f64(x if autocast is None else x.to(autocast), w, b)))
    xs, ts = x64, t
    if shift:
        xs, ts = x64[..., :-shift, :], t[..., shift:]
    z64 = xs.reshape(-1, xs.shape[-1]) @ w64.T
    if b64 is not None:
        z64 = z64 + b64
    ref = ref_outputs(z64, ts.reshape(-1), class_weight=class_weight, **opts)
    for name in ("lse", "margin"):
        ref[name] = ref[name].reshape(ts.shape)
    if opts.get("reduction", "mean") == "none":
        ref["loss"] = ref["loss"].reshape(ts.shape)
        ref["z_loss"] = ref["z_loss"].reshape(ts.shape)
    names = [n for n in FIELDS if n in out and n != "accuracy"]
    compare(out, ref, dtype_in=x.dtype, names=names)
    if return_accuracy:
        # fp32 logits of the same inputs: ties within the GEMM's rounding may go either way
        zmax = z64.detach().abs().amax()
        check_accuracy(out["accuracy"], ref["margin"], opts.get("reduction", "mean"),
                       tol=float(64 * torch.finfo(torch.float32).eps * xs.shape[-1] ** 0.5 * zmax))
    if requires and torch.is_grad_enabled():
        objective(out).backward()
        objective({k: ref[k] for k in names}).backward()
        refs = {"input": x64.grad, "weight": w64.grad, "bias": None if b64 is None else b64.grad}
        grads_close(leaves, refs, low_dtype=autocast)
    return out, leaves
