"""The public API: ``flce.linear_cross_entropy`` and ``flce.LinearCrossEntropy``."""
import math

import torch

from . import _build, _ops

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")


def _validate(input, weight, target, bias, reduction, label_smoothing, z_loss, softcap,
              temperature=1.0):
    for name, t in (("input", input), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flce: {name} must be a torch.Tensor, got {type(t).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"flce: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if input.dim() < 1:
        raise ValueError("flce: input must have shape (..., D), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"flce: weight must have shape (V, D), got {tuple(weight.shape)}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"flce: input's last dimension ({input.shape[-1]}) must equal weight's "
                         f"D ({weight.shape[1]}); input {tuple(input.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"flce: target must have shape {tuple(input.shape[:-1])} (input's "
                         f"leading dimensions), got {tuple(target.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex:
        raise TypeError(f"flce: target must hold class indices (an integer tensor), got "
                        f"{target.dtype}; probability targets are not supported")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"flce: input must be float32, bfloat16 or float16, got {input.dtype} "
                        "(use flce.reference for float64)")
    if weight.dtype not in (input.dtype, torch.float32):
        raise TypeError(f"flce: weight must have input's dtype ({input.dtype}) or be float32 "
                        f"master weights, got {weight.dtype}")
    devices = {("input", input.device), ("weight", weight.device), ("target", target.device)}
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"flce: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"flce: bias must have shape ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"flce: bias must have weight's dtype ({weight.dtype}), got "
                            f"{bias.dtype}")
        devices.add(("bias", bias.device))
    if len({d for _, d in devices}) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in sorted(devices, key=lambda x: x[0]))
        raise ValueError(f"flce: all tensors must be on one device, got {listing}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"flce: label_smoothing must be in [0, 1], got {label_smoothing}")
    # Written so that NaN fails too; inf would silently turn every loss into NaN or inf.
    if not 0 <= z_loss < math.inf:
        raise ValueError(f"flce: z_loss must be a finite number >= 0, got {z_loss}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"flce: softcap must be a positive finite number or None, got {softcap}")
    if isinstance(temperature, torch.Tensor) or not 0 < temperature < math.inf:
        raise ValueError(f"flce: temperature must be a positive finite number, got {temperature!r}")


def linear_cross_entropy(input, weight=None, target=None, *, bias=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                         temperature=1.0, return_lse=False, return_entropy=False,
                         single_pass=None, linear_weight=None, linear_bias=None, options=None):
    r"""Fused, collapse-safe ``cross_entropy(input @ weight.T + bias, target)``.

    A drop-in for ``torch.nn.functional.linear_cross_entropy(input, linear_weight, target, ...)``
    on the arguments they share (``linear_weight`` and ``linear_bias`` are accepted as torch's
    keyword names; torch's ``options`` chunking hints are ignored, flce picks its own tiles).
    The ``[N, V]`` logits are never materialized.

    Args:
        input: ``(..., D)`` hidden states, float32, bfloat16 or float16.
        weight: ``(V, D)`` classifier (``lm_head.weight``), input's dtype or float32 master
            weights (then the computation runs in input's dtype and ``weight.grad`` comes out in
            float32 straight from flce's float32 accumulators).
        target: ``(...)`` class indices in ``[0, V)`` or ``ignore_index``.
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
            computed from the online statistics without cancellation (it keeps its relative
            accuracy near collapse, where ``H -> 0``). The per-token log-probability of the
            target is ``-loss`` with ``reduction="none"`` (rollout scoring: call under
            ``torch.no_grad()``, which saves nothing for a backward).
        single_pass: compute the gradients in the forward pass (3 GEMMs instead of 4: no
            recompute of the logits in the backward), which then only scales them by the
            upstream gradient. ``None`` (default): on for training (gradients needed,
            reduction ``"mean"``/``"sum"``, no ``return_lse``/``return_entropy``) with bf16
            inputs, and with fp32 inputs on CUDA; off otherwise. On the CPU with fp32 inputs
            it is ~1.2x faster for ~2.7x the memory of the default (docs/cpu-backend.md).
            ``True``/``False`` force it on either backend (``True`` needs reduction
            ``"mean"``/``"sum"`` and neither ``return_lse`` nor ``return_entropy``).

    Returns:
        The loss in float32 (whatever the input dtype), then the lse when ``return_lse``, then
        the entropy when ``return_entropy``.
    """
    weight = _alias("weight", weight, "linear_weight", linear_weight)
    bias = _alias("bias", bias, "linear_bias", linear_bias)
    if weight is None or target is None:
        raise TypeError("flce: linear_cross_entropy needs input, weight and target")
    del options
    if ignore_index is None:
        ignore_index = -100
    _validate(input, weight, target, bias, reduction, label_smoothing, z_loss, softcap,
              temperature)
    if input.is_cuda:
        _build.check_cuda_device(input.device)

    # DTensor weights sharded over the vocabulary go to the vocab-parallel path.
    if _is_dtensor(weight):
        from . import parallel

        if parallel.is_vocab_sharded(weight):
            return parallel.linear_cross_entropy_dtensor(
                input, weight, target, bias=bias, ignore_index=ignore_index,
                reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap, temperature=temperature, return_lse=return_lse,
                return_entropy=return_entropy)

    lead = target.shape
    x = input.reshape(-1, input.shape[-1])
    t = target.reshape(-1).to(torch.int64)
    args = (x, weight, t, bias, int(ignore_index), float(label_smoothing), float(z_loss),
            float(softcap or 0.0))
    mask = [input.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    per_token = return_lse or return_entropy
    if _single_pass(single_pass, reduction, per_token, x) and any(mask) and \
            torch.is_grad_enabled():
        # The loss is a sum (or mean) whose gradients are known up to the upstream scalar.
        return _ops.ops.sum_and_grad(*args, mask, reduction == "mean",
                                     temperature=float(temperature))[0]
    loss, lse, _, entropy = _ops.ops.forward(*args, float(temperature))
    return per_token_outputs(reduce_loss(loss, t, ignore_index, reduction, lead), lse, entropy,
                             lead, return_lse, return_entropy)


def per_token_outputs(loss, lse, entropy, lead, return_lse, return_entropy):
    """``loss`` alone, or ``(loss, [lse], [entropy])`` shaped like the target."""
    if not (return_lse or return_entropy):
        return loss
    out = (loss,)
    if return_lse:
        out += (lse.reshape(lead),)
    if return_entropy:
        out += (entropy.reshape(lead),)
    return out


def _single_pass(single_pass, reduction, per_token, x):
    """Whether the loss and its gradients come from the single pass (flce::sum_and_grad);
    per_token: lse or entropy outputs are asked for (the single pass returns the loss alone)."""
    if single_pass is None:
        # fp16 stays on the recompute path: its gradient tile needs a scale that depends on
        # every row's statistics, which the single pass has only row chunk by row chunk. On the
        # CPU, fp32 does too: the single pass holds dW's Kahan compensation for the whole
        # vocabulary and a row block's logits, ~3x chunked torch's memory where the recompute
        # path stays at it (docs/cpu-backend.md). bf16's memory stays below chunked's either
        # way, and the single pass saves a logit GEMM, except where bf16 GEMMs run on AMX: there
        # that GEMM is cheap, and the single pass's streaming of dW's accumulators costs more
        # (1.15 s against 0.88 s on a 2-core Xeon, docs/benchmarks.md).
        if reduction == "none" or per_token or x.dtype == torch.float16:
            return False
        if _ops.is_cuda_backend(x):
            return True
        return x.dtype == torch.bfloat16 and not _ops.CPU_BF16_AMX
    if single_pass not in (True, False):
        raise TypeError(f"flce: single_pass must be None, True or False, got {single_pass!r}")
    if single_pass and (reduction == "none" or per_token):
        raise ValueError("flce: single_pass needs reduction 'mean' or 'sum' and neither "
                         f"return_lse nor return_entropy; got reduction={reduction!r}, "
                         f"per-token outputs: {per_token}")
    return single_pass


def _alias(name, value, torch_name, torch_value):
    if torch_value is None:
        return value
    if value is not None:
        raise TypeError(f"flce: pass either {name} or {torch_name}, not both")
    return torch_value


def reduce_loss(loss, target, ignore_index, reduction, shape):
    """Reduce per-token losses as torch does (mean over non-ignored tokens), without host syncs."""
    if reduction == "none":
        return loss.reshape(shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


def _is_dtensor(t):
    # By name: importing torch.distributed.tensor here would slow down `import flce`.
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


class LinearCrossEntropy(torch.nn.Module):
    """``nn.Module`` form of :func:`linear_cross_entropy`; call as ``module(input, weight, target)``."""

    def __init__(self, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                 softcap=None, temperature=1.0, return_lse=False, return_entropy=False,
                 single_pass=None):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"flce: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature
        self.return_lse = return_lse
        self.return_entropy = return_entropy
        self.single_pass = single_pass

    def forward(self, input, weight, target, bias=None):
        return linear_cross_entropy(input, weight, target, bias=bias,
                                    ignore_index=self.ignore_index, reduction=self.reduction,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    softcap=self.softcap, temperature=self.temperature,
                                    return_lse=self.return_lse,
                                    return_entropy=self.return_entropy,
                                    single_pass=self.single_pass)

    def extra_repr(self):
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
                f"softcap={self.softcap}, temperature={self.temperature}")
