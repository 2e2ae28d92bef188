"""TRL's trainers with flce computing their per-token log-probabilities, entropy and accuracy.

TRL (1.16) computes every trainer's token statistics in one place: ``add_fused_lm_head`` gives
the model a forward that, called with ``fused_lm_head=True``, runs the backbone and hands the
final hidden states, the head's weight and bias and the labels to one chunked kernel
(``trl.trainer.utils._ChunkedLogProbFunction``), which returns the per-token log-probability of
each label and, as each trainer asks, the entropy, whether the label is the top-1 prediction,
the mean logit and ``log(sum_v p_v^2)``. ``SFTTrainer`` (its loss, ``entropy`` and
``mean_token_accuracy``), ``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` and ``KTOTrainer``
all go through it.

:func:`patch` puts flce in that kernel's place: the log-probability is ``-nll`` of
:func:`flce.linear_cross_entropy` (collapse-safe: it does not round to 0 for a confident
prediction), the entropy and the top-1 flag come from the same fused pass
(``return_entropy``, ``return_accuracy``), and the ``[N, V]`` logits are never built. All of
TRL's own logic around the kernel stays TRL's: the label shift, the masks, ``num_items_in_batch``,
the temperature, the logit scale and softcap it reads from the config, the MoE router loss,
PEFT, FSDP/ZeRO-3 gathering of the head. ``mean_logits`` and ``log_sum_sq_probs`` (DPO's
``logits/*`` metrics and WPO's weights; no gradient) are computed from logits materialized a
bounded block of rows at a time.

    import flce.integrations.trl
    flce.integrations.trl.patch()      # before or after building the trainers
    trainer = trl.SFTTrainer(model=model, ...)
    trainer.train()

TRL's ``use_liger_kernel=True`` is unrelated: TRL 1.16 keeps Liger's layer kernels but turns its
fused linear cross-entropy off in favour of this kernel, so the two combine.
"""
import inspect

import torch
import torch.nn.functional as F

from ..api import linear_cross_entropy

__all__ = ["patch", "unpatch", "fused_log_probs"]

# The kernel's parameters as TRL calls it (positionally); patch() refuses a TRL whose kernel
# takes others, rather than feed flce misplaced arguments.
_KERNEL_PARAMS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                  "final_logit_softcapping", "logit_scale", "outputs")
_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Rows of logits materialized at once for mean_logits / log_sum_sq_probs: 16M fp32 (64 MiB).
_MOMENT_ELEMENTS = 1 << 24


def fused_log_probs(hidden, weight, bias, targets, temperature, chunk_size,
                    final_logit_softcapping=None, logit_scale=1.0, outputs=("log_probs",)):
    """TRL's ``ChunkedLogProbFunction.apply`` computed by flce.

    Args:
        hidden: ``(N, D)`` hidden states (TRL passes the positions it scores).
        weight: ``(V, D)`` head weight; bias: ``(V,)`` or None.
        targets: ``(N,)`` labels in ``[0, V)``.
        temperature: the logits are divided by it (after the softcap).
        chunk_size: TRL's vocabulary tile; flce picks its own, so it is unused.
        final_logit_softcapping: the softcap, or None.
        logit_scale: a factor on ``hidden @ weight.T + bias``, before the softcap.
        outputs: which of ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1`` to
            compute (``log_probs`` always is).

    Returns:
        ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``(N,)`` or None
        where not asked for; float32 (``is_top1`` bool). ``log_probs`` and ``entropy`` are
        differentiable with respect to ``hidden``, ``weight`` and ``bias``.
    """
    del chunk_size
    unknown = set(outputs) - set(_OUTPUTS)
    if unknown:
        raise ValueError(f"flce.integrations.trl: unknown outputs {sorted(unknown)}; TRL's kernel "
                         f"computes {_OUTPUTS}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What the head's matmul would run in; a float32 weight stays the master weight.
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if weight.dtype != hidden.dtype and weight.dtype != torch.float32:
        # e.g. TRL's cast_lm_head_to_fp32 (float32 hidden states) with a bf16 head.
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    if logit_scale != 1.0:
        # scale * (h . w + b) = (scale * h) . w + scale * b, ahead of the softcap as in TRL.
        hidden = hidden * logit_scale
        bias = None if bias is None else bias * logit_scale
    want_entropy, want_top1 = "entropy" in outputs, "is_top1" in outputs
    res = linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="none",
                               softcap=final_logit_softcapping, temperature=temperature,
                               return_entropy=want_entropy, return_accuracy=want_top1)
    if not isinstance(res, tuple):
        res = (res,)
    log_probs = -res[0]
    entropy = res[1] if want_entropy else None
    is_top1 = res[-1].bool() if want_top1 else None
    log_sum_sq_probs = mean_logits = None
    if "mean_logits" in outputs or "log_sum_sq_probs" in outputs:
        mean_logits, log_sum_sq_probs = _logit_moments(
            hidden, weight, bias, final_logit_softcapping, temperature,
            "mean_logits" in outputs, "log_sum_sq_probs" in outputs)
    return log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1


