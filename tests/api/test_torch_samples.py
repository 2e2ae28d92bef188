"""PyTorch's own sample inputs for the four entry points flce replaces, from the installed torch,
on every backend (cpu; the CUDA backend, on a GPU and host-emulated):
the OpInfo samples of ``nn.functional.cross_entropy`` and ``nn.functional.linear_cross_entropy``
and the ModuleInfo samples of ``nn.CrossEntropyLoss`` and ``nn.LinearCrossEntropyLoss``.

Every sample either gives the float64 answer (torch's op on the inputs widened to float64: these
samples are small random values, far from the margins where torch collapses) within the floor
of flce's output dtype, values and input gradients (probability targets included, and their
gradient), or is refused as docs/api.md says: torch's K-dimensional classifier, the one
refusal. The counts of each kind are asserted, so that a sample torch adds is seen.
"""
import re
import warnings

import pytest
import torch

import flce
from helpers import DEVICES, needs_torch_lce

pytest.importorskip("expecttest")  # torch.testing._internal imports it

# docs/api.md: "Probability targets and torch's K-dimensional classifier are not supported and
# raise."
REFUSALS = {
    "K-dimensional classifier": r"K-dimensional classifier",
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _ops(name):
    """Every OpInfo entry of the op (its variants included)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if o.name == name]


def _samples(name, dtype, device):
    return [(o, s) for o in _ops(name) for s in o.sample_inputs(device, dtype, requires_grad=True)]


def _module(cls_name):
    from torch.testing._internal.common_modules import module_db

    return next(m for m in module_db if m.module_cls.__name__ == cls_name)


def _grad_floor(dtype):
    """The gradients' tolerance relative to their largest element: a few roundings of the output
    dtype (bf16 4 ulps, fp16 2 ulps, fp32 16 ulps: the fp32 logits and exponentials feed every
    element) and, for float64 (flce's composite path against torch's, the same formulas in
    another order), 2^-33: elements that are small differences of O(1) terms keep their
    absolute, not relative, rounding."""
    return {torch.float32: 2.0 ** -20, torch.float64: 2.0 ** -33, torch.bfloat16: 2.0 ** -7,
            torch.float16: 2.0 ** -10}[dtype]


def _check(fn_flce, fn_ref, diff_inputs, dtype, what):
    """fn_flce() against fn_ref(widened) where widened maps each input to its float64 copy;
    values within fp32 rounding (flce's loss is float32 from exact inputs), input gradients
    within their dtype's rounding of the largest one."""
    got = fn_flce()
    wide = {id(t): t.detach().double().requires_grad_(t.requires_grad) for t in diff_inputs}
    ref = fn_ref(wide)
    value_tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), ref.detach(), rtol=value_tol, atol=value_tol,
                               equal_nan=True, msg=lambda m: f"{what}: value: {m}")
    grad_inputs = [t for t in diff_inputs if t.requires_grad]
    if not grad_inputs or not got.requires_grad:
        return
    g = torch.Generator().manual_seed(0)
    cot = torch.rand(got.shape, generator=g, dtype=torch.float64) + 0.5
    grads = torch.autograd.grad((got.double() * cot).sum(), grad_inputs, allow_unused=True)
    refs = torch.autograd.grad((ref * cot).sum(), [wide[id(t)] for t in grad_inputs],
                               allow_unused=True)
    for i, (a, r) in enumerate(zip(grads, refs)):
        if r is None:
            assert a is None or not a.any(), f"{what}: gradient {i} should be zero"
            continue
        assert a is not None and a.dtype == grad_inputs[i].dtype, f"{what}: gradient {i}"
        scale = r.abs().max().item() if r.numel() else 0.0
        tol = _grad_floor(dtype) * max(scale, 1e-30) * 2
        torch.testing.assert_close(a.double(), r, rtol=0, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{what}: gradient {i}: {m}")


def _run(samples, call, dtype, what):
    counts = dict.fromkeys(["right"] + list(REFUSALS), 0)
    for k, (flce_fn, ref_fn, inputs) in enumerate(call(s) for s in samples):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _check(flce_fn, ref_fn, inputs, dtype, f"{what} sample {k}")
        except (TypeError, ValueError) as e:
            kind = next((k2 for k2, pat in REFUSALS.items() if re.search(pat, str(e))), None)
            assert kind is not None, f"{what} sample {k}: refused, not as documented: {e}"
            counts[kind] += 1
            continue
        counts["right"] += 1
    return counts


def _tensors(*xs):
    return [x for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opinfo_cross_entropy(device, dtype):
    def call(pair):
        op, s = pair
        args, kw = list(s.args), dict(s.kwargs)
        target = args[0]
        inputs = [s.input] + ([target] if target.is_floating_point() else [])

        def ref(w):
            tgt = w[id(target)] if id(target) in w else target
            wkw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                       else v) for k, v in kw.items()}
            return op.op(w[id(s.input)], tgt, *[a.double() if isinstance(a, torch.Tensor) and
                                                 a.is_floating_point() else a
                                                 for a in args[1:]], **wkw)

        return (lambda: flce.cross_entropy(s.input, *args, **kw)), ref, inputs

    counts = _run(_samples("nn.functional.cross_entropy", dtype, device), call, dtype, "OpInfo")
    # torch 2.14.1: 21 right (11 with class indices, 10 probability targets) per dtype
    assert counts["right"] >= 21 and counts["K-dimensional classifier"] == 0, counts


