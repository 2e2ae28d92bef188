"""A pure-PyTorch linear cross-entropy with flce's semantics: the test oracle.

Collapse-safe (``softplus(lse_x - z_t)``, not ``lse - z_t``), any dtype: the options of
:func:`flce.linear_cross_entropy` but ``shift`` and ``return_accuracy``, per-class weights on
given logits (:func:`logits_cross_entropy`), probability targets
(:func:`soft_cross_entropy`) and distillation (:func:`distillation`). It materializes the ``[N, V]`` logits, so use it in
float64 on small and medium shapes to check an implementation, not to train.
Autograd through it gives the collapse-safe gradient: the target column's gradient is
``-sigmoid(lse_x - z_t)`` (computed by autograd of the softplus form), not ``p_t - 1``.
"""
import math

import torch

__all__ = ["linear_cross_entropy", "logits_cross_entropy", "soft_cross_entropy", "distillation"]


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
    logits = transformed_logits(logits, softcap, temperature)
    n, v = logits.shape
    vocab_size = v if vocab_size is None else vocab_size
    valid = target != ignore_index
    if v == 0:
        # No class: an ignored row's loss and entropy are the empty sums (zeros that keep the
        # graph), its lse -inf; a target (out of every range) has no probability: NaN.
        zero = logits.sum(1)
        loss = torch.where(valid, float("nan"), zero)
        row_weight = None if weight is None else zero
        out = (_reduce(loss, valid, reduction, row_weight),)
        out += (zero - float("inf"),) if return_lse else ()
        out += (zero,) if return_entropy else ()
        return out if len(out) > 1 else out[0]
    # A target outside [0, V) has no logit: its row is NaN (flce's ops raise IndexError for it
    # first); safe_t keeps the gather and scatter inside the row.
    bad = valid & ((target < 0) | (target >= v))
    valid = valid & ~bad
    safe_t = torch.where(valid, target, torch.zeros_like(target))
    z_t = logits.gather(1, safe_t[:, None])[:, 0]
    is_t = torch.zeros_like(logits, dtype=torch.bool)
    is_t.scatter_(1, safe_t[:, None], valid[:, None])
    # Every logsumexp is taken of the logits less the row's largest one, M (a constant of the
    # graph: the shift cancels from every formula and its derivatives), and lse_x - z_t as
    # (lse_x - M) - (z_t - M): lse_x itself is rounded at the logits' scale, which a common
    # offset of the row's logits makes far larger than the loss (math.h lse_gap). M is the
    # largest non-target logit, as the kernels' m_x: a row without one above -inf keeps M = 0; a
    # +inf (or NaN) one makes lse_x NaN (inf - inf), as in flce's kernels and torch's
    # log_softmax, while a +inf target gives lse = +inf and a NaN loss, as the kernels do.
    # Ignored rows have no target: every logit enters lse_x.
    top = logits.detach().masked_fill(is_t, float("-inf")).amax(dim=1)
    shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    zx = (logits - shift[:, None]).masked_fill_(is_t, float("-inf"))
    # A row with no non-target logit above -inf (a masked vocabulary but its target) has
    # lse_x = -inf; its logsumexp is taken of zeros instead, whose backward is finite (the
    # logsumexp of -inf only has exp(-inf - -inf) = NaN in its backward, which the GEMM spreads
    # over dE and dW).
    empty = top == float("-inf")
    lse_xs = torch.where(empty, float("-inf"),
                         torch.logsumexp(zx.masked_fill(empty[:, None], 0.0), dim=1))
    lse_x = lse_xs + shift
    # An ignored row has no target logit (lse = lse_x, loss 0). Its z_t stays a finite stand-in
    # inside the formulas, selected away by torch.where: an infinite one would put 0 * inf into
    # their higher derivatives (double backward, jvp).
    z_t = torch.where(valid, z_t, torch.zeros_like(z_t))
    z_ts = z_t - shift
    lse = torch.where(valid, torch.logaddexp(lse_xs, z_ts) + shift, lse_x)
    # (a +inf target logit: NaN, as torch's inf - inf, not softplus(-inf) = 0)
    nll = torch.where(z_t == float("inf"), float("nan"), _softplus(lse_xs - z_ts))
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
    loss = torch.where(valid, loss, torch.where(bad, float("nan"), torch.zeros_like(loss)))
    loss = _reduce(loss, valid | bad, reduction, row_weight)
    out = (loss,)
    if return_lse:
        out += (lse,)
    if return_entropy:
        # H = p_t nll + q (softplus(z_t - lse_x) + H_x) with H_x the entropy of the non-target
        # distribution: every term >= 0 (-sum p log p would lose the target's p_t log p_t,
        # ~ -q, once lse rounds to z_t, a relative error of 1 / (1 + margin)).
        # H_x = log1p(r) + u / (1 + r), pivoted on the row's largest non-target logit m:
        # r = sum of exp(z_j - m) over the other non-target logits (the pivot's own exp(0) = 1 left
        # out, so that r keeps its relative accuracy where 1 + r rounds to 1: a non-target class
        # that dominates the rest), u = sum exp(z_j - m) (m - z_j) >= 0. Every term >= 0.
        rest = logits.masked_fill(is_t, float("-inf"))
        m, pivot = rest.max(dim=1, keepdim=True)
        # A row with no finite non-target logit (V = 1, or all -inf) has H_x = 0; the finite
        # stand-ins keep (-inf) - (-inf) and 0 * inf out of the formulas and their derivatives.
        live = torch.isfinite(rest)
        gap = torch.where(live, m - rest, torch.zeros_like(rest))
        e = torch.where(live, torch.exp(-gap), torch.zeros_like(rest))
        r = e.scatter(1, pivot, torch.zeros_like(m)).sum(1)
        u = (e * gap).sum(1)
        h_x = torch.log1p(r) + u / (1 + r)
        # q softplus(-d) -> 0 as d -> -inf (V = 1: p_t = 1), and p_t softplus(d) -> 0 as
        # d -> +inf (a -inf target logit: p_t = 0), where 0 * inf would be NaN; no finite margin
        # comes near the clamps.
        d = (lse_xs - z_ts).clamp(min=-1e4, max=1e4)
        ent = torch.sigmoid(-d) * _softplus(d) + torch.sigmoid(d) * (_softplus(-d) + h_x)
        out += (torch.where(valid, ent, torch.zeros_like(ent)),)
    return out if len(out) > 1 else loss


