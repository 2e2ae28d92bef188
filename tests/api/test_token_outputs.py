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
    # per token: the positions that have a target, (..., T - 1), as Cut Cross Entropy's
    per_token = flce.linear_cross_entropy(x, w, t, bias=b, shift=True, reduction="none")
    ref = flce.linear_cross_entropy(x[:, :-1], w, t[:, 1:], bias=b, reduction="none")
    assert per_token.shape == ref.shape == (2, 8)
    torch.testing.assert_close(per_token, ref, rtol=1e-6, atol=1e-6)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [2, 3])
def test_integer_shift_is_cce_s(device, k):
    """shift=k (Cut Cross Entropy's): position i scored against target[..., i + k]; the loss and
    gradients of the sliced call, per-token outputs (..., T - k)."""
    x, w, b, t, _ = _inputs(2, 9, 24, 53, torch.float32, device, seed=4)
    xs = x.clone().requires_grad_()
    out = flce.linear_cross_entropy(xs, w, t, bias=b, shift=k, reduction="none",
                                    return_lse=True, return_accuracy=True)
    out.loss.sum().backward()
    xr = x.clone().requires_grad_()
    ref = flce.linear_cross_entropy(xr[:, :-k], w, t[:, k:], bias=b, reduction="none",
                                    return_lse=True, return_accuracy=True)
    ref.loss.sum().backward()
    for name in ("loss", "lse", "accuracy"):
        assert getattr(out, name).shape == (2, 9 - k), name
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert torch.all(xs.grad[:, -k:] == 0)
    mean = flce.linear_cross_entropy(x, w, t, bias=b, shift=k)
    torch.testing.assert_close(mean, flce.linear_cross_entropy(x[:, :-k], w, t[:, k:], bias=b),
                               rtol=1e-6, atol=1e-6)
    # a shift past the sequence: no position has a target
    assert flce.linear_cross_entropy(x, w, t, shift=20, reduction="none").shape == (2, 0)
    assert flce.LinearCrossEntropy(shift=k)(x, w, t, b).shape == ()
    for bad, exc in ((-1, ValueError), (1.5, TypeError), ("2", TypeError)):
        with pytest.raises(exc, match="shift must be True, False or an int"):
            flce.linear_cross_entropy(x, w, t, shift=bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["linear", "logits"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weights", [False, True])
def test_return_z_loss_and_its_weighting(device, entry, reduction, weights):
    """return_z_loss (Liger's): the z-loss part of the loss, reduced as the loss, detached; the
    loss itself unchanged. z_loss_weighting: "target" weighs a token's z-loss by its target's
    class weight (the mean over those weights), "none" (Liger's) not (the mean over the
    tokens); against float64 sums of z_loss * lse^2."""
    x, w, b, t, _ = _inputs(3, 7, 16, 41, torch.float32, device, seed=5)
    cw = torch.rand(41, generator=torch.Generator().manual_seed(6)).to(device) + 0.5 \
        if weights else None
    zl = 1e-2
    logits = (x @ w.T + b).reshape(-1, 41)

    def call(**kw):
        if entry == "linear":
            return flce.linear_cross_entropy(x, w, t, bias=b, reduction=reduction, z_loss=zl,
                                             class_weight=cw, **kw)
        return flce.cross_entropy(logits, t.reshape(-1), cw, reduction=reduction, z_loss=zl,
                                  **kw)
    plain = call()
    out = call(return_z_loss=True)
    assert out._fields == ("loss", "z_loss") and not out.z_loss.requires_grad
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=0)
    tt = t.reshape(-1).cpu()
    valid = tt != -100
    lse = torch.logsumexp(logits.double().cpu(), -1)
    row_w = torch.where(valid, cw.double().cpu()[tt.clamp_min(0)], 0.0) if weights else \
        valid.double()
    for rule, rw in (("target", row_w), ("none", valid.double())):
        per = zl * lse ** 2 * rw
        want = {"none": per, "sum": per.sum(), "mean": per.sum() / rw.sum()}[reduction]
        got = call(return_z_loss=True, z_loss_weighting=rule)
        torch.testing.assert_close(got.z_loss.double().cpu().reshape(want.shape), want,
                                   rtol=2e-5, atol=1e-7)
        # the loss: the cross-entropy without the z-loss (weighted as torch weights it) plus
        # the z-loss as the rule weighs it
        ce = call(z_loss_weighting=rule, return_lse=True)
        base = flce.reference.logits_cross_entropy(
            logits.double().cpu(), tt, reduction=reduction,
            weight=None if cw is None else cw.double().cpu())
        torch.testing.assert_close(ce.loss.double().cpu().reshape(want.shape), base + want,
                                   rtol=2e-5, atol=1e-6)
        # the loss alone (the z-loss added apart under "none" with weights): a plain tensor
        alone = call(z_loss_weighting=rule)
        assert isinstance(alone, torch.Tensor)
        torch.testing.assert_close(alone, ce.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="z_loss_weighting"):
        call(z_loss_weighting="liger")


def test_named_result():
    x, w, b, t, _ = _inputs(2, 5, 8, 17, torch.float32, "cpu", seed=7)
    out = flce.linear_cross_entropy(x, w, t, return_lse=True, return_entropy=True,
                                    return_accuracy=True, return_z_loss=True)
    assert isinstance(out, tuple) and out._fields == ("loss", "lse", "entropy", "accuracy",
                                                      "z_loss")
    loss, lse, *_ = out  # (tuple unpacking as before)
    assert loss is out.loss and lse is out.lse and out[0] is out.loss
    assert type(out).__name__ == "CrossEntropyOutput"
    import pickle

    again = pickle.loads(pickle.dumps(out))
    assert again._fields == out._fields and torch.equal(again.lse, out.lse)
    # the loss alone stays a tensor
    assert isinstance(flce.linear_cross_entropy(x, w, t), torch.Tensor)


def test_switchers_compile_fullgraph():
    """shift=k, return_z_loss and the named result under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    x, w, b, t, _ = _inputs(2, 9, 16, 37, torch.float32, "cpu", seed=8)

    def fn(x, w):
        out = flce.linear_cross_entropy(x, w, t, shift=2, z_loss=1e-3, return_lse=True,
                                        return_z_loss=True, reduction="none")
        return out.loss.sum() + 0.1 * out.lse.mean(), out.z_loss

    compiled = torch.compile(fn, fullgraph=True)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    (lc, zc), (le, ze) = compiled(xc, w), fn(xe, w)
    torch.testing.assert_close(lc, le, rtol=1e-6, atol=1e-6)
    assert zc.shape == ze.shape == (2, 7)
    torch.testing.assert_close(zc, ze, rtol=1e-6, atol=1e-9)
    lc.backward()
    le.backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-7)
