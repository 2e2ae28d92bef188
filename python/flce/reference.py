"""A pure-PyTorch linear cross-entropy with flce's semantics: the test oracle.

Collapse-safe (``softplus(lse_x - z_t)``, not ``lse - z_t``), every option of
:func:`flce.linear_cross_entropy`, any dtype. It materializes the ``[N, V]`` logits, so use it in
float64 on small and medium shapes to check an implementation, not to train.
Autograd through it gives the collapse-safe gradient: the target column's gradient is
``-sigmoid(lse_x - z_t)`` (computed by autograd of the softplus form), not ``p_t - 1``.
"""
import torch

__all__ = ["linear_cross_entropy", "logits_cross_entropy"]


def logits_cross_entropy(logits, target, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                         return_lse=False, return_entropy=False, vocab_size=None, weight=None):
    """Collapse-safe cross-entropy of ``logits`` ``[N, V]`` against ``target`` ``[N]``.

    Computes in the dtype of ``logits`` (pass float64 for a reference). ``vocab_size`` is the
    label-smoothing denominator (default ``V``). ``temperature`` divides the (capped) logits.
    ``return_entropy`` also returns the per-token entropy of softmax(logits) (0 where ignored),
    in the cancellation-free form of NUMERICS.md (accurate in float64 at any margin).
    ``weight``: per-class weights ``[V]`` as torch defines them: a row's nll (and its z-loss)
    times the weight of its target, the smoothing term ``sum_c w_c (-log p_c) / V`` unweighted by
    the row, and ``"mean"`` divided by the sum of the non-ignored rows' target weights.
    """
    if ignore_index is None:
        ignore_index = -100
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    n, v = logits.shape
    vocab_size = v if vocab_size is None else vocab_size
    valid = target != ignore_index
    safe_t = torch.where(valid, target, torch.zeros_like(target))
    z_t = logits.gather(1, safe_t[:, None])[:, 0]
    is_t = torch.zeros_like(logits, dtype=torch.bool)
    is_t.scatter_(1, safe_t[:, None], valid[:, None])
    # Ignored rows have no target: every logit enters lse_x.
    lse_x = torch.logsumexp(logits.masked_fill(is_t, float("-inf")), dim=1)
    # An ignored row has no target logit (lse = lse_x, loss 0). Its z_t stays a finite stand-in
    # inside the formulas, selected away by torch.where: an infinite one would put 0 * inf into
    # their higher derivatives (double backward, jvp).
    z_t = torch.where(valid, z_t, torch.zeros_like(z_t))
    lse = torch.where(valid, torch.logaddexp(lse_x, z_t), lse_x)
    nll = torch.nn.functional.softplus(lse_x - z_t)
    # softplus's threshold (20) switches to x, which is fine; for lse_x - z_t -> -inf it is exp.
    row_weight = None
    if weight is not None:
        w = weight.to(logits.dtype)
        row_weight = torch.where(valid, w[safe_t], torch.zeros_like(z_t))
        nll = row_weight * nll
    loss = nll
    if label_smoothing:
        if weight is None:
            smooth = lse - logits.sum(1) / vocab_size
        else:
            smooth = (w.sum() * lse - logits @ w) / vocab_size
        loss = (1 - label_smoothing) * nll + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * lse * lse * (1.0 if weight is None else row_weight)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    loss = _reduce(loss, valid, reduction, row_weight)
    out = (loss,)
    if return_lse:
        out += (lse,)
    if return_entropy:
        # H = p_t nll + q (softplus(z_t - lse_x) + H_x) with H_x the entropy of the non-target
        # distribution: every term >= 0 (-sum p log p would lose the target's p_t log p_t,
        # ~ -q, once lse rounds to z_t, a relative error of 1 / (1 + margin)).
        rest = logits.masked_fill(is_t, float("-inf"))
        # A row with no non-target logit (V = 1) has lse_x = -inf: H_x = 0 (its weights are
        # all 0), not (-inf) - (-inf).
        finite = torch.isfinite(lse_x)
        logw = rest - torch.where(finite, lse_x, torch.zeros_like(lse_x))[:, None]
        w = logw.exp()
        h_x = -(w * logw.masked_fill(is_t | ~finite[:, None], 0.0)).sum(1)
        # q softplus(-d) -> 0 as d -> -inf (V = 1: p_t = 1), where 0 * inf would be NaN; no
        # finite margin comes near the clamp.
        d = (lse_x - z_t).clamp(min=-1e4)
        ent = torch.sigmoid(-d) * torch.nn.functional.softplus(d) + torch.sigmoid(d) * (
            torch.nn.functional.softplus(-d) + h_x)
        out += (torch.where(valid, ent, torch.zeros_like(ent)),)
    return out if len(out) > 1 else loss


def linear_cross_entropy(input, weight, target, *, bias=None, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                         temperature=1.0, return_lse=False, return_entropy=False):
    """``logits_cross_entropy(input @ weight.T + bias, target, ...)`` in the input's dtype."""
    d = input.shape[-1]
    logits = input.reshape(-1, d) @ weight.T
    if bias is not None:
        logits = logits + bias
    out = logits_cross_entropy(logits, target.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing,
                               z_loss=z_loss, softcap=softcap, temperature=temperature,
                               return_lse=return_lse, return_entropy=return_entropy)
    if not (return_lse or return_entropy):
        return out.reshape(target.shape) if reduction == "none" else out
    shape = target.shape
    loss, *per_token = out
    return (loss.reshape(shape) if reduction == "none" else loss,
            *(t.reshape(shape) for t in per_token))


def _reduce(loss, valid, reduction, row_weight=None):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        # torch semantics: mean over non-ignored tokens (weighted: over their target weights);
        # 0/0 = nan when every token is ignored.
        return loss.sum() / (valid.sum() if row_weight is None else row_weight.sum())
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
