"""torch.library.opcheck of every flce op (all default utilities, test_aot_dispatch_dynamic
included), and torch.compile(fullgraph=True) of the API."""
import pytest
import torch

import flce
from helpers import rand_inputs


def _op_args(device, dtype=torch.float32, bias=True):
    n, v, d = 70, 300, 24
    x, w, t, b = rand_inputs(n, v, d, dtype, device, seed=61, bias=bias, ignore_frac=0.1)
    return n, v, d, x, w, t, b


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck_forward(device, dtype, bias):
    _, _, _, x, w, t, b = _op_args(device, dtype, bias)
    for grad in (False, True):
        args = (x.clone().requires_grad_(grad), w.clone().requires_grad_(grad), t,
                None if b is None else b.clone().requires_grad_(grad), -100, 0.1, 1e-3, 5.0)
        torch.library.opcheck(torch.ops.flce.forward.default, args)


def test_opcheck_partial_stats_and_combine(device):
    n, v, _, x, w, t, b = _op_args(device)
    torch.library.opcheck(torch.ops.flce.partial_stats.default,
                          (x, w[100:], t, b[100:], 100, -100, 0.0))
    parts = torch.stack([flce.ops.partial_stats(x, w[:100], t, b[:100], 0, -100, 0.0),
                         flce.ops.partial_stats(x, w[100:], t, b[100:], 100, -100, 0.0)])
    torch.library.opcheck(torch.ops.flce.combine.default, (parts, t, v, -100, 0.1, 1e-3))


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, False]])
def test_opcheck_backward(device, mask):
    n, v, _, x, w, t, b = _op_args(device)
    _, _, stats, _ = flce.ops.forward(x, w, t, b, -100, 0.1, 1e-3, 5.0)
    gl = torch.rand(n, device=device) + 0.5
    glse = torch.rand(n, device=device)
    torch.library.opcheck(torch.ops.flce.backward.default,
                          (gl, glse, x, w, t, b, stats, 0, v, -100, 0.1, 1e-3, 5.0, mask))
    torch.library.opcheck(torch.ops.flce.backward.default,
                          (gl, None, x, w, t, None, stats, 0, v, -100, 0.0, 0.0, 0.0, mask))


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, False]])
def test_opcheck_master_weights_placeholders(device, mask):
    """A 16-bit input with fp32 master weights (and bias): the [0] placeholders of the gradients
    not asked for have the fake kernels' dtypes on every backend (dE the input's, dW and the
    bias' the weight's); the CPU's were the input's, and opcheck failed."""
    n, v, _, x, w, t, b = _op_args(device, torch.bfloat16)
    w, b = w.float(), b.float()
    stats = flce.ops.forward(x, w, t, b, -100, 0.0, 0.0, 0.0)[2]
    gl = torch.rand(n, device=device)
    for bias in (b, None):
        torch.library.opcheck(torch.ops.flce.sum_and_grad.default,
                              (x, w, t, bias, -100, 0.0, 0.0, 0.0, mask, True))
        torch.library.opcheck(torch.ops.flce.backward.default,
                              (gl, None, x, w, t, bias, stats, 0, v, -100, 0.0, 0.0, 0.0, mask))
    q = torch.softmax(torch.randn(n, v, device=device), -1)
    _, _, sstats, pivot, _ = flce.ops.soft_forward(x, w, q, b, None, None, -100, 0.0, 0.0, 0.0,
                                                   1.0)
    torch.library.opcheck(torch.ops.flce.soft_backward.default,
                          (gl, None, None, x, w, q, b, None, sstats, pivot, None, 0, v, -100, 0.0,
                           0.0, 0.0, 1.0, mask))


def test_backward_grad_input_fp32(device):
    """grad_input_fp32=True (the vocab-parallel path's dE, summed over ranks before it is
    rounded): backward and soft_backward return dE in fp32, not rounded, whose rounding to the
    input's dtype is the default call's dE bit for bit; opcheck of both."""
    n, v, _, x, w, t, b = _op_args(device, torch.bfloat16)
    _, _, stats, _ = flce.ops.forward(x, w, t, b, -100, 0.1, 1e-3, 5.0)
    gl = torch.rand(n, device=device) + 0.5
    args = (gl, None, x, w, t, b, stats, 0, v, -100, 0.1, 1e-3, 5.0, [True, True, False])
    g16 = flce.ops.backward(*args)[0]
    g32 = flce.ops.backward(*args, grad_input_fp32=True)[0]
    assert g16.dtype == torch.bfloat16 and g32.dtype == torch.float32
    assert torch.equal(g32.to(torch.bfloat16), g16)
    assert not torch.equal(g32, g16.float())  # not rounded
    torch.library.opcheck(torch.ops.flce.backward.default, args,
                          {"grad_input_fp32": True})
    q = torch.softmax(torch.randn(n, v, device=device), -1)
    _, _, sstats, pivot, _ = flce.ops.soft_forward(x, w, q, b, None, None, -100, 0.0, 0.0, 0.0,
                                                   1.0)
    sargs = (gl, None, None, x, w, q, b, None, sstats, pivot, None, 0, v, -100, 0.0, 0.0, 0.0,
             1.0, [True, False, False])
    s16 = flce.ops.soft_backward(*sargs)[0]
    s32 = flce.ops.soft_backward(*sargs, True)[0]
    assert s32.dtype == torch.float32 and torch.equal(s32.to(torch.bfloat16), s16)
    assert not torch.equal(s32, s16.float())
    torch.library.opcheck(torch.ops.flce.soft_backward.default, sargs + (True,))


@pytest.mark.parametrize("path", ["lse", "mean"])
def test_compile_fullgraph(device, path):
    """A compiled function agrees with eager in forward and backward: "lse" returns the lse
    too (forward op + recomputing backward), "mean" is the plain training call (on CPU the
    fused sum-and-gradient op)."""
    torch._dynamo.reset()
    x, w, t, b = rand_inputs((2, 50), 400, 32, torch.float32, device, seed=67, bias=True,
                             ignore_frac=0.1)

    def fn(x, w, b, t):
        if path == "mean":
            return flce.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1)
        loss, lse = flce.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1,
                                              z_loss=1e-3, return_lse=True)
        return loss + 0.01 * lse.mean()

    compiled = torch.compile(fn, fullgraph=True)
    leaves_c = [a.clone().requires_grad_() for a in (x, w, b)]
    leaves_e = [a.clone().requires_grad_() for a in (x, w, b)]
    out_c = compiled(*leaves_c, t)
    out_e = fn(*leaves_e, t)
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=0)
    out_c.backward()
    out_e.backward()
    for c, e in zip(leaves_c, leaves_e):
        torch.testing.assert_close(c.grad, e.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
@pytest.mark.parametrize("mask", [[True, True, True], [False, True, False]])
def test_opcheck_sum_and_grad(device, mask, mean):
    _, _, _, x, w, t, b = _op_args(device)
    args = (x, w, t, b, -100, 0.1, 1e-3, 5.0, mask, mean)
    torch.library.opcheck(torch.ops.flce.sum_and_grad.default, args)
    args = tuple(a.clone().requires_grad_() if i in (0, 1, 3) else a for i, a in enumerate(args))
    torch.library.opcheck(torch.ops.flce.sum_and_grad.default, args)
    gw_deferred = flce.ops.sum_and_grad(x, w, t, b, -100, 0.1, 1e-3, 5.0, mask, mean)[3]
    torch.library.opcheck(torch.ops.flce.scale_grad.default,
                          (gw_deferred, torch.tensor(0.25, dtype=torch.float64, device=device),
                           torch.bfloat16))