def soft_cross_entropy(logits, target, *, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                       softcap=None, temperature=1.0, weight=None):
    """Collapse-safe cross-entropy of ``logits`` ``[N, V]`` against probability targets
    ``target`` ``[N, V]`` (soft labels), torch's semantics: ``loss_n = -sum_c w_c y_c log p_c``
    with ``y = (1 - eps) target + eps / V`` under label smoothing, ``"mean"`` over the ``N``
    rows (weights or not). Per row returns ``(loss, lse, entropy)`` with ``reduction="none"``.

    Every ``-log p_c`` is taken from the row's dominant class ``a`` (its largest logit):
    ``-log p_c = nll_a + (z_a - z_c)``, ``nll_a = softplus(lse_x - z_a)`` the collapse-safe
    loss of class ``a`` (logits_cross_entropy with target ``a``): both terms are >= 0, so the
    loss keeps its relative accuracy where a target concentrated on ``a`` makes it tiny, where
    ``lse - sum_c y_c z_c`` rounds to 0. Where ``p_a <= 1/2`` the same value is taken as
    ``Y (lse - z_a) + sum_c y_c (z_a - z_c)`` (``Y = sum_c y_c``) with ``z_a`` a constant of the
    graph, whose gradient at the pivot, ``Y p_a - y_a``, does not cancel. The z-loss is ``z_loss lse^2`` per row times the
    row's target mass ``sum_c y_c`` (1 for a distribution without class weights; a one-hot
    target with class weights: its class's weight, as for class indices)."""
    logits = transformed_logits(logits, softcap, temperature)
    n, v = logits.shape
    y = target.to(logits.dtype)
    if label_smoothing:
        y = (1 - label_smoothing) * y + label_smoothing / v
    if weight is not None:
        y = y * weight.to(logits.dtype)
    if v == 0:
        # (the empty sums: zeros that keep the autograd graph of the logits and targets)
        zero = logits.sum(1) + y.sum(1)
        loss, lse, entropy = zero, zero - float("inf"), zero
    else:
        a = logits.detach().argmax(dim=1)
        nll_a, lse, entropy = logits_cross_entropy(logits, a, reduction="none", return_lse=True,
                                                   return_entropy=True, ignore_index=-1)
        big_y = y.sum(1)
        gap = logits.gather(1, a[:, None]) - logits  # z_a - z_c >= 0
        # The pivot's own term (z_a - z_a = 0) is left out of the sum: through it the gradient
        # of z_a would be (sum_c y_c) - y_a, which loses the other columns' mass where it is
        # below y_a's ulp (and may come out of the wrong sign); without it, sum_{c != a} y_c.
        y_rest = y.scatter(1, a[:, None], 0.0)
        safe = nll_a * big_y + _weighted_gaps(y_rest, gap)
        # That form's gradient of z_a is -Y q_a + Y_rest (q_a = 1 - p_a, autograd's of the
        # softplus), which cancels where p_a is small: a pivot that is not the target's mode
        # (~400 roundings of Y at V = 4000). Where p_a <= 1/2 (nll_a >= log 2), the row takes
        # the form whose gradient of z_a is Y p_a - y_a, as the fused ops' (math.h
        # soft_row_grad): Y (lse - M) + sum_c y_c (M - z_c) with M the pivot's value, a constant
        # of the graph, so that z_a enters through the logsumexp (p_a) and its own term (-y_a).
        # Its value is as accurate there: lse - M >= log 2 and every term is >= 0. Beyond,
        # fp32 rounds p_a towards 1 and the collapse-safe form stays. (A non-finite pivot keeps
        # it too, and the other form's inputs are zeros that keep its derivatives finite.)
        top = logits.detach().gather(1, a[:, None])
        direct_row = (nll_a.detach() >= math.log(2.0)) & torch.isfinite(top[:, 0])
        shifted = torch.where(direct_row[:, None], logits - top, 0.0)
        direct = big_y * torch.logsumexp(shifted, dim=1) + _weighted_gaps(y, -shifted)
        loss = torch.where(direct_row, direct, safe)
        if z_loss:
            loss = loss + z_loss * lse * lse * big_y
    if reduction == "none":
        return loss, lse, entropy
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / n
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def transformed_logits(logits, softcap=None, temperature=1.0):
    """The logits as the loss takes them: ``softcap * tanh(z / softcap)``, then divided by the
    temperature."""
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _weighted_gaps(y, gap):
    """Per row sum_c y_c gap_c; a column without target weight adds nothing, also where its gap
    is infinite (a -inf logit): 0, not 0 * inf. Elsewhere y * gap, whose gradient in y is the
    gap also where y is 0."""
    return torch.where((y == 0) & torch.isinf(gap), 0.0, y * gap).sum(1)


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


