"""Shared test helpers for flce (import as ``from helpers import ...``; tests/ is on sys.path).

Devices
  ``DEVICES``                 pytest params "cpu", "cuda" (skips without a GPU) and "cuda-host"
                              (the CUDA backend on CPU tensors, host-emulated kernels); use
                              ``@pytest.mark.parametrize("device", DEVICES)`` or the ``device``
                              fixture of conftest.py. ``CUDA_DEVICES``: the last two.
Inputs
  ``rand_inputs(n, v, d, dtype, device, ...)``   fresh random (input, weight, target, bias).
  ``margin_inputs(n, v, d, margin, dtype, ...)`` rows whose fp64 margin
                              ``z_t - max_{j != t} z_j`` is ``margin`` (returned exactly).
  ``as_f64(*tensors)``        the values flce computes with, as float64 (master weights are
                              cast to the input dtype first, as flce does).
References / yardsticks
  ``ref_loss_grads(...)``     float64 ``flce.reference`` loss (and lse) plus autograd gradients.
  ``ideal_fp32_loss(...)``    fp32 logits from the same inputs, then exact collapse-safe math
                              in float64: the best loss an fp32-logit implementation can give.
  ``ideal_grads(...)``        the ideal gradients: fp32 logits and probabilities, products
                              accumulated in float64, rounded once to the output dtype
                              (row-chunked, so N = 65536 fits).
Error metrics
  ``rel_err(x, ref)``         norm-wise relative error ``||x - ref|| / ||ref||`` in float64.
  ``max_rel_err(x, ref)``     element-wise ``max |x - ref| / |ref|``.
  ``round_floor(ref, dtype)`` ``rel_err`` of just rounding ``ref`` to ``dtype``: the floor.
  ``assert_close_to_ref(x, ref, dtype, factor)``  element-wise, relative to
                              max(|ref|, rms(ref)) * eps(dtype): catches garbage anywhere.
  ``assert_grad_close(g, ref)``  element-wise (GRAD_FACTOR) and norm-wise (GRAD_NORM_FACTOR).
  ``check_flce(x, w, t, b, **opts)``  forward + backward of flce.linear_cross_entropy against
                              the float64 reference, every element, random upstream gradients.
  ``rounds_grad_tile(x, exact_bf16_grad)``  whether flce's gradients for x come from a 16-bit
                              gradient tile (``tile_ideal_grads``) rather than at the floor.
  ``poison_allocator(...)``   best effort: fill and free blocks of the output sizes so that a
                              kernel that leaves elements unwritten returns NaN there (reliable
                              with the CUDA caching allocator, likely with glibc on CPU).
  ``raises_within_two_calls(fn, match)``  a bad target's IndexError, from the call or (CUDA,
                              checked without a host sync) from the next one.
"""
import math
import os as _os

import pytest
import torch

import flce

HAS_CUDA = torch.cuda.is_available()
# The CUDA backend: on a GPU, and on the CPU through the host emulation of its kernels and its
# launch sequence ("cuda-host": CPU tensors, the ops routed to flce_cuda_host by conftest.py; see
# tests/cuda_host.py). A test too large for the emulation marks itself skip_cuda_host.
CUDA_DEVICES = [
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device available")),
    pytest.param("cpu", id="cuda-host", marks=pytest.mark.cuda_host),
]
DEVICES = [pytest.param("cpu", id="cpu")] + CUDA_DEVICES

# torch's own F.linear_cross_entropy and nn.LinearCrossEntropyLoss (torch >= 2.13; the lent GPU
# machines run 2.11): the tests that compare with them, or run their samples, need them.
TORCH_LCE = hasattr(torch.nn.functional, "linear_cross_entropy")
needs_torch_lce = pytest.mark.skipif(not TORCH_LCE,
                                     reason="this torch has no F.linear_cross_entropy (< 2.13)")


def gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape, dtype, device, g, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def rand_inputs(n, v, d, dtype=torch.float32, device="cpu", *, seed=0, bias=False,
                weight_dtype=None, scale=1.0, ignore_frac=0.0, ignore_index=-100):
    """Fresh random inputs; logits have std ~ ``scale``. Targets uniform in [0, V)."""
    g = gen(seed)
    lead = (n,) if isinstance(n, int) else tuple(n)
    x = randn(lead + (d,), dtype, device, g, scale / d ** 0.25)
    w = randn((v, d), weight_dtype or dtype, device, g, 1.0 / d ** 0.25)
    t = torch.randint(0, v, lead, generator=g).to(device)
    if ignore_frac:
        drop = torch.rand(lead, generator=g) < ignore_frac
        t = torch.where(drop.to(device), torch.full_like(t, ignore_index), t)
    b = randn((v,), weight_dtype or dtype, device, g, 0.5) if bias else None
    return x, w, t, b


