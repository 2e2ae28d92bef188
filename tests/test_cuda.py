"""CUDA-backend tests: registration (runs anywhere), and numerics against the float64 reference
and the CPU backend, determinism, 64-bit indexing, alignment fallbacks and target errors (need a
GPU, skipped otherwise)."""
import pytest
import torch

import flce
from flce import reference

OPS = ("partial_stats", "combine", "forward", "backward")


def _built_with_cuda():
    # The CUDA kernels' names are in the extension's symbol table only in a CUDA build.
    path = flce._ops._C.__file__
    with open(path, "rb") as f:
        return b"grad_logits_kernel" in f.read()


def test_cuda_kernels_registered():
    if not _built_with_cuda():
        pytest.skip("flce._C was built CPU-only (FLCE_CUDA=0 or no toolkit)")
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"flce::{op}", "CUDA"), op


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (2e-5, 1.5e-2), torch.float16: (2e-5, 5e-3)}


def _make(n, v, d, dtype, *, bias=False, seed=0, device="cuda", wdtype=None, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * scale).to(device=device, dtype=dtype)
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(device=device, dtype=wdtype or dtype)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    b = (torch.randn(v, generator=g) * 0.1).to(device=device, dtype=wdtype or dtype) if bias else None
    return x, w, t, b


def _ref(x, w, t, b, **kw):
    """float64 reference loss, lse and gradients (objective sum(loss * cw) + sum(lse * cl))."""
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_() if b is not None else None
    loss, lse = reference.linear_cross_entropy(xr, wr, t, bias=br, reduction="none",
                                               return_lse=True, **kw)
    return xr, wr, br, loss, lse


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _check_against_reference(x, w, t, b, dtype, **kw):
    xf = x.detach().clone().requires_grad_()
    wf = w.detach().clone().requires_grad_()
    bf = b.detach().clone().requires_grad_() if b is not None else None
    loss, lse = flce.linear_cross_entropy(xf, wf, t, bias=bf, reduction="none", return_lse=True,
                                          **kw)
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    xr, wr, br, rloss, rlse = _ref(x, w, t, b, **kw)
    ftol, gtol = TOL[dtype]
    torch.testing.assert_close(loss.double(), rloss, rtol=ftol * 10, atol=ftol * 10)
    torch.testing.assert_close(lse.double(), rlse, rtol=ftol * 10, atol=ftol * 10)
    g = torch.Generator(device="cpu").manual_seed(1)
    cw = torch.rand(loss.shape, generator=g).to(loss.device)
    cl = (torch.rand(loss.shape, generator=g) * 0.1).to(loss.device)
    ((loss * cw).sum() + (lse * cl).sum()).backward()
    ((rloss * cw.double()).sum() + (rlse * cl.double()).sum()).backward()
    assert xf.grad.dtype == x.dtype and wf.grad.dtype == w.dtype
    assert _rel_err(xf.grad, xr.grad) < gtol, _rel_err(xf.grad, xr.grad)
    assert _rel_err(wf.grad, wr.grad) < gtol, _rel_err(wf.grad, wr.grad)
    if b is not None:
        assert bf.grad.dtype == b.dtype
        assert _rel_err(bf.grad, br.grad) < gtol, _rel_err(bf.grad, br.grad)