@torch.no_grad()
def _logit_moments(hidden, weight, bias, softcap, temperature, want_mean, want_sq):
    """Per row, the mean of the transformed logits and ``log(sum_v p_v^2)``, a block of rows
    at a time (these two need every logit; neither takes a gradient in TRL)."""
    n, v = hidden.shape[0], weight.shape[0]
    mean = torch.empty(n, device=hidden.device, dtype=torch.float32) if want_mean else None
    sq = torch.empty(n, device=hidden.device, dtype=torch.float32) if want_sq else None
    rows = max(1, _MOMENT_ELEMENTS // max(v, 1))
    w = weight.to(hidden.dtype)
    b = None if bias is None else bias.to(hidden.dtype)
    for start in range(0, n, rows):
        z = F.linear(hidden[start:start + rows], w, b).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        if want_mean:
            mean[start:start + rows] = z.mean(-1)
        if want_sq:
            sq[start:start + rows] = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    return mean, sq


class _FlceKernel:
    """What TRL calls: ``_ChunkedLogProbFunction.apply(...)``."""

    apply = staticmethod(fused_log_probs)


def _trl_utils():
    try:
        import trl.trainer.utils as utils
    except ImportError as e:
        raise ImportError("flce.integrations.trl needs TRL (pip install trl)") from e
    return utils


def patch():
    """Make TRL's trainers compute their token statistics with flce (see the module's doc).

    Idempotent; affects every trainer and every model given TRL's fused head in this process,
    including those built before the call. Raises ``RuntimeError`` for a TRL without the
    kernel, or whose kernel takes other arguments than the ones flce replaces (TRL 1.16's).
    """
    utils = _trl_utils()
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is _FlceKernel:
        return
    import trl

    if current is None or not hasattr(current, "forward"):
        raise RuntimeError(f"flce.integrations.trl: TRL {trl.__version__} has no chunked "
                           "log-probability kernel (trl.trainer.utils._ChunkedLogProbFunction, "
                           "TRL 1.16) for flce to replace")
    params = tuple(inspect.signature(current.forward).parameters)[1:]  # (after ctx)
    if params != _KERNEL_PARAMS:
        raise RuntimeError(f"flce.integrations.trl: TRL {trl.__version__}'s kernel takes "
                           f"{params}, not the {_KERNEL_PARAMS} flce was written against "
                           "(TRL 1.16); leave it unpatched")
    utils._flce_original_kernel = current
    utils._ChunkedLogProbFunction = _FlceKernel


def unpatch():
    """Give TRL its own kernel back."""
    utils = _trl_utils()
    original = vars(utils).pop("_flce_original_kernel", None)
    if original is not None:
        utils._ChunkedLogProbFunction = original
