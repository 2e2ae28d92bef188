"""return_accuracy and shift, on every backend and path: the accuracy against the argmax of the
float64 logits, shift=True against the unshifted call on the sliced hidden states and labels."""
import pytest
import torch

import flce
from helpers import DEVICES


def _inputs(b, t_len, d, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t_len, d, generator=g)
    w = torch.randn(v, d, generator=g) / d ** 0.5
    bias = torch.randn(v, generator=g) * 0.1
    bias = bias.to(dtype)
    z = (x.to(dtype).double() @ w.to(dtype).double().T + bias.double())
    t = torch.randint(0, v, (b, t_len), generator=g)
    # Half the tokens predicted right (their target is the argmax), some ignored.
    t = torch.where(torch.rand(b, t_len, generator=g) < 0.5, z.argmax(-1), t)
    t[0, :2] = -100
    return x.to(device, dtype), w.to(device, dtype), bias.to(device), t.to(device), z


def _reference(z, t, reduction):
    hit = ((z.argmax(-1) == t.cpu()) & (t.cpu() != -100)).float()
    return {"mean": hit.sum() / (t.cpu() != -100).sum(), "sum": hit.sum(), "none": hit}[reduction]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_accuracy_is_the_argmax(device, dtype, reduction):
    x, w, b, t, z = _inputs(3, 11, 32, 97, dtype, device)
    # softcap and temperature are increasing maps: the same argmax
    loss, lse, acc = flce.linear_cross_entropy(x, w, t, bias=b, reduction=reduction,
                                               softcap=5.0, temperature=0.7, return_lse=True,
                                               return_accuracy=True)
    assert acc.dtype == torch.float32 and not acc.requires_grad
    assert torch.equal(acc.cpu(), _reference(z, t, reduction))
    assert lse.shape == t.shape
    # The loss is the one without the flag.
    alone = flce.linear_cross_entropy(x, w, t, bias=b, reduction=reduction, softcap=5.0,
                                      temperature=0.7)
    torch.testing.assert_close(loss, alone, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_cross_entropy_accuracy_is_the_argmax(device, dtype):
    x, w, b, t, z = _inputs(2, 13, 16, 61, dtype, device, seed=1)
    logits = (x.double() @ w.double().T + b.double()).to(dtype)
    z = logits.double().cpu()
    loss, acc = flce.cross_entropy(logits.reshape(-1, 61), t.reshape(-1), return_accuracy=True,
                                   reduction="sum")
    assert torch.equal(acc.cpu(), _reference(z, t, "sum"))
    # (N, C, d1) layout
    _, acc3 = flce.cross_entropy(logits.movedim(-1, 1), t, return_accuracy=True,
                                 reduction="none")
    assert torch.equal(acc3.cpu(), _reference(z, t, "none"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("single_pass", [None, False])
def test_shift_is_the_sliced_call(device, dtype, single_pass):
    x, w, b, t, _ = _inputs(2, 9, 24, 53, dtype, device, seed=2)
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    loss = flce.linear_cross_entropy(xs, ws, t, bias=b, shift=True, single_pass=single_pass)
    loss.backward()
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    ref = flce.linear_cross_entropy(xr[:, :-1], wr, t[:, 1:], bias=b, single_pass=single_pass)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    tol = dict(rtol=1e-2, atol=1e-4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    # (xr's last position, sliced off, has a zero gradient: so has xs's, whose label is ignored)
    torch.testing.assert_close(xs.grad, xr.grad, **tol)
    assert torch.all(xs.grad[:, -1] == 0)
    torch.testing.assert_close(ws.grad, wr.grad, **tol)
    per_token = flce.linear_cross_entropy(x, w, t, bias=b, shift=True, reduction="none")
    assert per_token.shape == t.shape and torch.all(per_token[:, -1] == 0)


def test_module_and_bad_arguments():
    x, w, b, t, z = _inputs(2, 5, 8, 17, torch.float32, "cpu", seed=3)
    m = flce.LinearCrossEntropy(shift=True, return_accuracy=True, reduction="sum")
    loss, acc = m(x, w, t)
    ref = flce.linear_cross_entropy(x[:, :-1], w, t[:, 1:], reduction="sum")
    torch.testing.assert_close(loss, ref)
    shifted = torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)
    assert torch.equal(acc, _reference(x.double() @ w.double().T, shifted, "sum"))
    with pytest.raises(TypeError, match="return_accuracy"):
        flce.linear_cross_entropy(x, w, t, return_accuracy="yes")
    with pytest.raises(TypeError, match="shift"):
        flce.LinearCrossEntropy(shift="yes")
    with pytest.raises(ValueError, match="shift=True needs target"):
        flce.linear_cross_entropy(x[0, 0], w, t[0, 0], shift=True)
    with pytest.raises(ValueError, match="single_pass"):
        flce.linear_cross_entropy(x, w, t, return_accuracy=True, single_pass=True)