SHAPES = [(1, 1, 1), (3, 5, 8), (37, 301, 72), (130, 1000, 129), (256, 2048, 256), (200, 4099, 64)]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype):
    n, v, d = shape
    x, w, t, b = _make(n, v, d, dtype, bias=True)
    _check_against_reference(x, w, t, b, dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_options_match_reference(dtype):
    x, w, t, b = _make(300, 1500, 96, dtype, bias=True, scale=3.0)
    t[::7] = -100
    _check_against_reference(x, w, t, b, dtype, ignore_index=-100, label_smoothing=0.1,
                             z_loss=1e-3, softcap=15.0)


@requires_gpu
def test_fp32_tf32_path():
    # With TF32 allowed for fp32 matmuls, fp32 inputs take the TF32 tensor-core tile.
    x, w, t, b = _make(300, 1100, 100, torch.float32, bias=True)
    exact = torch.ops.flce.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        tf32 = torch.ops.flce.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)
        gl = torch.ones(300, device="cuda")
        g_tf32 = torch.ops.flce.backward(gl, None, x, w, t, b, tf32[2], 0, 1100, -100, 0.0, 0.0,
                                         0.0, [True, True, True])
    finally:
        torch.set_float32_matmul_precision(old)
    g_exact = torch.ops.flce.backward(gl, None, x, w, t, b, exact[2], 0, 1100, -100, 0.0, 0.0,
                                      0.0, [True, True, True])
    torch.testing.assert_close(tf32[0], exact[0], rtol=5e-3, atol=5e-3)
    for a, c in zip(g_tf32, g_exact):
        assert _rel_err(a, c) < 2e-2


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights(dtype):
    x, w, t, b = _make(129, 777, 64, dtype, bias=True, wdtype=torch.float32)
    # The computation runs in the input dtype: compare against the reference on rounded weights.
    wq = w.to(dtype).float()
    xf = x.detach().clone().requires_grad_()
    wf = w.detach().clone().requires_grad_()
    loss = flce.linear_cross_entropy(xf, wf, t, bias=b, reduction="sum")
    loss.backward()
    assert wf.grad.dtype == torch.float32
    # The bias is added in fp32 as given (not rounded to the input dtype), as on the CPU.
    xr, wr, br, rloss, _ = _ref(x, wq, t, b)
    rloss.sum().backward()
    # fp32 grad_weight: the gradient tile reaches the dC GEMM as hi + lo (FLCE_CUDA_SPLIT_GRAD),
    # so dC is far more accurate than the 16-bit tile alone would allow.
    assert _rel_err(wf.grad, wr.grad) < 2e-3
    assert _rel_err(xf.grad, xr.grad) < TOL[dtype][1]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_cpu_backend(dtype):
    x, w, t, b = _make(150, 900, 80, dtype, bias=True)
    out_gpu = torch.ops.flce.forward(x, w, t, b, -100, 0.05, 1e-4, 0.0)
    out_cpu = torch.ops.flce.forward(x.cpu(), w.cpu(), t.cpu(), b.cpu(), -100, 0.05, 1e-4, 0.0)
    for a, c in zip(out_gpu, out_cpu):
        torch.testing.assert_close(a.cpu(), c, rtol=1e-4, atol=1e-4)
    gl = torch.rand(150, device="cuda")
    grads_gpu = torch.ops.flce.backward(gl, None, x, w, t, b, out_gpu[2], 0, 900, -100, 0.05,
                                        1e-4, 0.0, [True, True, True])
    grads_cpu = torch.ops.flce.backward(gl.cpu(), None, x.cpu(), w.cpu(), t.cpu(), b.cpu(),
                                        out_cpu[2], 0, 900, -100, 0.05, 1e-4, 0.0,
                                        [True, True, True])
    for a, c in zip(grads_gpu, grads_cpu):
        assert a.dtype == c.dtype
        assert _rel_err(a.cpu(), c) < TOL[dtype][1]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deterministic_bitwise(dtype):
    x, w, t, b = _make(1000, 5000, 128, dtype, bias=True)

    def run():
        xf = x.detach().clone().requires_grad_()
        wf = w.detach().clone().requires_grad_()
        bf = b.detach().clone().requires_grad_()
        loss = flce.linear_cross_entropy(xf, wf, t, bias=bf)
        loss.backward()
        return [loss, xf.grad, wf.grad, bf.grad]

    first = run()
    for _ in range(2):
        for a, c in zip(first, run()):
            assert torch.equal(a, c)


@requires_gpu
def test_vocab_parallel_partials_combine():
    x, w, t, b = _make(333, 3000, 64, torch.bfloat16, bias=True)
    cut = 1234
    p0 = torch.ops.flce.partial_stats(x, w[:cut], t, b[:cut], 0, -100, 0.0)
    p1 = torch.ops.flce.partial_stats(x, w[cut:], t, b[cut:], cut, -100, 0.0)
    loss, lse, stats = torch.ops.flce.combine(torch.stack([p0, p1]), t, 3000, -100, 0.0, 0.0)
    rloss, rlse, rstats = torch.ops.flce.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)
    torch.testing.assert_close(loss, rloss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    # Backward of each shard: grad_weight rows of the shards concatenate to the full one.
    gl = torch.ones(333, device="cuda")
    full = torch.ops.flce.backward(gl, None, x, w, t, b, rstats, 0, 3000, -100, 0.0, 0.0, 0.0,
                                   [True, True, True])
    s0 = torch.ops.flce.backward(gl, None, x, w[:cut], t, b[:cut], stats, 0, 3000, -100, 0.0, 0.0,
                                 0.0, [True, True, True])
    s1 = torch.ops.flce.backward(gl, None, x, w[cut:], t, b[cut:], stats, cut, 3000, -100, 0.0,
                                 0.0, 0.0, [True, True, True])
    assert _rel_err(torch.cat([s0[1], s1[1]]), full[1]) < 1e-2
    assert _rel_err(s0[0].float() + s1[0].float(), full[0]) < 1e-2


@requires_gpu
def test_target_out_of_range_raises():
    x, w, t, b = _make(64, 100, 32, torch.bfloat16)
    t[5] = 100
    with pytest.raises(IndexError, match=r"target\[5\] = 100"):
        flce.linear_cross_entropy(x, w, t)
    t[5] = -3
    with pytest.raises(IndexError):
        flce.linear_cross_entropy(x, w, t)
    t[5] = -100  # ignore_index: fine
    flce.linear_cross_entropy(x, w, t)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_alignment_fallback(dtype):
    # A storage offset of one element, a row stride that is not a multiple of 8, and a
    # transposed (column-major) weight all take the copy path (16-bit) or strided loads (fp32).
    n, v, d = 70, 300, 64
    x, w, t, b = _make(n, v, d, dtype, bias=True)
    xs = torch.empty(n * (d + 3) + 1, device="cuda", dtype=dtype)[1:].view(n, d + 3)[:, :d]
    xs.copy_(x)
    wt = w.t().contiguous().t()
    assert xs.data_ptr() % 16 != 0 and not wt.is_contiguous()
    ref = torch.ops.flce.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)
    got = torch.ops.flce.forward(xs, wt, t, b, -100, 0.0, 0.0, 0.0)
    for a, c in zip(got, ref):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    gl = torch.ones(n, device="cuda")
    gref = torch.ops.flce.backward(gl, None, x, w, t, b, ref[2], 0, v, -100, 0.0, 0.0, 0.0,
                                   [True, True, True])
    ggot = torch.ops.flce.backward(gl, None, xs, wt, t, b, ref[2], 0, v, -100, 0.0, 0.0, 0.0,
                                   [True, True, True])
    for a, c in zip(ggot, gref):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-5)


