"""The public API: ``flce.linear_cross_entropy``, ``flce.LinearCrossEntropy`` and
``flce.cross_entropy``."""
import functools
import inspect
import math

import torch

from . import _build, _common, _composite, _ops
from ._common import ArgumentError

__all__ = ["linear_cross_entropy", "LinearCrossEntropy", "cross_entropy"]


def _linear_cross_entropy(input, weight=None, target=None, *, bias=None, ignore_index=-100,
                          reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                          temperature=1.0, return_lse=False, return_entropy=False,
                          return_accuracy=False, shift=False, single_pass=None,
                          exact_bf16_grad=None, class_weight=None, linear_weight=None,
                          linear_bias=None, options=None, return_z_loss=False,
                          z_loss_weighting="target", return_predicted_tokens=False):
    r"""Fused, collapse-safe ``cross_entropy(input @ weight.T + bias, target)``.

    A drop-in for ``torch.nn.functional.linear_cross_entropy(input, linear_weight, target, ...)``
    on the arguments they share: ``linear_weight`` and ``linear_bias`` are accepted as torch's
    keyword names, and where the classifier comes as torch passes it (positionally, or as
    ``linear_weight=``), ``weight=`` is torch's per-class weights (``None`` included, as
    ``nn.LinearCrossEntropyLoss`` passes it). torch's ``options`` chunking hints are ignored:
    flce picks its own tiles.
    The ``[N, V]`` logits are never materialized.

    Autograd: first derivatives come from flce's own backward; float64 inputs, functorch
    transforms (``torch.func.grad``, ``vmap``, ``jvp``, ...), forward-mode AD and a backward
    with ``create_graph=True`` (double backward) take a differentiable composite of the same
    formulas in float32 (float64 for float64 inputs) that materializes the logits
    (``flce._composite``). The single pass has no double backward: it raises, and
    ``single_pass=False`` gives one.

    Args:
        input: ``(..., D)`` hidden states, float32, bfloat16 or float16 (float64: the composite
            path, for ``gradcheck`` and double-precision models).
        weight: ``(V, D)`` classifier (``lm_head.weight``), input's dtype or float32 master
            weights (then the computation runs in input's dtype and ``weight.grad`` comes out in
            float32 straight from flce's float32 accumulators).
        target: ``(...)`` class indices in ``[0, V)`` or ``ignore_index``, or ``(..., V)``
            probabilities (soft labels, torch's semantics; fused on the CPU backend, the
            composite path, which materializes the logits, elsewhere: docs/api.md).
        bias: optional ``(V,)``.
        ignore_index: rows with this target contribute no loss and no gradient and are not
            counted by ``"mean"`` (``None`` means -100, as in torch).
        reduction: ``"mean"`` (over non-ignored tokens) | ``"sum"`` | ``"none"`` (shape ``(...)``).
        label_smoothing: torch semantics, ``(1 - eps) nll + eps (lse - mean_j z_j)``.
        z_loss: adds ``z_loss * lse**2`` per token (PaLM).
        softcap: applies ``softcap * tanh(z / softcap)`` to the logits (Gemma 2).
        temperature: divides the logits after the softcap, ``z = softcap(x . w + b) / T``, as RL
            trainers (verl, TRL, OpenRLHF) divide the model's logits; differentiable.
        return_lse: also return the per-token logsumexp, shape ``(...)``, float32.
        return_entropy: also return the per-token entropy of ``softmax(z)``, shape ``(...)``,
            float32, 0 for ignored tokens, differentiable (``dH/dz_j = -p_j (log p_j + H)``),
            computed from the online statistics without cancellation: relatively accurate near
            collapse (``H -> 0`` as the target dominates), and within a few ``2^-24`` times the
            non-target mass where another class dominates (docs/numerics.md). The per-token
            log-probability of the target is ``-loss`` with ``reduction="none"`` (rollout
            scoring: call under ``torch.no_grad()``, which saves nothing for a backward).
        return_accuracy: also return whether each token's target is the argmax of its logits
            (1.0 or 0.0, float32, not differentiable; a tie counts as a miss; ignored tokens
            0), reduced as the loss is: ``"mean"`` the fraction of non-ignored tokens predicted
            right, ``"sum"`` their count, ``"none"`` per token. From the row statistics the
            loss already has (the largest non-target logit against the target's): no extra
            pass over the logits. Like ``return_lse`` it takes the recompute path.
        shift: causal language modelling with unshifted labels: ``True`` (or 1) scores the
            token at position ``i`` of a sequence against ``target[..., i + 1]``, an int ``k``
            against ``target[..., i + k]`` (Cut Cross Entropy's ``shift``: k-th next token
            prediction), so ``input`` ``(..., T, D)`` and ``target`` ``(..., T)`` are passed as
            the model has them (no ``[..., :-k, :]`` copy of the hidden states; the last k
            positions' logits are computed and ignored). Per-token outputs (``"none"``'s loss,
            lse, entropy, accuracy) cover the positions that have a target: ``(..., T - k)``.
        class_weight: optional per-class weights ``(V,)`` with torch's semantics (``weight=`` in
            torch's calling convention, above): each token's loss (and z-loss) times its
            target's weight, ``"mean"`` divided by the sum of those weights. Fused (no ``[N,
            V]`` buffer; the recompute path, not the single pass); with label smoothing, whose
            weighted term ``sum_c w_c (-log p_c) / V`` needs every logit, fused as a target
            distribution on the CPU backend and the composite path (float32 logits) on CUDA.
        single_pass: compute the gradients in the forward pass (3 GEMMs instead of 4: no
            recompute of the logits in the backward), which then only scales them by the
            upstream gradient. ``None`` (default): on for training (gradients needed,
            reduction ``"mean"``/``"sum"``, no ``return_lse``/``return_entropy``) on CUDA for
            bf16 and fp32; on the CPU for fp32 and bf16 while its memory (O(V D): dW's
            compensation, and for bf16 the gradients held in fp32) stays within
            ``FLCE_CPU_MEMORY_MB``, by default
            half an fp32 ``[N, V]`` buffer, except bf16 where its GEMMs run on AMX (the
            recompute path is faster there); off for fp16 and otherwise
            (docs/cpu-backend.md). ``False`` forces the recompute path; ``True`` the single
            pass wherever the entry has one (it needs reduction ``"mean"``/``"sum"`` and none
            of ``return_lse``, ``return_entropy``, ``return_accuracy``; per-class weights
            without label smoothing, and target distributions on CUDA, have none and take the
            recompute path, as does a call without gradients to compute).
        exact_bf16_grad: how bfloat16 inputs' gradients are computed (docs/numerics.md; other
            dtypes ignore it). ``None`` (default): the backend's choice, which
            ``flce.build_info()["cpu_bf16_grad"]`` reports for the CPU: on a CPU whose bf16
            GEMMs run natively (AMX, AVX512-BF16: ``build_info()["cpu_bf16_native"]``), and on
            CUDA, the gradient tile is rounded once to bf16 and multiplied in bf16 with fp32
            accumulation (``input.grad`` and ``weight.grad`` within 1.5x bf16's rounding floor,
            norm-wise); on CPUs that widen bf16 GEMMs to fp32, exactly (at the floor, no slower
            there). ``False``: rounded once on every backend. ``True``: exact, on the CPU
            backend only (AMX: the tile split into two bf16 halves, 4 GEMMs where rounding
            takes 2; elsewhere fp32 GEMMs); the CUDA backend, which has no exact mode, raises.
        return_z_loss: also return the z-loss part of the loss (Liger's ``return_z_loss``),
            reduced as the loss is, float32, not differentiable (a value to log). Made from
            the per-token lse: like ``return_lse`` it takes the recompute path.
        z_loss_weighting: how the z-loss of a token weighs with ``class_weight`` (and
            probability targets): ``"target"`` (default) as its loss, times its target mass
            ``sum_c y_c`` (its target's class weight; 1 for a distribution without class
            weights), ``"mean"`` over those weights; ``"none"``, as Liger, unweighted, ``"mean"``
            over the non-ignored tokens (probability targets: the rows). Without class weights
            and with class targets both are the same.
        return_predicted_tokens: also return each token's predicted class, the argmax of its
            logits ``z`` (after the softcap and temperature), shape ``(...)``, int64, with
            ``torch.argmax``'s ties (the lowest class id, ``+inf`` included); -1 for ignored
            tokens, as Liger's ``return_predicted_tokens``, and for tokens whose logits hold a
            NaN. With class targets on the CPU backend, from the forward's own pass (the column
            of the largest non-target logit kept beside the row statistics); probability
            targets and class weights with label smoothing take the composite path, which
            materializes the logits, as ``return_accuracy`` does. Not on the CUDA backend yet,
            nor vocab-parallel (``NotImplementedError``).

    Returns:
        The loss in float32 (float64 for float64 inputs); where more is asked for, a
        ``NamedTuple`` of the loss, then the lse when ``return_lse``, the entropy when
        ``return_entropy``, the accuracy when ``return_accuracy``, the z-loss when
        ``return_z_loss`` and the predicted tokens when ``return_predicted_tokens`` (fields
        ``loss``, ``lse``, ``entropy``, ``accuracy``, ``z_loss``, ``predicted_tokens``).
    """
    try:
        k = _common.shift_amount(shift)
    except (TypeError, ValueError):
        k = shift  # (the call's own checks raise it: for DTensor weights on every rank)
    _common.check_flags(return_z_loss=return_z_loss)
    _common.z_loss_weighting(z_loss_weighting)
    plain = dict(bias=bias, ignore_index=ignore_index, reduction=reduction,
                 label_smoothing=label_smoothing, softcap=softcap, temperature=temperature,
                 return_entropy=return_entropy, return_accuracy=return_accuracy, shift=k,
                 single_pass=single_pass, exact_bf16_grad=exact_bf16_grad,
                 class_weight=class_weight, linear_bias=linear_bias, options=options,
                 return_predicted_tokens=return_predicted_tokens)
    weight = _alias("weight", weight, "linear_weight", linear_weight)

    def rows():
        """The target as the loss's rows: class ids [rows] (shifted) or probabilities
        [rows, V], and their leading shape."""
        if _common.is_soft(target):
            return target.reshape(-1, target.shape[-1]), tuple(target.shape[:-1])
        t = _common.unbatched_target(input, target)
        if k:
            t = _common.shift_target(t, ignore_index if ignore_index is not None else -100, k)
        return t.reshape(-1), tuple(t.shape)

    out = _with_z_loss(lambda zl, lse: _linear_outputs(input, weight, target, z_loss=zl,
                                                       return_lse=lse, **plain),
                       rows, _common.is_soft(target), class_weight, z_loss, ignore_index,
                       reduction, label_smoothing, return_lse, return_z_loss, z_loss_weighting)
    return _common.unshift(out, k, reduction)