def as_f64(x, w, b=None):
    """What flce computes with, in float64: weight (and bias) in the input's dtype first."""
    w_c = w.to(x.dtype) if w.dtype != x.dtype else w
    return x.double(), w_c.double(), (None if b is None else b.double())


def margin_inputs(n, v, d, margin, dtype=torch.float32, device="cpu", *, seed=0, scale=2.0):
    """Inputs whose rows all have target margin ``margin`` in float64.

    Random input rows E, classifier C and bias b (logits of std ~ ``scale``); every row has the
    same target column t (random), so raising that one column cannot create a competitor in
    another row. b[t] = margin + mean_n M_n carries the margin (M_n: row n's max over the other
    columns), and C[t] is solved (least norm, N <= D/2 keeps E well conditioned) so that
    E[n] . C[t] = M_n + margin - b[t] absorbs the rows' spread. The bulk of z_t thus comes from
    the bias, which an implementation adds exactly once, as in a real model's confident token,
    rather than from one long fp32 dot product.

    The margins hold to ~1e-6 absolute for float32 and ~1e-2 for bf16/fp16 (C[t] is rounded
    to the dtype); the exact float64 margins are returned.

    Returns (input [n, d] dtype, weight [v, d], target [n], bias [v] float32, margins [n] fp64).
    The weight is float32 holding ``dtype``-representable values (flce's master-weight path for
    bf16/fp16 inputs), so the bias, and d loss / d bias, stay float32.
    """
    assert 2 * n <= d
    g = gen(seed)
    e = randn((n, d), dtype, "cpu", g, scale ** 0.5 / d ** 0.25).double()
    c = randn((v, d), dtype, "cpu", g, scale ** 0.5 / d ** 0.25).double()
    b = randn((v,), torch.float32, "cpu", g, 0.5).double()
    t = int(torch.randint(0, v, (1,), generator=g))
    others = torch.ones(v, dtype=torch.bool)
    others[t] = False
    mx = (e @ c[others].T + b[others]).max(dim=1).values
    b[t] = float(torch.tensor(margin + mx.mean().item()).float())
    c[t] = (torch.linalg.pinv(e) @ (mx + margin - b[t])).to(dtype).double()
    z = e @ c.T + b
    margins = z[:, t] - z[:, others].max(dim=1).values
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (margins - margin).abs().max() < tol * max(1.0, margin), margins
    return (e.to(dtype).to(device), c.float().to(device),
            torch.full((n,), t, dtype=torch.int64, device=device), b.float().to(device), margins)


def ref_loss_grads(x, w, t, b=None, *, upstream=None, **kw):
    """float64 flce.reference: (loss, lse, grad_input, grad_weight, grad_bias).

    ``kw`` are linear_cross_entropy options; ``upstream`` weights a reduction="none" loss
    (default: backward of the reduced loss, or of loss.sum() for "none").
    """
    x64, w64, b64 = as_f64(x, w, b)
    x64 = x64.detach().cpu().requires_grad_()
    w64 = w64.detach().cpu().requires_grad_()
    if b64 is not None:
        b64 = b64.detach().cpu().requires_grad_()
    loss, lse = flce.reference.linear_cross_entropy(x64, w64, t.cpu(), bias=b64, return_lse=True,
                                                    **kw)
    if upstream is not None:
        (loss * upstream.cpu().double()).sum().backward()
    else:
        loss.sum().backward()
    return (loss.detach(), lse.detach(), x64.grad, w64.grad,
            None if b64 is None else b64.grad)


def fp32_logits(x, w, b=None):
    """Logits as an fp32 implementation sees them: fp32 GEMM on the (upcast) inputs."""
    w_c = w.to(x.dtype) if w.dtype != x.dtype else w
    z = x.reshape(-1, x.shape[-1]).float() @ w_c.float().T
    if b is not None:
        z = z + b.float()
    return z


def ideal_fp32_loss(x, w, t, b=None, **kw):
    """Per-token loss of exact (float64) collapse-safe math on fp32 logits of the same inputs."""
    z = fp32_logits(x, w, b).double()
    kw.setdefault("reduction", "none")
    return flce.reference.logits_cross_entropy(z.cpu(), t.reshape(-1).cpu(), **kw)


