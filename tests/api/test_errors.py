"""Bad input gets a clear Python exception naming the argument; edge inputs work."""
import math

import pytest
import torch

import flce
from helpers import check_flce, rand_inputs, raises_within_two_calls

N, V, D = 12, 50, 8


def _inputs(device, **kw):
    return rand_inputs(N, V, D, torch.float32, device, seed=41, bias=True, **kw)


def _call(x, w, t, b=None, **kw):
    return flce.linear_cross_entropy(x, w, t, bias=b, **kw)


@pytest.mark.parametrize("case,exc,name", [
    ("input_1d", ValueError, "input"),
    ("input_0d", ValueError, "input"),
    ("weight_3d", ValueError, "weight"),
    ("d_mismatch", ValueError, "D"),
    ("target_shape", ValueError, "target"),
    ("bias_shape", ValueError, "bias"),
    ("input_int", TypeError, "input"),
    ("weight_int", TypeError, "weight"),
    ("weight_bf16_input_fp32", TypeError, "weight"),
    ("target_float", ValueError, "target"),  # probability targets of the wrong shape
    ("bias_dtype", TypeError, "bias"),
    ("input_not_tensor", TypeError, "input"),
    ("device_meta", ValueError, "device"),
    ("target_too_big", IndexError, "target"),
    ("target_negative", IndexError, "target"),
    ("reduction", ValueError, "reduction"),
    ("softcap_zero", ValueError, "softcap"),
    ("softcap_negative", ValueError, "softcap"),
    ("softcap_nan", ValueError, "softcap"),
    ("softcap_inf", ValueError, "softcap"),
    ("smoothing_negative", ValueError, "label_smoothing"),
    ("smoothing_big", ValueError, "label_smoothing"),
    ("smoothing_nan", ValueError, "label_smoothing"),
    ("z_loss_negative", ValueError, "z_loss"),
    ("z_loss_nan", ValueError, "z_loss"),
    ("z_loss_inf", ValueError, "z_loss"),
    ("weight_and_linear_weight", TypeError, "weight"),
])
def test_bad_input(device, case, exc, name):
    x, w, t, b = _inputs(device)
    kw = {}
    if case == "input_1d":
        x, t = x[0], t[0]
        w = w[:, :1]
        x = x[:3]
    elif case == "input_0d":
        x = x[0, 0]
    elif case == "weight_3d":
        w = w[None]
    elif case == "d_mismatch":
        w = w[:, :-1]
    elif case == "target_shape":
        t = t[:-1]
    elif case == "bias_shape":
        b = b[:-1]
    elif case == "input_int":
        x = x.to(torch.int32)
    elif case == "weight_int":
        w = w.to(torch.int32)
    elif case == "weight_bf16_input_fp32":
        w = w.to(torch.bfloat16)
        b = b.to(torch.bfloat16)
    elif case == "target_float":
        t = t.float()
    elif case == "bias_dtype":
        b = b.double()
    elif case == "input_not_tensor":
        x = x.tolist()
    elif case == "device_meta":
        w = w.to("meta")
    elif case == "target_too_big":
        t = t.clone()
        t[3] = V
    elif case == "target_negative":
        t = t.clone()
        t[5] = -1
    elif case == "reduction":
        kw["reduction"] = "avg"
    elif case.startswith("softcap"):
        kw["softcap"] = {"zero": 0.0, "negative": -1.0, "nan": math.nan,
                         "inf": math.inf}[case.split("_")[1]]
    elif case.startswith("smoothing"):
        kw["label_smoothing"] = {"negative": -0.1, "big": 1.5,
                                 "nan": math.nan}[case.split("_")[1]]
    elif case.startswith("z_loss"):
        kw["z_loss"] = {"negative": -1e-4, "nan": math.nan, "inf": math.inf}[case.split("_")[2]]
    elif case == "weight_and_linear_weight":
        kw["linear_weight"] = w
    if exc is IndexError:  # a bad target: found by the device on CUDA, without a host sync
        raises_within_two_calls(lambda: _call(x, w, t, b, **kw), name)
        return
    with pytest.raises(exc, match=name):
        _call(x, w, t, b, **kw)


def test_target_out_of_range_with_custom_ignore_index(device):
    """-100 is an ordinary bad target when ignore_index is 7."""
    x, w, t, b = _inputs(device)
    t = t.clone()
    t[0] = -100
    raises_within_two_calls(lambda: _call(x, w, t, b, ignore_index=7), "target[0] = -100")


def test_cpp_error_message_with_numbers(device):
    """A check of the C++ backend whose message formats numbers raises a clean Python error (on
    the first GPU run such a message crashed the process: tests/tools/test_build_info.py)."""
    from flce import _ops

    deferred = torch.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match=r"got \[3, 4\]"):
        _ops.ops.scale_grad(deferred, torch.ones((), device=device), torch.float32)