def _log_softmax_safe(z):
    """``(log p, e = 1 - p_a, is_a)`` of softmax(z) from the row's largest logit ``a``: every
    ``log p_j`` is ``(z_j - z_a) - log1p(s)``, ``s = sum_{j != a} exp(z_j - z_a)``, with
    ``z_a - z_a`` a constant 0 (not a difference that autograd would take of z_a twice): the
    gradient of ``z_a`` is then minus the sum of the other columns' gradients, with nothing
    near 1 subtracted."""
    a = z.detach().argmax(dim=1, keepdim=True)
    is_a = torch.zeros_like(z, dtype=torch.bool).scatter_(1, a, True)
    d = torch.where(is_a, 0.0, z - z.gather(1, a))
    s = torch.where(is_a, 0.0, torch.exp(d)).sum(1, keepdim=True)
    log1p_s = torch.log1p(s)
    return d - log1p_s, -torch.expm1(-log1p_s), is_a


def distillation(student_logits, teacher_logits, target=None, *, divergence="jsd", beta=0.5,
                 temperature=1.0, hard_weight=0.0, soft_weight=1.0, ignore_index=-100,
                 reduction="mean"):
    """Collapse-safe distillation loss of logits ``[N, V]`` (flce.linear_distillation's
    semantics), in the logits' dtype (pass float64 for a reference); differentiable in both.

    ``KL(P || R) = sum_j P_j (log P_j - log R_j)`` with every log-probability from its row's
    largest logit (``_log_softmax_safe``), so that ``log P_a - log R_a`` at a class both put
    their mass on is the difference of two small, accurate numbers. The JSD's mixture
    ``M = beta T + (1 - beta) S`` is ``logaddexp`` of the two weighted log-probabilities, except
    at a shared dominant class, where ``log M_a = log1p(-(beta e_T + (1 - beta) e_S))``.
    ``"jsd"`` at beta 0 / 1 is forward / reverse KL. The hard term is
    :func:`logits_cross_entropy` of the un-tempered student logits; ignored tokens contribute
    nothing; ``"mean"`` divides by the number of non-ignored tokens (at least 1)."""
    n = student_logits.shape[0]
    if target is None:
        target = torch.zeros(n, dtype=torch.int64, device=student_logits.device)
    valid = target != ignore_index
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    log_s, e_s, is_a_s = _log_softmax_safe(student_logits / temperature)
    log_t, e_t, is_a_t = _log_softmax_safe(teacher_logits / temperature)

    def kl(log_p, log_r):
        return (torch.exp(log_p) * (log_p - log_r)).sum(1)

    if divergence == "forward_kl":
        soft = kl(log_t, log_s)
    elif divergence == "reverse_kl":
        soft = kl(log_s, log_t)
    elif divergence == "jsd":
        shared = is_a_s & is_a_t
        mixed = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1 - beta))
        e_m = beta * e_t + (1 - beta) * e_s
        log_m = torch.where(shared, torch.log1p(-e_m), mixed)
        soft = beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)
    else:
        raise ValueError(f"unknown divergence {divergence!r}")
    loss = soft_weight * soft
    if hard_weight:
        hard = logits_cross_entropy(student_logits, torch.where(valid, target, ignore_index),
                                    ignore_index=ignore_index, reduction="none")
        loss = loss + hard_weight * hard
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def _softplus(x):
    """log(1 + exp(x)) to its dtype's precision at every x: torch's softplus returns x itself
    above 20, a relative error of e^-20 / 20 (1e-10: far above float64's rounding). Each branch
    is evaluated on a clamped copy of x, so that neither it nor its derivatives overflow where
    torch.where does not select it."""
    pos = x > 0
    xp = torch.where(pos, x, torch.zeros_like(x))
    xn = torch.where(pos, torch.zeros_like(x), x)
    return torch.where(pos, xp + torch.log1p(torch.exp(-xp)), torch.log1p(torch.exp(xn)))


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