def _ce_grad(z, t, scale, ignore_index=-100):
    """d(loss)/dz for plain CE, collapse-safe target column, in z's dtype."""
    valid = t != ignore_index
    st = torch.where(valid, t, torch.zeros_like(t))
    p = torch.softmax(z, dim=1)
    zt = z.gather(1, st[:, None])
    rest = z.scatter(1, st[:, None], -math.inf)
    lse_x = torch.logsumexp(rest, dim=1, keepdim=True)
    p.scatter_(1, st[:, None], -torch.sigmoid(lse_x - zt))
    p = p * valid[:, None].to(p.dtype)
    return p * scale


def ideal_grads(x, w, t, *, out_dtype, scale, chunk=8192):
    """(dE, dC) of plain mean/sum CE (no bias): reference in float64 and the fp32 ideal.

    Returns dict with "ref_dE", "ref_dC" (float64) and "ideal_dE", "ideal_dC" (out_dtype):
    the ideal uses fp32 logits and probabilities (``_ce_grad`` in fp32), accumulates the
    products in float64 and rounds once. ``scale`` multiplies every row's gradient (1/N for
    the mean). Works in row chunks; all tensors on CPU.
    """
    x, w, t = x.cpu(), w.cpu(), t.cpu()
    w_c = w.to(x.dtype) if w.dtype != x.dtype else w
    x64, w64 = x.double(), w_c.double()
    x32, w32 = x.float(), w_c.float()
    n, d = x.shape
    ref_de = torch.empty(n, d, dtype=torch.float64)
    ide_de = torch.empty(n, d, dtype=torch.float64)
    ref_dc = torch.zeros(w.shape[0], d, dtype=torch.float64)
    ide_dc = torch.zeros(w.shape[0], d, dtype=torch.float64)
    for i in range(0, n, chunk):
        sl = slice(i, i + chunk)
        g64 = _ce_grad(x64[sl] @ w64.T, t[sl], scale)
        ref_de[sl] = g64 @ w64
        ref_dc += g64.T @ x64[sl]
        del g64
        g32 = _ce_grad(x32[sl] @ w32.T, t[sl], scale).double()
        ide_de[sl] = g32 @ w64
        ide_dc += g32.T @ x64[sl]
        del g32
    return {"ref_dE": ref_de, "ref_dC": ref_dc,
            "ideal_dE": ide_de.to(out_dtype), "ideal_dC": ide_dc.to(out_dtype)}


def rel_err(x, ref):
    x = x.detach().cpu().double()
    ref = ref.detach().cpu().double()
    return ((x - ref).norm() / ref.norm()).item()


def max_rel_err(x, ref):
    x = x.detach().cpu().double()
    ref = ref.detach().cpu().double()
    return ((x - ref).abs() / ref.abs()).max().item()


def round_floor(ref, dtype):
    return rel_err(ref.to(dtype), ref)


def assert_close_to_ref(x, ref, dtype, *, factor=2.0, abs_floor=0.0, what="value"):
    """Element-wise check: |x - ref| <= factor * (ulp-level rounding of ref to dtype) + abs_floor.

    The rounding scale per element is max(|ref|, rms(ref)) * eps(dtype) so that tiny elements of
    a vector are held to the vector's scale, as a norm-wise bound would.
    """
    x = x.detach().cpu().double()
    ref = ref.detach().cpu().double()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert torch.isfinite(x).all(), f"{what}: non-finite elements"
    eps = torch.finfo(dtype).eps
    rms = ref.pow(2).mean().sqrt() if ref.numel() else ref.new_zeros(())
    tol = factor * eps * torch.maximum(ref.abs(), rms) + abs_floor
    bad = (x - ref).abs() > tol
    worst = ((x - ref).abs() - tol).flatten().argmax()
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{bad.numel()} elements off; worst "
                           f"|err|={(x - ref).abs().max().item():.3e}, tol at worst "
                           f"{tol.flatten()[worst].item():.3e}")


def assert_grad_close(got, ref, *, what="grad", factor=None, norm_factor=None):
    """A gradient in its own dtype against float64: element-wise (garbage anywhere) and
    norm-wise (precision), with the GRAD_FACTOR / GRAD_NORM_FACTOR tolerances."""
    dt = got.dtype
    assert_close_to_ref(got, ref, dt, factor=factor or GRAD_FACTOR[dt], what=what)
    err = rel_err(got, ref) / torch.finfo(dt).eps if ref.abs().sum() > 0 else 0.0
    if _os.environ.get("FLCE_TEST_VERBOSE"):
        print(f"{what} {dt}: norm-wise rel err {err:.3f} eps")
    assert err <= (norm_factor or GRAD_NORM_FACTOR[dt]), (what, err)