def _linear_outputs(input, weight=None, target=None, *, bias=None, ignore_index=-100,
                    reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                    temperature=1.0, return_lse=False, return_entropy=False,
                    return_accuracy=False, shift=0, single_pass=None, exact_bf16_grad=None,
                    class_weight=None, linear_weight=None, linear_bias=None, options=None,
                    return_predicted_tokens=False):
    """linear_cross_entropy's outputs but the z-loss's and with the last ``shift`` positions
    (ignored) kept."""
    bias = _alias("bias", bias, "linear_bias", linear_bias)
    if weight is None or target is None:
        raise TypeError("flce: linear_cross_entropy needs input, weight and target")
    del options
    # DTensor weights sharded over the vocabulary go to the vocab-parallel path, before any
    # argument check here: its checks run in the ranks' exchange, so that a bad argument on one
    # rank raises on every rank (raised here, it left the others waiting in the exchange).
    if _common.is_dtensor(weight):
        from . import parallel

        if parallel.is_vocab_sharded(weight):
            return parallel._linear_dtensor(
                input, weight, target, bias=bias, ignore_index=ignore_index,
                reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap, temperature=temperature, return_lse=return_lse,
                return_entropy=return_entropy, return_accuracy=return_accuracy, shift=shift,
                class_weight=class_weight, exact_bf16_grad=exact_bf16_grad,
                return_predicted_tokens=return_predicted_tokens)
    opts = _common.Options(ignore_index, reduction, label_smoothing, z_loss, softcap,
                           temperature)
    target = _common.unbatched_target(input, target)
    _common.validate_linear(input, weight, target, bias)
    _common.check_one_device((("input", input), ("class_weight", class_weight)))
    _common.check_flags(return_lse=return_lse, return_entropy=return_entropy,
                        return_accuracy=return_accuracy)
    _common.check_flags(return_predicted_tokens=return_predicted_tokens)
    shift = _common.shift_amount(shift)
    # (here, for every path: the composite ones never ask for the single pass's rule)
    per_token = return_lse or return_entropy or return_accuracy or return_predicted_tokens
    _common.check_single_pass(single_pass, opts.reduction, per_token)
    if input.is_cuda:
        _build.check_cuda_device(input.device)
    exact_bf16_grad = _common.exact_bf16_grad(exact_bf16_grad, input)

    if _common.is_soft(target):
        _common.check_soft_ignore_index(ignore_index)
        return _soft_linear(input, weight, target, bias, opts, reduction, class_weight,
                            return_lse, return_entropy, return_accuracy, shift, single_pass,
                            return_predicted_tokens)
    if shift:
        target = _common.shift_target(target, opts.ignore_index, shift)
    lead = target.shape
    # (reshape(-1, D) cannot infer N when D = 0)
    x = input.reshape(target.numel(), input.shape[-1])
    t = target.reshape(-1).to(torch.int64)
    cw, row_weight = _common.class_weights(class_weight, weight.shape[0], t, opts.ignore_index,
                                           input.dtype)
    plan = _common.plan(x, (weight, bias), (cw,), classes=weight.shape[0],
                        distribution=cw is not None and bool(opts.label_smoothing),
                        row_weight=row_weight is not None, single_pass=single_pass,
                        reduction=reduction, per_token=per_token,
                        argmax=return_accuracy or return_predicted_tokens)
    if plan.distribution:
        # Class weights with label smoothing: a target distribution (y_c = w_c ((1 - eps)
        # [c = t] + eps / V)), its z-loss weighted by the row's weight as torch weights the nll.
        return _distribution(x, weight, t, bias, cw, row_weight, opts, lead, plan,
                             return_lse, return_entropy)
    if plan.composite:
        # float64, functorch transforms, forward-mode AD, D = 0 (the logits are the bias, or 0,
        # as torch's composition has them), V = 0 (the empty sums), and class weights with label
        # smoothing where the fused target distributions do not serve it (the CUDA backend, the
        # accuracy and predicted tokens): flce's formulas in differentiable torch ops.
        _common.check_target_range(t, weight.shape[0], opts.ignore_index)
        logits = _composite.linear_logits(x, weight, bias)
        loss, lse, entropy = _composite.logits_per_token(logits, t, opts, weight=cw)
        acc = _common.reduce_accuracy(
            _composite.accuracy_from_logits(logits, t, opts.ignore_index) if return_accuracy
            else None, t, opts.ignore_index, reduction, lead, return_accuracy)
        return _common.per_token_outputs(
            _common.reduce_loss(loss, t, opts.ignore_index, reduction, lead, row_weight), lse,
            entropy, lead, return_lse, return_entropy, acc,
            _composite.predicted_from_logits(logits, t, opts) if return_predicted_tokens
            else None)
    args = (x, weight, t, bias) + opts.op_args()
    mask = [input.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    if plan.single_pass:
        # The loss is a sum (or mean) whose gradients are known up to the upstream scalar.
        return _ops.ops.sum_and_grad(*args, mask, reduction == "mean",
                                     temperature=opts.temperature,
                                     exact_bf16_grad=exact_bf16_grad)[0]
    argmax = None
    if return_predicted_tokens:
        loss, lse, stats, entropy, argmax = _ops.ops.forward_argmax(
            *args, opts.temperature, exact_bf16_grad=exact_bf16_grad)
    else:
        loss, lse, stats, entropy = _ops.ops.forward(*args, opts.temperature,
                                                     exact_bf16_grad=exact_bf16_grad)
    return _common.outputs_from_stats(loss, lse, stats, entropy, t, opts, lead, row_weight,
                                      return_lse, return_entropy, return_accuracy, argmax)


def _with_z_loss(call, rows, soft, class_weight, z_loss, ignore_index, reduction,
                 label_smoothing, return_lse, return_z_loss, weighting):
    """An entry point's result from ``call(z_loss, return_lse)``, its outputs with the z-loss
    given, plus return_z_loss's output, and the z-loss added apart where z_loss_weighting="none"
    leaves it unweighted beside weighted losses (class weights, probability targets). ``rows()``:
    the target as the rows of the loss (class ids [rows] or probabilities [rows, V]) and their
    leading shape; ``soft``: whether they are probabilities."""
    separate = weighting == "none" and z_loss != 0 and (class_weight is not None or soft)
    if not (return_z_loss or separate):
        return call(z_loss, return_lse)
    out = call(0.0 if separate else z_loss, True)
    t, lead = rows()
    opts = _common.Options(ignore_index, reduction, label_smoothing, z_loss)
    lse = out[1]
    if weighting == "none":
        zw = torch.ones(t.shape[0], device=lse.device) if soft else \
            (t != opts.ignore_index).float()
        row_weight = None
    else:
        zw = _common.row_mass(t, class_weight, opts)
        row_weight = None if soft or class_weight is None else zw

    def reduce(per):  # (as the loss reduces its rows)
        if soft:
            return _common.reduce_rows(per, opts.reduction, lead)
        return _common.reduce_loss(per, t, opts.ignore_index, opts.reduction, lead, row_weight)

    zw = opts.z_loss * zw.to(lse.device)
    loss = out[0]
    if separate:
        flat = lse.reshape(-1)
        loss = loss + reduce(torch.where(zw == 0, 0.0, zw * flat * flat))
    fields = {"loss": loss, "lse": lse} if return_lse else {"loss": loss}
    fields.update((f, x) for f, x in zip(out._fields, out)
                  if f in ("entropy", "accuracy", "predicted_tokens"))
    if return_z_loss:
        fields["z_loss"] = _common.z_loss_output(lse, zw, reduce)
    return _common.named_output(**fields)


def _soft_linear(input, weight, target, bias, opts, reduction, class_weight, return_lse,
                 return_entropy, return_accuracy, shift, single_pass, return_predicted_tokens):
    """Probability targets ``(..., V)``: fused (flce::soft_forward: the target rows read tile by
    tile beside the logits, collapse-safe), or the composite path (flce.reference
    soft_cross_entropy; the ``[N, V]`` logits materialized in float32, float64 for float64
    inputs) for what the fused ops do not serve: gradients of the targets, the accuracy and
    predicted tokens, float64, functorch transforms and the CUDA backend."""
    if shift:
        raise ArgumentError("flce: shift=True takes class-index targets; shift probability "
                            "targets before the call")
    v, d = weight.shape
    lead = tuple(target.shape[:-1])
    # (reshape(-1, d) and reshape(-1, v) cannot infer the rows when D = 0 or V = 0)
    rows = math.prod(lead)
    x = input.reshape(rows, d)
    q = target.reshape(rows, v)
    cw = _common.soft_class_weights(class_weight, v, input.dtype)
    plan = _common.plan(x, (weight, bias), (q, cw), classes=v, distribution=True,
                        single_pass=single_pass, reduction=reduction,
                        per_token=return_lse or return_entropy,
                        argmax=return_accuracy or return_predicted_tokens,
                        target_grad=q.requires_grad)
    if plan.distribution:
        return _distribution(x, weight, q, bias, cw, None, opts, lead, plan, return_lse,
                             return_entropy)
    logits = _composite.linear_logits(x, weight, bias)
    loss, lse, entropy, acc = _composite.soft_per_token(logits, q, opts, cw)
    return _common.per_token_outputs(
        _common.reduce_rows(loss, reduction, lead), lse, entropy, lead, return_lse,
        return_entropy, _common.reduce_rows(acc, reduction, lead) if return_accuracy else None,
        _composite.predicted_from_logits(logits, None, opts) if return_predicted_tokens
        else None)


def _distribution(x, weight, target, bias, cw, row_weight, opts, lead, plan, return_lse,
                  return_entropy):
    """A target distribution on the fused ops (flce::soft_*): probability targets ``[N, V]``, or
    class ids with class weights (``row_weight``: their targets' weights) and label smoothing;
    the single pass (soft_sum_and_grad, the CPU backend's) where flce.linear_cross_entropy's
    rule takes it."""
    mask = [x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    if plan.single_pass:
        return _ops.ops.soft_sum_and_grad(x, weight, target, bias, cw, row_weight,
                                          *opts.op_args(), opts.temperature, mask,
                                          opts.reduction == "mean")[0]
    loss, lse, _, _, entropy = _ops.ops.soft_forward(x, weight, target, bias, cw, row_weight,
                                                     *opts.op_args(), opts.temperature)
    return _common.distribution_outputs(loss, lse, entropy, target, opts, lead, row_weight,
                                        return_lse, return_entropy)


@functools.wraps(_linear_cross_entropy)
def linear_cross_entropy(input, *args, **kwargs):
    # torch's calling convention, F.linear_cross_entropy(input, linear_weight, target,
    # weight=class_weights): with the classifier positional (or as linear_weight=), weight= is
    # the per-class weights (Python itself would otherwise say "got multiple values for argument
    # 'weight'").
    if "weight" in kwargs and (len(args) >= 1 or "linear_weight" in kwargs):
        if "class_weight" in kwargs:
            raise TypeError("flce: pass either weight= (torch's per-class weights) or "
                            "class_weight=, not both")
        kwargs["class_weight"] = kwargs.pop("weight")
    return _linear_cross_entropy(input, *args, **kwargs)


linear_cross_entropy.__signature__ = inspect.signature(_linear_cross_entropy)
# (help() and pydoc name the public function, not the one it wraps)
linear_cross_entropy.__name__ = linear_cross_entropy.__qualname__ = "linear_cross_entropy"


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0, *, z_loss=0.0, softcap=None,
                  temperature=1.0, return_lse=False, return_entropy=False,
                  return_accuracy=False, inplace_backward=False, return_z_loss=False,
                  z_loss_weighting="target", return_predicted_tokens=False):
    r"""Collapse-safe ``torch.nn.functional.cross_entropy`` on given logits.

    A drop-in for ``F.cross_entropy(input, target, weight, ignore_index=..., reduction=...,
    label_smoothing=...)`` with class-index targets, on torch's layouts: ``input`` ``(C)``,
    ``(N, C)`` or ``(N, C, d1, ...)`` (the class dimension is 1, as torch has it), ``target``
    ``()``, ``(N)`` or ``(N, d1, ...)``. The loss is ``softplus(lse_x - z_t)`` and the target's
    gradient ``-sigmoid(lse_x - z_t)``, relatively accurate at every margin where
    ``F.cross_entropy`` rounds both to 0 (docs/numerics.md).

    One read of the logits forward, one read and one write backward, in their own dtype
    (float32, bfloat16, float16): no float32 copy, no ``[N, C]`` buffer beyond the gradient
    (``(N, C, d1, ...)`` inputs are first laid out class-last, one copy). The loss (and lse,
    entropy) is float32; the gradient has the logits' dtype. float64, ``torch.func``
    transforms, forward-mode AD and double backward take the differentiable composite path
    (as :func:`linear_cross_entropy`).

    Args:
        input: the logits.
        target: class indices in ``[0, C)`` or ``ignore_index``, or probabilities shaped like
            ``input`` (soft labels, torch's semantics; fused on the CPU backend: docs/api.md).
        weight: optional per-class weights ``(C,)``, as torch defines them: each token's loss
            times its target's weight, ``"mean"`` divided by the sum of those weights, and with
            label smoothing the smoothing term ``sum_c w_c (-log p_c) / C`` (that combination
            takes the composite path, which materializes float32 logits).
        size_average, ignore_index, reduce, reduction, label_smoothing: as ``F.cross_entropy``,
            in its positional order (``size_average`` and ``reduce``: torch's deprecated
            spelling of ``reduction``, with its meaning and its warning).
        z_loss, softcap, temperature, return_lse, return_entropy, return_accuracy: as
            :func:`linear_cross_entropy` (the softcap and temperature apply to ``input``; with
            ``weight``, a token's z-loss is weighted like its loss; the accuracy is not
            weighted).
        inplace_backward: the backward writes the gradient over ``input``'s storage (as
            Megatron's and TorchTitan's eager losses do) instead of allocating one: pass it only
            when nothing else needs the logits afterwards (autograd raises if something saved
            them). ``input`` is otherwise never written.

        return_z_loss, z_loss_weighting, return_predicted_tokens: as
            :func:`linear_cross_entropy` (the predicted tokens shaped like the loss's rows).

    Returns:
        The loss; where more is asked for, a ``NamedTuple`` of the loss, then the per-token lse
        when ``return_lse`` and the per-token entropy when ``return_entropy`` (shaped like
        ``target``), the accuracy when ``return_accuracy``, the z-loss when ``return_z_loss``
        and the predicted tokens when ``return_predicted_tokens`` (fields ``loss``, ``lse``,
        ``entropy``, ``accuracy``, ``z_loss``, ``predicted_tokens``).
    """
    _common.check_flags(return_z_loss=return_z_loss)
    _common.z_loss_weighting(z_loss_weighting)
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)

    def rows():  # (after the call's checks)
        lead = () if input.dim() == 1 else (input.shape[0],) + tuple(input.shape[2:])
        if _common.is_soft(target):
            y = target.reshape(1, -1) if input.dim() == 1 else target.movedim(1, -1)
            return y.reshape(-1, y.shape[-1]), lead
        return target.reshape(-1), lead

    def call(zl, lse):
        return _cross_entropy_outputs(
            input, target, weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, z_loss=zl, softcap=softcap,
            temperature=temperature, return_lse=lse, return_entropy=return_entropy,
            return_accuracy=return_accuracy, inplace_backward=inplace_backward,
            return_predicted_tokens=return_predicted_tokens)
    return _with_z_loss(call, rows, _common.is_soft(target), weight, z_loss, ignore_index,
                        reduction, label_smoothing, return_lse, return_z_loss, z_loss_weighting)


