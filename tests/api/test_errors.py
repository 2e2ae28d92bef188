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


def test_class_weights_that_require_grad_are_refused():
    # As torch: per-class weights are constants of the loss. (flce computed a partial gradient
    # with label smoothing, and none for probability targets.)
    x, w, t, _ = _inputs("cpu")
    cw = torch.rand(V, requires_grad=True)
    for call in (lambda: _call(x, w, t, class_weight=cw, label_smoothing=0.1),
                 lambda: _call(x, w, torch.softmax(torch.randn(N, V), 1), class_weight=cw),
                 lambda: flce.cross_entropy(x @ w.T, t, cw)):
        with pytest.raises(ValueError, match="not differentiable"):
            call()
    with torch.no_grad():
        assert torch.isfinite(_call(x, w, t, class_weight=cw, label_smoothing=0.1))


def test_probability_targets_with_an_ignore_index_are_refused():
    x, w, _, _ = _inputs("cpu")
    q = torch.softmax(torch.randn(N, V), 1)
    for call in (lambda: _call(x, w, q, ignore_index=3),
                 lambda: flce.cross_entropy(x @ w.T, q, ignore_index=0)):
        with pytest.raises(ValueError, match="ignore_index is not supported with probability"):
            call()
    assert torch.isfinite(_call(x, w, q, ignore_index=-100))
    # a negative one names no class: accepted, as torch accepts it
    for ii in (-1, -5):
        assert torch.equal(_call(x, w, q, ignore_index=ii), _call(x, w, q))
        assert torch.equal(flce.cross_entropy(x @ w.T, q, ignore_index=ii),
                           flce.cross_entropy(x @ w.T, q))


@pytest.mark.parametrize("flag", ["return_lse", "return_entropy"])
def test_output_flags_must_be_bools(flag):
    x, w, t, _ = _inputs("cpu")
    with pytest.raises(TypeError, match=flag):
        _call(x, w, t, **{flag: "no"})
    with pytest.raises(TypeError, match=flag):
        flce.cross_entropy(x @ w.T, t, **{flag: "yes"})


def test_class_weights_not_a_tensor():
    x, w, t, _ = _inputs("cpu")
    with pytest.raises(TypeError, match="class_weight must be a torch.Tensor"):
        _call(x, w, t, class_weight=[1.0] * V)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        flce.cross_entropy(x @ w.T, t, [1.0] * V)


@pytest.mark.parametrize("case", ["float64", "smoothed_weights_accuracy", "functorch",
                                  "compiled"])
def test_target_out_of_range_on_the_composite_path(device, case):
    # The paths whose loss torch ops compute check the targets as the fused ops do (before: an
    # indexing error naming no argument on the CPU, a device-side assert on a GPU).
    x, w, t, _ = _inputs(device)
    t = t.clone()
    t[5] = V
    if case == "float64":
        call = lambda: _call(x.double(), w.double(), t)
    elif case == "smoothed_weights_accuracy":
        call = lambda: _call(x, w, t, class_weight=torch.rand(V, device=device),
                             label_smoothing=0.1, return_accuracy=True)
    elif case == "functorch":
        call = lambda: torch.func.grad(lambda a: _call(a, w, t))(x)
    else:  # (an op without outputs, kept in the graph: torch.fx has_side_effect)
        call = lambda: torch.compile(lambda a, b: _call(a.double(), b.double(), t),
                                     fullgraph=True, backend="aot_eager")(x, w)
    raises_within_two_calls(call, "target[5] = 50 is out of range")
    if case == "float64":
        raises_within_two_calls(lambda: flce.cross_entropy((x @ w.T).double(), t),
                                "target[5] = 50 is out of range")


def test_an_empty_vocabulary():
    # V = 0: the empty sums. Ignored rows (every row: no class id is in range) have loss 0, and
    # probability targets over no class give 0; gradients are zeros, never an indexing error.
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(0, 4, requires_grad=True)
    ignored = torch.full((3,), -100)
    for kw in ({}, {"class_weight": torch.rand(0)}, {"label_smoothing": 0.1},
               {"class_weight": torch.rand(0), "label_smoothing": 0.1, "return_accuracy": True}):
        loss = _call(x, w, ignored, reduction="sum", **kw)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        assert loss.item() == 0 and torch.equal(x.grad, torch.zeros(3, 4))
        x.grad = None
    for target in (torch.rand(3, 0), torch.rand(3, 0).requires_grad_()):
        loss, lse, ent = _call(x, w, target, reduction="none", return_lse=True,
                               return_entropy=True)
        loss.sum().backward()
        assert torch.equal(loss, torch.zeros(3)) and torch.equal(ent, torch.zeros(3))
        assert (lse == float("-inf")).all() and torch.equal(x.grad, torch.zeros(3, 4))
        x.grad = None
    with pytest.raises(IndexError, match="out of range"):
        _call(x, w, torch.tensor([0, -100, -100]))