def poison_allocator(*shapes_dtypes, device="cpu"):
    """Allocate, NaN-fill and free tensors of the given (shape, dtype) so that the next
    allocations of those sizes likely reuse poisoned memory (see module docstring)."""
    bufs = [torch.full(s, math.nan, dtype=dt, device=device) for s, dt in shapes_dtypes]
    del bufs


def tile_ideal_grads(x, w, t, b, objective, **opts):
    """dE and dW as the CUDA backend's algorithm computes them at best: from the gradient tile
    dz = dobjective/dlogits rounded once to the 16-bit compute dtype, except each row's target
    entry, which it corrects in fp32 (target_fix / target_rows), with exact products (float64;
    the caller rounds once). Three GEMMs need the tile in the compute dtype; where a gradient's
    terms cancel, its rounding shows on top of the output's own (the CPU backend splits the tile
    into hi + lo and does not have it). ``objective(loss, lse, entropy)`` is the reduced float64
    loss."""
    x64, w64, b64 = (None if a is None else a.detach().cpu() for a in as_f64(x, w, b))
    u = x64.reshape(-1, x64.shape[-1]) @ w64.T
    if b64 is not None:
        u = u + b64
    u.requires_grad_()
    kw = {k: v for k, v in opts.items() if k in ("ignore_index", "reduction", "label_smoothing",
                                                  "z_loss", "softcap", "temperature")}
    loss, lse, ent = flce.reference.logits_cross_entropy(u, t.reshape(-1).cpu(), return_lse=True,
                                                         return_entropy=True, **kw)
    shape = t.shape
    if kw.get("reduction", "mean") == "none":
        loss = loss.reshape(shape)
    objective(loss, lse.reshape(shape), ent.reshape(shape)).backward()
    dz = u.grad
    # fp16: the tile holds scale * dz with max |scale * dz| in (2^13, 2^14] (a power of two: no
    # subnormals), as the CUDA backend stores it.
    mx = dz.abs().max()
    scale = 2.0 ** (14 - math.ceil(math.log2(mx))) if x.dtype == torch.float16 and mx > 0 else 1.0
    hi = (dz * scale).to(x.dtype).double() / scale
    tt = t.reshape(-1).cpu()
    own = (tt != kw.get("ignore_index", -100)) & (tt >= 0) & (tt < w.shape[0])
    rows = torch.arange(dz.shape[0])[own]
    hi[rows, tt[own]] = dz[rows, tt[own]]
    xf = x64.reshape(-1, x64.shape[-1])
    return {"input": (hi @ w64).reshape(x.shape), "weight": hi.T @ xf}


def rounds_grad_tile(x, exact_bf16_grad=None):
    """Whether flce's gradients for x come from the gradient tile rounded once to x's 16-bit
    dtype (``tile_ideal_grads``) rather than at the rounding floor: the CUDA backend's 16-bit
    tiles, and the CPU backend's bf16 tiles in its rounded mode (csrc/cpu/tile_gemm.h
    bf16_grad; ``flce.build_info()["cpu_bf16_grad"]`` is the default's)."""
    if x.dtype == torch.float32:
        return False
    if flce._ops.is_cuda_backend(x):
        return True
    return x.dtype == torch.bfloat16 and \
        torch.ops.flce.cpu_bf16_grad(exact_bf16_grad) == "rounded"


def assert_tile_grad_close(got, ideal, ref, *, what):
    """A gradient of the CUDA backend's 16-bit tile: every element within the output rounding of
    the tile ideal (``tile_ideal_grads``), and norm-wise within 1.1x the ideal's error against
    float64 (plus fp32 accumulation noise)."""
    dt = got.dtype
    assert_close_to_ref(got, ideal, dt, factor=GRAD_FACTOR[dt], what=f"{what} (tile ideal)")
    ideal_err = rel_err(ideal.to(dt), ref)
    err = rel_err(got, ref)
    assert err <= 1.1 * ideal_err + 1e-6, (what, err, ideal_err)


# check_flce tolerances, in units of eps(dtype), the ones `python -m flce.check` holds a user's
# device to (defined there, once). Element-wise bounds are relative to max(|ref|, rms(ref)) and
# catch garbage anywhere; the norm-wise bound on gradients holds the precision (fp32 gradients
# with cancellation have element errors far above their norm's).
from flce.check import GRAD_FACTOR, GRAD_NORM_FACTOR, LOSS_FACTOR  # noqa: E402