def _cross_entropy_outputs(input, target, weight=None, *, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                           return_lse=False, return_entropy=False, return_accuracy=False,
                           inplace_backward=False, return_predicted_tokens=False):
    """cross_entropy's outputs, the z-loss's in the loss as given."""
    _common.check_tensor("input", input)
    if _common.is_dtensor(input):
        # (its argument checks run in the ranks' exchange: linear_cross_entropy's note)
        from . import parallel

        return parallel.cross_entropy_dtensor(
            input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            temperature=temperature, return_lse=return_lse, return_entropy=return_entropy,
            return_accuracy=return_accuracy, inplace_backward=inplace_backward,
            return_predicted_tokens=return_predicted_tokens)
    opts = _common.Options(ignore_index, reduction, label_smoothing, z_loss, softcap,
                           temperature)
    if input.dim() == 0:
        raise ArgumentError("flce: input must have shape (C), (N, C) or (N, C, d1, ...), got a "
                            "0-d tensor")
    if input.dtype not in _common.FLOAT_DTYPES:
        raise _common.DtypeError(f"flce: input must be float32, bfloat16, float16 or float64, "
                                 f"got {input.dtype}")
    _common.check_flags(return_lse=return_lse, return_entropy=return_entropy,
                        return_accuracy=return_accuracy, inplace_backward=inplace_backward)
    _common.check_flags(return_predicted_tokens=return_predicted_tokens)
    c = input.shape[0] if input.dim() == 1 else input.shape[1]
    lead = () if input.dim() == 1 else (input.shape[0],) + tuple(input.shape[2:])
    target = _common.unbatched_target(input, target)
    soft = _common.is_soft(target)
    if soft:
        _common.check_soft_ignore_index(ignore_index)
        _common.check_soft_target(target, input.shape, "input's shape", class_shape=lead)
        if inplace_backward:
            raise ArgumentError("flce: inplace_backward=True takes class-index targets (the "
                                "gradient of probability targets is not written over the "
                                "logits)")
    else:
        # (torch's layout: logits (B, T, V) read as N=B rows of T classes over V positions)
        hint = ("; flce.cross_entropy takes torch's layout, classes in dimension 1: for (B, T, V) "
                "logits pass logits.flatten(0, -2) and target.flatten() (or use "
                "flce.linear_cross_entropy on the hidden states, shift=True for next-token "
                "targets)" if input.dim() >= 3 and tuple(target.shape) == tuple(input.shape[:-1])
                else "")
        _common.check_target(target, lead, "input's shape without the class dimension 1", hint)
    _common.check_one_device((("input", input), ("target", target), ("weight", weight)))
    if input.is_cuda:
        _build.check_cuda_device(input.device)
    # [rows, C], class-last: a view for (C) and (N, C), one copy for (N, C, d1, ...).
    # (reshape(-1, C) cannot infer the rows when C = 0)
    rows = math.prod(lead)
    logits = input.reshape(1, c) if input.dim() == 1 else \
        input.movedim(1, -1).reshape(rows, c)
    if logits.stride(1) != 1 and c > 1:
        logits = logits.contiguous()
    if soft:
        y = target.reshape(1, c) if input.dim() == 1 else target.movedim(1, -1).reshape(rows, c)
        cw = _common.soft_class_weights(weight, c, input.dtype)
        if _common.plan(logits, (), (y, cw), classes=c, distribution=True, linear=False,
                        argmax=return_accuracy or return_predicted_tokens,
                        target_grad=y.requires_grad).distribution:
            # Fused: the target rows read chunk by chunk beside the logits.
            loss, lse, _, _, entropy = _ops.ops.soft_logits_forward(
                logits, y, cw, None, *opts.op_args(), opts.temperature)
            return _common.distribution_outputs(loss, lse, entropy, None, opts, lead, None,
                                                return_lse, return_entropy)
        cdt = _composite.compute_dtype(input.dtype)
        loss, lse, entropy, acc = _composite.soft_per_token(
            logits.to(cdt), y, opts, cw)
        return _common.per_token_outputs(
            _common.reduce_rows(loss, reduction, lead), lse, entropy, lead, return_lse,
            return_entropy,
            _common.reduce_rows(acc, reduction, lead) if return_accuracy else None,
            _composite.predicted_from_logits(logits, None, opts) if return_predicted_tokens
            else None)
    t = target.reshape(-1).to(torch.int64)
    cw, row_weight = _common.class_weights(weight, c, t, opts.ignore_index, input.dtype)
    plan = _common.plan(logits, (), (weight,), classes=c, linear=False,
                        distribution=cw is not None and bool(opts.label_smoothing),
                        argmax=return_accuracy or return_predicted_tokens,
                        inplace=inplace_backward)
    if plan.distribution:
        # Class weights with label smoothing: a target distribution (linear_cross_entropy's).
        loss, lse, _, _, entropy = _ops.ops.soft_logits_forward(
            logits, t, cw, row_weight, *opts.op_args(), opts.temperature)
        return _common.distribution_outputs(loss, lse, entropy, t, opts, lead, row_weight,
                                            return_lse, return_entropy)
    if plan.composite:
        _common.check_target_range(t, c, opts.ignore_index)
        cdt = _composite.compute_dtype(input.dtype)
        loss, lse, entropy = _composite.logits_per_token(
            logits.to(cdt), t, opts, weight=cw)
        acc = _composite.accuracy_from_logits(logits, t, opts.ignore_index) \
            if return_accuracy else None
        predicted = _composite.predicted_from_logits(logits, t, opts) \
            if return_predicted_tokens else None
    else:
        if inplace_backward and torch.is_grad_enabled():
            _common.check_inplace_target(logits, input, "input")
        op = _ops.ops.logits_forward_argmax if return_predicted_tokens else \
            _ops.ops.logits_forward
        loss, lse, stats, entropy, *argmax = op(
            logits, t, opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap,
            opts.temperature, return_entropy, inplace_backward)
        if row_weight is not None:
            loss = loss * row_weight
        acc = _common.accuracy_from_stats(stats, t, opts.ignore_index) \
            if return_accuracy else None
        predicted = _common.predicted_from_stats(stats, argmax[0], t, opts.ignore_index) \
            if return_predicted_tokens else None
    return _common.per_token_outputs(
        _common.reduce_loss(loss, t, opts.ignore_index, reduction, lead, row_weight), lse,
        entropy, lead, return_lse, return_entropy,
        _common.reduce_accuracy(acc, t, opts.ignore_index, reduction, lead, return_accuracy),
        predicted)