def test_module_bad_reduction():
    with pytest.raises(ValueError, match="reduction"):
        flce.LinearCrossEntropy(reduction="avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_input(device, reduction):
    x, w, t, b = _inputs(device)
    x0, t0 = x[:0].clone().requires_grad_(), t[:0]
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    loss = _call(x0, wg, t0, bg, reduction=reduction)
    ref = torch.nn.functional.cross_entropy(x[:0] @ w.T + b, t0, reduction=reduction)
    assert loss.shape == ref.shape
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref)
    else:
        assert (loss == 0).all()
    loss.sum().backward()
    assert x0.grad.shape == (0, D)
    assert torch.equal(wg.grad, torch.zeros_like(w)) and torch.equal(bg.grad, torch.zeros_like(b))


def test_empty_input_3d(device):
    x, w, t, _ = _inputs(device)
    x0 = x[:0].reshape(0, 0, D).requires_grad_()
    loss = _call(x0, w, t[:0].reshape(0, 0), reduction="none", return_lse=True)
    assert loss[0].shape == (0, 0) and loss[1].shape == (0, 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_input_propagates(device, bad):
    x, w, t, b = _inputs(device)
    x = x.clone()
    x[4, 2] = bad
    xg = x.clone().requires_grad_()
    loss = _call(xg, w, t, b, reduction="none")
    assert not torch.isfinite(loss[4]), "a non-finite input must not give a finite loss"
    if math.isnan(bad):
        assert torch.isnan(loss[4])
    others = torch.arange(N, device=device) != 4
    check_flce(x[others], w, t[others], b, reduction="none")
    rows_ok = torch.isfinite(loss[others]).all()
    assert rows_ok, "other rows must be unaffected"
    loss.sum().backward()  # no crash; the bad row's gradient is whatever the math gives
    mean = _call(x, w, t, b)
    assert torch.isnan(mean) or torch.isinf(mean)


def test_nan_weight_gives_nan(device):
    x, w, t, b = _inputs(device)
    w = w.clone()
    w[9, 0] = math.nan
    loss = _call(x, w, t, b, reduction="none")
    assert torch.isnan(loss).all()  # every row sees column 9


def test_float_ignore_index_is_refused(device):
    """A float ignore_index used to be truncated by the kernel (1.5 -> 1) but not by the mean's
    count: a wrong mean. torch raises a TypeError; so does flce."""
    x, w, _, b = _inputs(device)
    t = torch.tensor([1, 3, 1, 2, 3, 0] * 2, device=x.device)
    for bad in (1.5, 1.0, True, "1"):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            _call(x, w, t, b, ignore_index=bad)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        _call(x, w, t, b, ignore_index=2 ** 70)
    # an int-valued 0-d integer tensor is an int
    a = _call(x, w, t, b, ignore_index=torch.tensor(1))
    assert torch.equal(a, _call(x, w, t, b, ignore_index=1))


@pytest.mark.parametrize("name", ["temperature", "label_smoothing", "z_loss", "softcap"])
def test_scalar_options_take_numbers_and_0d_tensors_alike(device, name):
    x, w, t, b = _inputs(device)
    value = {"temperature": 0.7, "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}[name]
    want = _call(x, w, t, b, **{name: value})
    assert torch.equal(_call(x, w, t, b, **{name: torch.tensor(value)}), want)
    for bad in (str(value), [value], True):
        with pytest.raises(TypeError, match=f"{name} must be a number"):
            _call(x, w, t, b, **{name: bad})
    with pytest.raises(TypeError, match=f"{name} must be a number or a 0-d"):
        _call(x, w, t, b, **{name: torch.tensor([value])})
    with pytest.raises(TypeError, match="does not differentiate"):
        _call(x, w, t, b, **{name: torch.tensor(value, requires_grad=True)})


@pytest.mark.parametrize("bias", [False, True])
def test_d_zero_is_the_composition(device, bias):
    """D = 0: the logits are the bias (or 0), as torch's composition has them; the loss is
    log V without a bias."""
    x, w, t, b = _inputs(device)
    x0 = x[:, :0].clone().requires_grad_()
    w0 = w[:, :0].clone().requires_grad_()
    b0 = b.clone().requires_grad_() if bias else None
    loss = _call(x0, w0, t, b0, label_smoothing=0.1)
    logits = torch.zeros(N, V, dtype=torch.float64) + (b.double().cpu() if bias else 0.0)
    ref = torch.nn.functional.cross_entropy(logits, t.cpu(), label_smoothing=0.1)
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    if not bias:
        assert abs(loss.item() - math.log(V)) <= 1e-6 * math.log(V)
    loss.backward()
    assert x0.grad.shape == (N, 0) and w0.grad.shape == (V, 0)
    if bias:
        lr = logits.clone().requires_grad_()
        torch.nn.functional.cross_entropy(lr, t.cpu(), label_smoothing=0.1).backward()
        assert torch.allclose(b0.grad.double().cpu(), lr.grad.sum(0), atol=1e-6)