def check_flce(x, w, t, b=None, *, return_lse=False, return_entropy=False, grads=True,
               loss_factor=LOSS_FACTOR, grad_factor=None, seed=123, **opts):
    """Run flce.linear_cross_entropy forward + backward and compare every element with the
    float64 reference (``assert_close_to_ref``). Upstream gradients are random (fresh, nonzero)
    for reduction="none", for the lse and for the entropy. Returns (loss, lse or None, grads
    dict)."""
    reduction = opts.get("reduction", "mean")
    g = gen(seed)
    leaves = {"input": x, "weight": w}
    if b is not None:
        leaves["bias"] = b
    # detach, not clone: a clone of a strided view would be contiguous
    leaves = {k: v.detach().requires_grad_(grads) for k, v in leaves.items()}
    out = flce.linear_cross_entropy(leaves["input"], leaves["weight"], t, bias=leaves.get("bias"),
                                    return_lse=return_lse, return_entropy=return_entropy, **opts)
    out = list(out) if (return_lse or return_entropy) else [out]
    loss = out.pop(0)
    lse = out.pop(0) if return_lse else None
    ent = out.pop(0) if return_entropy else None
    assert loss.dtype == torch.float32
    up = torch.rand(t.shape, generator=g, dtype=torch.float64) + 0.5
    up_lse = torch.rand(t.shape, generator=g, dtype=torch.float64) - 0.5
    up_ent = torch.rand(t.shape, generator=g, dtype=torch.float64) - 0.5
    x64, w64, b64 = (None if a is None else a.detach().cpu().requires_grad_(grads)
                     for a in as_f64(x, w, b))
    # (flce's choices alone)
    ref_opts = {k: v for k, v in opts.items() if k not in ("single_pass", "exact_bf16_grad")}
    rloss, rlse, rent = flce.reference.linear_cross_entropy(
        x64, w64, t.cpu(), bias=b64, return_lse=True, return_entropy=True, **ref_opts)
    assert loss.shape == rloss.shape
    if reduction == "mean" and not (t != opts.get("ignore_index", -100)).any():
        assert torch.isnan(loss).all() and torch.isnan(rloss).all()
    else:
        assert_close_to_ref(loss, rloss, torch.float32, factor=loss_factor, what="loss")
    if return_lse:
        assert lse.shape == t.shape and lse.dtype == torch.float32
        assert_close_to_ref(lse, rlse, torch.float32, factor=loss_factor, what="lse")
    if return_entropy:
        assert ent.shape == t.shape and ent.dtype == torch.float32
        assert_close_to_ref(ent, rent, torch.float32, factor=loss_factor, what="entropy")
    result = {}
    if grads:
        def total(l, s, h, u, ul, uh):
            tot = (l * u).sum() if reduction == "none" else l
            if return_lse:
                tot = tot + (s * ul).sum()
            if return_entropy:
                tot = tot + (h * uh).sum()
            return tot
        dev = loss.device
        total(loss, lse, ent, up.float().to(dev), up_lse.float().to(dev),
              up_ent.float().to(dev)).backward()
        total(rloss, rlse, rent, up, up_lse, up_ent).backward()
        refs = {"input": x64.grad, "weight": w64.grad, "bias": None if b64 is None else b64.grad}
        tile = None
        if rounds_grad_tile(x, opts.get("exact_bf16_grad")):
            tile = tile_ideal_grads(x, w, t, b,
                                    lambda l, s, h: total(l, s, h, up, up_lse, up_ent), **opts)
        for name, leaf in leaves.items():
            gr = leaf.grad
            assert gr is not None and gr.shape == leaf.shape and gr.dtype == leaf.dtype, name
            if tile is not None and name in tile and gr.dtype != torch.float32:
                assert_tile_grad_close(gr, tile[name], refs[name], what=f"grad {name}")
            else:
                assert_grad_close(gr, refs[name], what=f"grad {name}", factor=grad_factor)
            result[name] = gr
    return loss, lse, result


def raises_within_two_calls(fn, match, exc=IndexError):
    """A bad target raises ``exc`` (message containing ``match``) from the call itself (the CPU
    backend) or, on the CUDA backend, whose target check runs without a host sync, from the first
    flce call after the device has run the bad one (the host emulation reports its checks the
    same way: landed from the next call on)."""
    try:
        fn()
    except exc as e:
        assert match in str(e), e
        return
    if HAS_CUDA:
        torch.cuda.synchronize()
    with pytest.raises(exc, match=match.replace("[", r"\[").replace("]", r"\]")):
        fn()