def _alias(name, value, torch_name, torch_value):
    if torch_value is None:
        return value
    if value is not None:
        raise TypeError(f"flce: pass either {name} or {torch_name}, not both")
    return torch_value


class LinearCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`linear_cross_entropy`; call as ``module(input, weight, target)``.
    ``class_weight`` (per-class weights, as ``torch.nn.CrossEntropyLoss``'s ``weight``) is a
    buffer: it follows the module's ``.to()`` and ``state_dict``."""

    def __init__(self, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                 softcap=None, temperature=1.0, return_lse=False, return_entropy=False,
                 return_accuracy=False, shift=False, single_pass=None, exact_bf16_grad=None,
                 class_weight=None, return_z_loss=False, z_loss_weighting="target",
                 return_predicted_tokens=False):
        super().__init__()
        _common.Options(ignore_index, reduction, label_smoothing, z_loss, softcap, temperature)
        _common.check_flags(return_lse=return_lse, return_entropy=return_entropy,
                            return_accuracy=return_accuracy, return_z_loss=return_z_loss,
                            return_predicted_tokens=return_predicted_tokens)
        _common.shift_amount(shift)
        _common.z_loss_weighting(z_loss_weighting)
        if class_weight is not None:
            _common.check_tensor("class_weight", class_weight)
        self.register_buffer("class_weight", class_weight)
        _common.check_single_pass(single_pass, reduction, return_lse or return_entropy or
                                  return_accuracy or return_predicted_tokens)
        _common.exact_bf16_grad(exact_bf16_grad)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature
        self.return_lse = return_lse
        self.return_entropy = return_entropy
        self.return_accuracy = return_accuracy
        self.shift = shift
        self.single_pass = single_pass
        self.exact_bf16_grad = exact_bf16_grad
        self.return_z_loss = return_z_loss
        self.z_loss_weighting = z_loss_weighting
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, input, weight, target, bias=None):
        return linear_cross_entropy(input, weight, target, bias=bias,
                                    ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    softcap=self.softcap, temperature=self.temperature,
                                    return_lse=self.return_lse,
                                    return_entropy=self.return_entropy,
                                    return_accuracy=self.return_accuracy, shift=self.shift,
                                    single_pass=self.single_pass,
                                    exact_bf16_grad=self.exact_bf16_grad,
                                    class_weight=self.class_weight,
                                    return_z_loss=self.return_z_loss,
                                    z_loss_weighting=self.z_loss_weighting,
                                    return_predicted_tokens=self.return_predicted_tokens)

    def extra_repr(self):
        # (the options set away from their defaults, as torch's modules print theirs)
        shown = [f"reduction={self.reduction!r}", f"ignore_index={self.ignore_index}"]
        for name, default in (("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None),
                              ("temperature", 1.0), ("return_lse", False),
                              ("return_entropy", False), ("return_accuracy", False),
                              ("shift", False), ("single_pass", None),
                              ("exact_bf16_grad", None), ("return_z_loss", False),
                              ("z_loss_weighting", "target"),
                              ("return_predicted_tokens", False)):
            if getattr(self, name) != default:
                shown.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(shown)