@needs_torch_lce
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opinfo_linear_cross_entropy(device, dtype):
    def call(pair):
        op, s = pair
        args, kw = list(s.args), dict(s.kwargs)
        inputs = _tensors(s.input, *args, kw.get("linear_bias"))

        def ref(w):
            wa = [w.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args]
            # (torch's chunking options would ask for an fp32 accumulator, which it refuses
            # for float64 inputs; they change nothing in the answer)
            wkw = {k: (w[id(v)] if isinstance(v, torch.Tensor) and id(v) in w else
                       v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for k, v in kw.items() if k != "options"}
            return op.op(w[id(s.input)], *wa, **wkw)

        return (lambda: flce.linear_cross_entropy(s.input, *args, **kw)), ref, inputs

    counts = _run(_samples("nn.functional.linear_cross_entropy", dtype, device), call, dtype,
                  "OpInfo")
    # torch 2.14.1: 188 right (84 of them probability targets), 141 K-dimensional (fp32; 212 /
    # 159 for the 16-bit dtypes)
    assert counts["right"] >= 188, counts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_moduleinfo_cross_entropy_loss(device, dtype):
    info = _module("CrossEntropyLoss")

    def call(mi):
        kw = dict(mi.constructor_input.kwargs)
        x, target = mi.forward_input.args[:2]
        module = torch.nn.CrossEntropyLoss(*mi.constructor_input.args, **kw)
        inputs = [x] + ([target] if target.is_floating_point() else [])

        def ref(w):
            m64 = torch.nn.CrossEntropyLoss(*mi.constructor_input.args, **{
                k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
            return m64(w[id(x)], w.get(id(target), target))

        del module
        return (lambda: flce.cross_entropy(x, target, **kw)), ref, inputs

    samples = info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True,
                                      training=True)
    counts = _run(samples, call, dtype, "ModuleInfo CrossEntropyLoss")
    # torch 2.14.1: 105 right (36 of them probability targets)
    assert counts["right"] >= 105 and counts["K-dimensional classifier"] == 0, counts


@needs_torch_lce
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moduleinfo_linear_cross_entropy_loss(device, dtype):
    info = _module("LinearCrossEntropyLoss")

    def call(mi):
        kw = dict(mi.constructor_input.kwargs)
        x, target = mi.forward_input.args[:2]
        torch.manual_seed(0)
        module = torch.nn.LinearCrossEntropyLoss(*mi.constructor_input.args, **kw).to(device)
        lin = module.linear
        params = [lin.weight] + ([lin.bias] if lin.bias is not None else [])
        inputs = _tensors(x, *params) + ([target] if target.is_floating_point() else [])

        def ref(w):
            return torch.nn.functional.linear_cross_entropy(
                w[id(x)], w[id(lin.weight)], w.get(id(target), target),
                linear_bias=w[id(lin.bias)] if lin.bias is not None else None,
                reduction=module.reduction, ignore_index=module.ignore_index,
                label_smoothing=module.label_smoothing,
                weight=None if module.weight is None else module.weight.double())

        def mine():
            return flce.linear_cross_entropy(
                x, lin.weight, target, linear_bias=lin.bias, reduction=module.reduction,
                ignore_index=module.ignore_index, label_smoothing=module.label_smoothing,
                weight=module.weight)

        return mine, ref, inputs

    samples = info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True,
                                      training=True)
    counts = _run(samples, call, dtype, "ModuleInfo LinearCrossEntropyLoss")
    # torch 2.14.1: 492 right (32 of them probability targets), 373 K-dimensional
    assert counts["right"] >= 492, counts