@requires_gpu
def test_expanded_grad_loss_and_mask():
    x, w, t, b = _make(50, 200, 40, torch.bfloat16, bias=True)
    _, _, stats = torch.ops.flce.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)
    g = torch.full((), 0.5, device="cuda").expand(50)
    full = torch.ops.flce.backward(g, None, x, w, t, b, stats, 0, 200, -100, 0.0, 0.0, 0.0,
                                   [True, True, True])
    only_w = torch.ops.flce.backward(g, None, x, w, t, b, stats, 0, 200, -100, 0.0, 0.0, 0.0,
                                     [False, True, False])
    assert only_w[0].numel() == 0 and only_w[2].numel() == 0
    assert torch.equal(only_w[1], full[1])


def _large_ok(bytes_needed):
    if not torch.cuda.is_available():
        return False
    free, _ = torch.cuda.mem_get_info()
    return free > bytes_needed


@requires_gpu
@pytest.mark.skipif(not _large_ok(48 << 30), reason="needs ~48 GiB of free GPU memory")
def test_large_indices():
    # N * V > 2^31 (the row statistics address logits they never store) and N * D > 2^31 (the
    # input and grad_input are indexed past 2^31 elements).
    def make_on_gpu(n, v, d):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).to(torch.bfloat16)
        return x, w, torch.randint(0, v, (n,), device="cuda", generator=g)

    n, v, d = 70_000, 32_768, 16
    x, w, t = make_on_gpu(n, v, d)
    loss, lse, _ = torch.ops.flce.forward(x, w, t, None, -100, 0.0, 0.0, 0.0)
    for i0 in (0, n - 1000):  # spot-check row blocks at both ends in fp32
        xs = x[i0:i0 + 1000].float()
        ref = reference.logits_cross_entropy(xs @ w.float().T, t[i0:i0 + 1000], reduction="none")
        torch.testing.assert_close(loss[i0:i0 + 1000], ref, rtol=1e-4, atol=1e-4)
    del x, w, t, loss, lse
    n, v, d = 65_600, 64, 32_776  # n * d = 2.15e9
    x, w, t = make_on_gpu(n, v, d)
    xf = x.requires_grad_()
    loss = flce.linear_cross_entropy(xf, w, t, reduction="sum")
    loss.backward()
    tail = slice(n - 64, n)
    xr = x[tail].detach().double().requires_grad_()
    reference.linear_cross_entropy(xr, w.double(), t[tail], reduction="sum").backward()
    assert _rel_err(xf.grad[tail], xr.grad) < 1.5e-2


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_input_near_ideal(dtype):
    # grad_input's error (RMS, against float64) stays close to that of the float64 gradient
    # rounded once to the output dtype: the 16-bit gradient tile plus the fp32 target-entry
    # correction (target_fix_kernel) add little on top of the unavoidable output rounding.
    x, w, t, _ = _make(512, 4096, 128, dtype, scale=2.0)
    xf = x.detach().clone().requires_grad_()
    flce.linear_cross_entropy(xf, w, t, reduction="sum").backward()
    xr = x.detach().double().requires_grad_()
    reference.linear_cross_entropy(xr, w.double(), t, reduction="sum").backward()
    ideal = (xr.grad.to(dtype).double() - xr.grad).pow(2).mean().sqrt()
    got = (xf.grad.double() - xr.grad).pow(2).mean().sqrt()
    assert got <= 1.5 * ideal + 1e-12, (got.item(), ideal.item())