def test_a_nan_logit_makes_the_accuracy_nan(device):
    # As the loss: a token whose logits hold a NaN has a NaN accuracy (not a miss), and so has the
    # mean; an ignored token stays 0.
    x, w, t, _ = _inputs(device)
    x, t = x.detach().clone(), t.clone()
    x[1, 1] = float("nan")
    t[2] = -100
    x[2, 0] = float("nan")
    for acc in (_call(x, w, t, return_accuracy=True, reduction="none")[1],
                _call(x.double(), w.double(), t, return_accuracy=True, reduction="none")[1],
                flce.cross_entropy(x @ w.T, t, return_accuracy=True, reduction="none")[1]):
        assert torch.isnan(acc[1]) and acc[2] == 0 and not torch.isnan(acc[3:]).any()
    assert torch.isnan(_call(x, w, t, return_accuracy=True)[1])


def test_a_masked_column_with_label_smoothing_gives_inf(device):
    # A -inf bias (a masked vocabulary column) under label smoothing puts weight on an infinite
    # -log p: the loss is +inf, as torch's and flce's float64 path give (the logits' compensated
    # sum made it NaN).
    x, w, t, b = _inputs(device)
    b = b.detach().clone()
    b[7] = float("-inf")
    t = torch.where(t == 7, 0, t)
    want = torch.nn.functional.cross_entropy(x @ w.T + b, t, label_smoothing=0.1,
                                             reduction="none")
    assert torch.isinf(want).all()
    for got in (_call(x, w, t, b, label_smoothing=0.1, reduction="none"),
                flce.cross_entropy(x @ w.T + b, t, label_smoothing=0.1, reduction="none"),
                _call(x.double(), w.double(), t, b.double(), label_smoothing=0.1,
                      reduction="none")):
        assert torch.equal(got.float(), want)


@pytest.mark.parametrize("case", ["bool_target", "complex_target", "int_logits", "bool_logits",
                                  "int_input", "bool_target_linear"])
def test_dtype_errors_are_the_class_torch_raises(case):
    """A tensor of the wrong dtype raises what F.cross_entropy raises for it (a RuntimeError, a
    NotImplementedError for the logits), so that ``except RuntimeError`` written against torch
    catches it, and still a TypeError naming the argument (it was a TypeError alone)."""
    g = torch.Generator().manual_seed(43)
    z = torch.randn(6, 5, generator=g)
    t = torch.randint(0, 5, (6,), generator=g)
    w = torch.randn(5, 4, generator=g)
    x = torch.randn(6, 4, generator=g)
    calls = {
        "bool_target": (lambda f: f(z, t.bool()), "target"),
        "complex_target": (lambda f: f(z, t.to(torch.complex64)), "target"),
        "int_logits": (lambda f: f(z.long(), t), "input"),
        "bool_logits": (lambda f: f(z > 0, t), "input"),
        "int_input": (lambda f: f(x.long(), w, t), "input"),
        "bool_target_linear": (lambda f: f(x, w, t.bool()), "target"),
    }
    call, name = calls[case]
    linear = case.endswith("linear") or case == "int_input"
    torch_fn = getattr(torch.nn.functional, "linear_cross_entropy" if linear else "cross_entropy",
                       None)
    if torch_fn is None:
        pytest.skip("this torch has no F.linear_cross_entropy")
    with pytest.raises(Exception) as theirs:
        call(torch_fn)
    with pytest.raises(Exception) as ours:
        call(flce.linear_cross_entropy if linear else flce.cross_entropy)
    assert isinstance(ours.value, type(theirs.value)), (type(ours.value), type(theirs.value))
    assert isinstance(ours.value, TypeError) and name in str(ours.value)


def test_errors_name_the_likely_mistake():
    """The usual mistakes get a message that names the fix: class ids cast to float, a
    classifier passed transposed, (B, T, V) logits given to cross_entropy unflattened."""
    x, w, t, _ = _inputs("cpu")
    with pytest.raises(flce.ArgumentError, match=r"class indices must be an integer tensor"):
        _call(x, w, t.float())
    with pytest.raises(flce.ArgumentError, match=r"class indices must be an integer tensor"):
        flce.cross_entropy(torch.randn(N, V), t.float())
    with pytest.raises(flce.ArgumentError, match=r"weight looks transposed.*\(V, D\)"):
        _call(x, w.T.contiguous(), t)
    z, tt = torch.randn(2, 3, V), torch.randint(0, V, (2, 3))
    with pytest.raises(flce.ArgumentError, match=r"logits.flatten\(0, -2\) and target.flatten"):
        flce.cross_entropy(z, tt)
    # (the hints only where they apply: a target of another shape gets the plain message)
    with pytest.raises(flce.ArgumentError) as info:
        _call(x, w, t[:-1])
    assert "integer tensor" not in str(info.value) and "transposed" not in str(info.value)


def test_help_names_the_public_functions():
    import pydoc
    assert flce.linear_cross_entropy.__name__ == "linear_cross_entropy"
    text = pydoc.render_doc(flce, renderer=pydoc.plaintext)
    assert "_linear_cross_entropy" not in text


def test_single_pass_true_with_a_z_loss_output_names_it():
    """return_z_loss needs the per-token lse: single_pass=True refuses it by name."""
    x, w, t, _ = _inputs("cpu")
    with pytest.raises(flce.ArgumentError, match=r"return_z_loss"):
        _call(x, w, t, z_loss=1e-3, return_z_loss=True, single_pass=True)
