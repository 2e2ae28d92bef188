"""The differentiable composite path: flce's collapse-safe formulas in plain torch ops
(``flce.reference``), in float32 for float32 / bfloat16 / float16 inputs and in float64 for
float64 ones.

The fused ops serve training: first derivatives by their own backward kernels. What they do
not serve goes through here, where autograd sees every operation:
* float64 inputs (``torch.autograd.gradcheck``, double-precision models): no float64 kernels;
* functorch transforms (``torch.func.grad``, ``vmap``, ``jvp``, ``jacrev``, ...) and
  forward-mode AD (``torch.autograd.forward_ad``);
* a backward with ``create_graph=True`` (double backward, Hessian-vector products): the fused
  recompute path's backward recomputes its gradients here, differentiably.
It materializes the ``[N, V]`` logits (in the computation dtype), as torch's own composition
would: meant for these uses, not for large-vocabulary training steps.
"""
import collections

import torch

from . import reference

# The options as the flce:: ops hold them (softcap 0.0: none); flce._common.Options has the same
# fields, validated.
OpOptions = collections.namedtuple(
    "OpOptions", ("ignore_index", "label_smoothing", "z_loss", "softcap", "temperature"))


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def per_token(input, weight, target, bias, opts, vocab_size=None, class_weight=None):
    """Per-token (loss, lse, entropy) of ``input [N, D]`` against ``weight [V, D]``, float32
    (float64 for float64 inputs), differentiable in input, weight and bias. The weight and bias
    are taken in the input's dtype first, as the fused path computes with them (fp32 master
    weights), then widened exactly. ``class_weight``: per-class weights, as torch's, in the
    computation dtype (``_common.class_weights``)."""
    return logits_per_token(linear_logits(input, weight, bias), target, opts, vocab_size,
                            class_weight)


def token_accuracy(z_t, max_other, target, ignore_index, nan_row):
    """1.0 where the target's logit is above every other logit (the target is the argmax; a
    tie counts as a miss), 0.0 elsewhere and for ignored tokens, NaN for a token whose logits
    hold a NaN (``nan_row``: as its loss); float32, not differentiable. The softcap and
    temperature are increasing maps: the raw logits give the same argmax."""
    valid = target != ignore_index
    hit = ((z_t > max_other) & valid).to(torch.float32)
    return torch.where(nan_row & valid, float("nan"), hit).detach()


def accuracy_from_logits(logits, target, ignore_index):
    """token_accuracy of materialized logits [N, C]."""
    with torch.no_grad():
        n, c = logits.shape
        if n == 0 or c == 0:
            return torch.zeros(n, dtype=torch.float32, device=logits.device)
        valid = (target >= 0) & (target < c)
        safe = torch.where(valid, target, torch.zeros_like(target))[:, None]
        z_t = logits.gather(1, safe)[:, 0]
        others = logits.scatter(1, safe, float("-inf")).amax(1)
        return token_accuracy(z_t, others, target, ignore_index,
                              torch.isnan(logits).any(1)) * valid


def predicted_from_logits(logits, target, opts):
    """return_predicted_tokens of materialized logits ``[N, C]``: torch.argmax of each row's
    logits as the loss takes them (after the softcap and temperature), ties to the lowest
    column; -1 for ignored tokens (``target`` None: probability targets, none ignored) and rows
    with a NaN logit, as the fused ops' (_common.predicted_from_stats). int64, not
    differentiable."""
    with torch.no_grad():
        n, c = logits.shape
        if c == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=logits.device)
        z = reference.transformed_logits(logits.to(compute_dtype(logits.dtype)),
                                         opts.softcap or None, opts.temperature)
        bad = torch.isnan(z).any(1)
        if target is not None:
            bad = bad | (target == opts.ignore_index)
        return torch.where(bad, -1, z.argmax(1))


def logits_per_token(logits, target, opts, vocab_size=None, weight=None):
    """Per-token (loss, lse, entropy) of given logits ``[N, V]`` (in their dtype); with
    per-class ``weight``, the loss weighted as torch weights it (flce.reference)."""
    loss, lse, entropy = reference.logits_cross_entropy(
        logits, target, ignore_index=opts.ignore_index, reduction="none",
        label_smoothing=opts.label_smoothing, z_loss=opts.z_loss,
        softcap=opts.softcap or None, temperature=opts.temperature, return_lse=True,
        return_entropy=True, vocab_size=vocab_size, weight=weight)
    return loss, lse, entropy


def soft_per_token(logits, target, opts, class_weight=None):
    """Per-row (loss, lse, entropy, accuracy) of ``logits [N, V]`` against probability targets
    ``target [N, V]``, in the logits' dtype, differentiable in both (flce.reference
    soft_cross_entropy: collapse-safe). accuracy: whether the logits' argmax is the target
    distribution's."""
    loss, lse, entropy = reference.soft_cross_entropy(
        logits, target.to(logits.dtype), reduction="none", label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss, softcap=opts.softcap or None, temperature=opts.temperature,
        weight=class_weight)
    n, v = logits.shape
    accuracy = accuracy_from_logits(logits, target.detach().argmax(1), -1) if v else \
        logits.new_zeros(n, dtype=torch.float32)
    return loss, lse, entropy, accuracy


def soft_linear_per_token(input, weight, target, bias, opts, class_weight=None, z_weight=None):
    """Per-row (loss, lse, entropy) as flce::soft_forward computes them (a differentiable
    composite of the same formulas, for its double backward): probability targets ``[N, V]``,
    or class targets ``[N]`` with per-class weights (``z_weight``: their rows' weights)."""
    logits = linear_logits(input, weight, bias)
    if target.dtype.is_floating_point:
        return soft_per_token(logits, target, opts, class_weight)[:3]
    return logits_per_token(logits, target, opts, weight=class_weight)


def linear_logits(input, weight, bias):
    """``input @ weight.T + bias`` as per_token computes it: the weight's values in the input's
    dtype, then both widened to the computation dtype (float32, float64 for float64 inputs).
    A wider weight (fp32 master weights of 16-bit inputs) gets its gradient in the computation
    dtype: the rounding to the input's dtype passes it through unchanged (as the fused ops'
    dW), where ``weight.to(input.dtype)`` would round it to 16 bits on the way back."""
    cdt = compute_dtype(input.dtype)
    w = weight.to(cdt)
    if weight.dtype != input.dtype:
        w = w + (weight.to(input.dtype).to(cdt) - w).detach()
    logits = input.to(cdt) @ w.T
    return logits + bias.to(cdt) if bias is not None else logits


def grads_with_graph(outputs, grad_outputs, inputs):
    """``torch.autograd.grad`` of the outputs that received a gradient, with create_graph: the
    gradients of ``inputs`` (None where an input is None or not needed), themselves
    differentiable."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grad_outputs) if g is not None]
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    if not pairs or not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                   create_graph=True, allow_unused=True))
    out = [next(got) if t is not None and t.requires_grad else None for t in inputs]
    return [g if g is not None or t is None else torch.zeros_like(t)
            for g, t in zip(out, inputs)]
