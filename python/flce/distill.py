"""Knowledge distillation on two classifiers: ``flce.linear_distillation`` and
``flce.LinearDistillation``.

A chunked path: row chunks whose ``[rows, V]`` logits stay within a byte budget, both logit
GEMMs per chunk, the collapse-safe divergence and its analytic logit gradients
(docs/numerics.md, "Distillation"), then the gradient GEMMs. The ``[N, V]`` logits are never
held whole.

The row math runs as one op on the CPU backend (``flce::distill_rows_``, csrc/cpu/distill_cpu.cpp,
its formulas in csrc/include/flce/math.h; every dtype and divergence), on the CUDA backend with
``FLCE_CUDA_OPT_IN=distill`` (the same op, csrc/cuda/flce_distill.cu: one kernel of four passes
over each row, opt-in until a GPU has run it) and as the torch ops of ``_rows`` otherwise (the
CUDA default: about a hundred elementwise passes over each ``[rows, V]`` chunk); ``_rows``
(``_dominant``, ``_mix``, ``_kl_grads``) is also the op's oracle in the tests: per row, each
distribution's statistics taken from its largest logit, then passes over the columns. Its
reductions over a row's columns go through a ``_Columns``, the whole row here and one
vocabulary shard's columns followed by collectives in
``flce.parallel.vocab_parallel_linear_distillation``, which runs this chunk loop.
"""
import math
from typing import NamedTuple

import torch

from . import _common, _ops
from ._common import ArgumentError, DtypeError

__all__ = ["linear_distillation", "LinearDistillation", "DIVERGENCES"]

DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")

# Rows per chunk: as many as keep one [rows, V] buffer of the computation dtype within this many
# bytes, and at least one. The CPU's fused op (two logit buffers and four rows of scratch per
# worker) takes CPU_CHUNK_BYTES: every chunk's GEMMs pack the whole weight and update its whole
# gradient, so a chunk must be rows enough to carry that (4 MiB chunks took twice the time of
# 16 MiB; 32 and 64 MiB were level with 16 within this CPU's spread, for 2-4x the memory). The
# torch row math holds about ten such buffers (_rows), whose passes stay in cache in
# CPU_ROWS_CHUNK_BYTES; a GPU wants few, large launches.
CHUNK_BYTES = 2 ** 26
CPU_CHUNK_BYTES = 2 ** 24
CPU_ROWS_CHUNK_BYTES = 2 ** 22
# The widened weight one GEMM of a 16-bit input reads at a time (_Classifier).
BLOCK_BYTES = 2 ** 24


class _Columns:
    """The row math's reductions over a chunk's columns, here the whole vocabulary (flce.parallel's
    ``_VocabShard``: one rank's shard, then a collective). Column indices ``a`` ([rows, 1])
    are the whole vocabulary's. The row math asks for its reductions a few at a time (each
    ``argmax`` and ``reduce`` call is one collective over the shards)."""

    def argmax(self, *zs):
        """Per ``[rows, V]`` of ``zs``: ``(a, z_a)``, its largest entry's column and value
        (``torch.argmax``'s: ties to the lowest column, a NaN as the largest)."""
        out = []
        for z in zs:
            a = z.argmax(dim=1, keepdim=True)
            out.append((a, z.gather(1, a)))
        return out

    def reduce(self, sums, picks=(), dtype=None):
        """``(sums' row sums (accumulated and returned in ``dtype``, default each tensor's),
        picks' entries x[row, a] for each (x, a))``, each ``[rows, 1]``."""
        return ([x.sum(1, keepdim=True, dtype=dtype) for x in sums],
                [x.gather(1, a) for x, a in picks])

    def get(self, x, a):
        """``x[row, a]`` where this holds column ``a`` (elsewhere any value): ``put``'s
        operand."""
        return x.gather(1, a)

    def put(self, x, a, value):
        """``x`` with ``x[row, a] = value`` where this holds column ``a``."""
        return x.scatter(1, a, value)


_WHOLE = _Columns()


def _dominant(d, s):
    """A distribution's statistics from its largest logit ``z_a``: ``(p, e = 1 - p_a)`` from
    ``d = z - z_a`` ([rows, V]) and ``s = sum_{j != a} exp(z_j - z_a)`` ([rows, 1]):
    ``log p_a = -log1p(s)``, ``log p_j = (z_j - z_a) - log1p(s)`` and ``e = s / (1 + s)``:
    ``e`` keeps its relative accuracy where ``p_a`` rounds to 1, and the pivot's own
    ``exp(0) = 1`` never enters ``s``. A NaN logit is the row's argmax (torch's max propagates
    NaN), so the whole row comes out NaN."""
    return torch.exp(d - torch.log1p(s)), s / (1 + s)


def _log_at(z, z_a, s):
    """``log p`` at one column whose logit is ``z`` ([rows, 1]): ``_dominant``'s
    ``(z - z_a) - log1p(s)``, the same roundings."""
    return (z - z_a) - torch.log1p(s)


def _softplus(x):
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def _mix(x, y):
    """``log((1 - w) + w exp(x))`` with ``w = sigmoid(y)``, accurate at every ``x`` and ``w``:
    ``log1p(w expm1(x))`` for ``|x| <= 1``, where the result may be near 0 and its argument
    stays above -0.64; beyond, ``logaddexp(log(1 - w), log(w) + x)`` with both logs from
    ``y`` (``-softplus(y)``, ``-softplus(-y)``): neither ``1 - w`` nor ``w`` is formed, so a
    ``w`` near 0 or 1 loses nothing. Each branch on a clamped copy of ``x``."""
    near = x.abs() <= 1
    xs = x.clamp(-1.0, 1.0)
    xf = torch.where(near, 0.0, x)
    return torch.where(near, torch.log1p(torch.sigmoid(y) * torch.expm1(xs)),
                       torch.logaddexp(-_softplus(y), xf - _softplus(-y)))


def _kl_grads(cols, terms):
    """Per ``(p, a, r_a, r_rel)`` of ``terms``: ``KL(P || R)`` per row and its gradient in P's
    logits with R held fixed, ``P_j (r_j - KL)``, where ``r_j = log(P_j / R_j)``, from P's
    probabilities ``p``, its dominant class ``a``, ``r_a`` and ``r_rel_j = r_j - r_a`` (0 at
    ``a``). With ``c = sum_{j != a} P_j r_rel_j``: ``KL = r_a + c`` and ``r_j - KL = r_rel_j - c``
    (``-c`` at ``a``). Nothing near 1 is subtracted, and the common part ``r_a`` of every
    ``r_j`` (``log 2`` where the other model puts almost nothing on P's classes) never enters
    the gradient, whose entries are far smaller there. As math.h's ``kl_center``: ``c`` is
    divided by ``sum_j p_j``, which the rounded probabilities miss 1 by a few roundings, and held
    as ``hi + lo`` from float64 sums, so that the gradient's row sums to 0 but for its entries'
    roundings (not to ``c (1 - sum_j p_j)`` or c's rounding, which the input gradient ``g @ W``
    would take times W's mean row). The terms' sums in one reduction."""
    sums, _ = cols.reduce([x for p, a, _, r_rel in terms for x in (cols.put(p * r_rel, a, 0.0), p)],
                          dtype=torch.float64)
    out = []
    for (p, _, r_a, r_rel), c_sum, p_sum in zip(terms, sums[0::2], sums[1::2]):
        c = c_sum / p_sum
        hi = c.to(p.dtype)
        lo = (c - hi).to(p.dtype)
        out.append((((r_a + hi) + lo)[:, 0], p * ((r_rel - hi) - lo)))
    return out


def _rows(z_s, z_t, target, valid, divergence, beta, temperature, hard_weight, soft_weight,
          grad_s, grad_t, cols=_WHOLE):
    """One chunk's per-row loss ``[rows]`` and the gradients of that loss in the student's and
    the teacher's logits (``[rows, V]``, or None where not wanted), 0 on ignored rows.
    ``cols``: the reductions over the columns (``_Columns``; flce.parallel passes a vocabulary
    shard's, whose rows of logits are the shard's columns and whose outputs are its columns'
    gradients and the whole vocabulary's loss). Three rounds of them: the dominant classes, the
    sums and the logits at the classes the terms pivot on, the divergence's ``c``."""
    u_s = z_s / temperature if temperature != 1.0 else z_s
    u_t = z_t / temperature if temperature != 1.0 else z_t
    hard = hard_weight != 0.0
    # the hard term's statistics: the un-tempered student logits'
    logits = (u_s, u_t, z_s) if hard and temperature != 1.0 else (u_s, u_t)
    doms = cols.argmax(*logits)
    (a_s, m_s), (a_t, m_t) = doms[:2]
    d = [u - m for u, (_, m) in zip(logits, doms)]
    t = torch.where(valid, target, 0)[:, None]
    # The sums s, each model's logit at the other's dominant class, the student's at the target
    sums, at = cols.reduce([cols.put(torch.exp(di), a, 0.0) for di, (a, _) in zip(d, doms)],
                           [(u_t, a_s), (u_s, a_t)] + ([(z_s, t)] if hard else []))
    p_s, e_s = _dominant(d[0], sums[0])
    p_t, e_t = _dominant(d[1], sums[1])
    # S - T, which at a shared dominant class is e_T - e_S (not (1 - e_S) - (1 - e_T), which
    # loses everything below 2^-24); elsewhere one of the two is at most 1/2.
    diff = p_s - p_t
    shared = a_s == a_t
    diff = cols.put(diff, a_s, torch.where(shared, e_t - e_s, cols.get(diff, a_s)))
    # rho = log(S / T) at a dominant class: where both share it, two small accurate logs.
    rho_s = _log_at(m_s, m_s, sums[0]) - _log_at(at[0], m_t, sums[1])
    rho_t = _log_at(at[1], m_s, sums[0]) - _log_at(m_t, m_t, sums[1])
    # log(S_j / T_j) - log(S_a / T_a) as logit differences, exact but for one rounding each.
    rel_s = d[0] - (u_t - at[0])
    rel_t = (u_s - at[1]) - d[1]
    if divergence == "forward_kl":
        (soft, g_t), = _kl_grads(cols, [(p_t, a_t, -rho_t, -rel_t)])
        g_s = diff
    elif divergence == "reverse_kl":
        (soft, g_s), = _kl_grads(cols, [(p_s, a_s, rho_s, rel_s)])
        g_t = -diff
    else:
        # M = beta T + (1 - beta) S: log(S_j / M_j) = -mix(-rho_j, w = beta) and
        # log(T_j / M_j) = -mix(rho_j, w = 1 - beta); relative to the dominant class a,
        # mix(x_j, w) - mix(x_a, w) = mix(x_j - x_a, w') with logit(w') = x_a + logit(w).
        y = math.log(beta / (1 - beta))
        x_s, x_t = -rho_s, rho_t
        (kl_s, h_s), (kl_t, h_t) = _kl_grads(cols, [
            (p_s, a_s, -_mix(x_s, torch.full_like(x_s, y)), -_mix(-rel_s, x_s + y)),
            (p_t, a_t, -_mix(x_t, torch.full_like(x_t, -y)), -_mix(rel_t, x_t - y))])
        soft = beta * kl_t + (1 - beta) * kl_s
        g_s, g_t = (1 - beta) * h_s, beta * h_t
    loss = soft_weight * soft
    g_s = g_s * (soft_weight / temperature) if grad_s else None
    g_t = g_t * (soft_weight / temperature) if grad_t else None
    if hard:
        # flce's collapse-safe cross-entropy of the un-tempered student logits: -log p_t from
        # the row's dominant class, and p_t - 1 as -e where the target is that class.
        if temperature != 1.0:
            (a_s, m_s), s = doms[2], sums[2]
            p_s, e_s = _dominant(d[2], s)
        else:
            s = sums[0]
        loss = loss - hard_weight * _log_at(at[2], m_s, s)[:, 0]
        if grad_s:
            g_hard = cols.put(p_s, t, torch.where(t == a_s, -e_s, cols.get(p_s, t) - 1))
            g_s = g_s + hard_weight * g_hard
    keep = valid[:, None]
    loss = torch.where(valid, loss, 0.0)
    g_s = None if g_s is None else torch.where(keep, g_s, 0.0)
    g_t = None if g_t is None else torch.where(keep, g_t, 0.0)
    return loss, g_s, g_t


def _chunks(n, v, itemsize, device, fused):
    """Row chunks ``[(lo, hi)]``: as many rows as keep one ``[rows, V]`` buffer of the
    computation dtype within CPU_CHUNK_BYTES (the CPU's fused op), CPU_ROWS_CHUNK_BYTES (the
    torch row math on the CPU) or CHUNK_BYTES."""
    budget = CHUNK_BYTES if device.type != "cpu" else \
        CPU_CHUNK_BYTES if fused else CPU_ROWS_CHUNK_BYTES
    rows = max(1, min(n, budget // max(v * itemsize, 1)))
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def _compute_dtype(x_s, x_t):
    return torch.float64 if torch.float64 in (x_s.dtype, x_t.dtype) else torch.float32


class _Classifier:
    """One model's classifier in the chunk loop: a row chunk's logits and its gradient GEMMs in
    the computation dtype. The weight's values are taken in the input's dtype and the bias's in
    its own (fp32 master weights of 16-bit inputs compute as flce.linear_cross_entropy's composite
    path does: the weight rounded once to 16 bits, the bias exact); where that is narrower than
    the computation dtype, the GEMMs run over vocabulary blocks of at most BLOCK_BYTES of widened
    weight (torch's CPU GEMMs give no fp32 output of 16-bit operands), so no widened copy of the
    whole weight is made."""

    def __init__(self, x, w, b, cdt):
        self.x, self.cdt = x, cdt
        # (float64 inputs: a float32 weight widens exactly; 16-bit inputs: fp32 master weights
        # rounded once to the input's dtype, 16-bit the whole call)
        self.w = w.to(cdt) if x.dtype == cdt else w.to(x.dtype)
        self.b = None if b is None else b.to(cdt)
        v, d = w.shape
        step = max(1, BLOCK_BYTES // (4 * max(d, 1)))
        # (at least one block: an empty vocabulary shard's GEMMs write gx's zeros)
        self.blocks = [(0, v)] if x.dtype == cdt else \
            [(lo, min(lo + step, v)) for lo in range(0, max(v, 1), step)]

    def rows(self, lo, hi):
        """The chunk's hidden states in the computation dtype (a view where they are)."""
        return self.x[lo:hi].to(self.cdt)

    def _weight(self, a, b):
        return self.w[a:b].to(self.cdt)

    def logits(self, x, out):
        """``x @ W.T + b`` into ``out`` ([rows, V], the computation dtype)."""
        for a, b in self.blocks:
            torch.mm(x, self._weight(a, b).T, out=out[:, a:b])
        if self.b is not None:
            out.add_(self.b)
        return out

    def backward(self, g, x, gx, gw, gb):
        """``gx = g @ W`` (written), ``gw += g.T @ x``, ``gb += g.sum(0)`` (accumulated in place;
        each None where not wanted) for the chunk's logit gradient ``g``."""
        for i, (a, b) in enumerate(self.blocks):
            w = self._weight(a, b) if gx is not None else None
            if gx is not None:
                if i == 0:
                    torch.mm(g[:, a:b], w, out=gx)
                else:
                    gx.addmm_(g[:, a:b], w)
            if gw is not None:
                gw[a:b].addmm_(g[:, a:b].T, x)
        if gb is not None:
            gb.add_(g.sum(0))


def _run(x_s, w_s, b_s, x_t, w_t, b_t, target, valid, row_scale, cfg, needs, shards=None):
    """The chunk loop: per-row losses ``[N]`` (computation dtype) and the gradients asked for
    in ``needs`` (student input, weight, bias, teacher input, weight, bias), each row's logit
    gradient times ``row_scale[n]`` (None: no gradients), in the computation dtype.
    ``shards``: None, or the classifiers' rows are one vocabulary shard (flce.parallel's
    ``_VocabShard``: the row math's reductions over the shards, and ``width``, the shard width
    every rank plans its chunks by, so that all walk the same chunks); the inputs' gradients
    are then this shard's part."""
    cdt = _compute_dtype(x_s, x_t)
    models = (_Classifier(x_s, w_s, b_s, cdt), _Classifier(x_t, w_t, b_t, cdt))
    wanted = (row_scale is not None and any(needs[:3]), row_scale is not None and any(needs[3:]))
    n, v = x_s.shape[0], w_s.shape[0]
    loss = torch.empty(n, dtype=cdt, device=x_s.device)
    grads = [None] * 6
    for m, (x, w) in enumerate(((x_s, w_s), (x_t, w_t))):
        if wanted[m]:
            need_x, need_w, need_b = needs[3 * m:3 * m + 3]
            grads[3 * m] = x.new_empty(x.shape, dtype=cdt) if need_x else None
            grads[3 * m + 1] = w.new_zeros(w.shape, dtype=cdt) if need_w else None
            grads[3 * m + 2] = w.new_zeros(v, dtype=cdt) if need_b else None
    # The fused op on the CPU backend; over vocabulary shards, torch's ops (the op's reductions
    # run over its whole row).
    fused = shards is None and not _ops.is_cuda_backend(x_s) and x_s.device.type == "cpu"
    # The CUDA backend's op (csrc/cuda/distill.cpp) only with FLCE_CUDA_OPT_IN=distill, until a
    # GPU has run it (docs/cuda.md "Distillation"); the torch row math otherwise.
    fused = fused or (shards is None and _ops.is_cuda_backend(x_s)
                      and _common.cuda_opt_in("distill"))
    cols = _WHOLE if shards is None else shards
    width = v if shards is None else shards.width
    for lo, hi in _chunks(n, width, torch.finfo(cdt).bits // 8, x_s.device, fused):
        xs, xt = models[0].rows(lo, hi), models[1].rows(lo, hi)
        z_s = models[0].logits(xs, xs.new_empty(hi - lo, v))
        z_t = models[1].logits(xt, xt.new_empty(hi - lo, v))
        if fused:
            # the backend's fused row math (csrc/cpu/distill_cpu.cpp, csrc/cuda/distill.cpp):
            # the loss into loss' rows, the gradients over the logits
            _ops.ops.distill_rows_(z_s, z_t, loss[lo:hi], target[lo:hi], valid[lo:hi], *cfg,
                                   *wanted)
            g_s, g_t = (z_s if wanted[0] else None), (z_t if wanted[1] else None)
        else:
            loss[lo:hi], g_s, g_t = _rows(z_s, z_t, target[lo:hi], valid[lo:hi], *cfg, *wanted,
                                          cols)
        del z_s, z_t
        scale = None if row_scale is None else row_scale[lo:hi, None].to(cdt)
        for m, g, x in ((0, g_s, xs), (1, g_t, xt)):
            if g is not None:
                gx, gw, gb = grads[3 * m:3 * m + 3]
                models[m].backward(g.mul_(scale), x, None if gx is None else gx[lo:hi], gw, gb)
    return loss, tuple(grads)


def _cast(grads, dtypes, shards):
    """Gradients from the computation dtype to their tensors' dtypes (rounded once; the inputs'
    summed over the vocabulary shards first where ``shards`` sums them)."""
    return tuple(None if g is None else
                 shards.reduce_input(g, dt) if shards is not None and i % 3 == 0 else g.to(dt)
                 for i, (g, dt) in enumerate(zip(grads, dtypes)))


class _Distillation(torch.autograd.Function):
    """``reduction`` "mean"/"sum": the gradients are computed in the forward (one pass: the two
    logit GEMMs per chunk, then the gradient GEMMs), each row's times ``row_scale`` (1 / count
    for the mean), and the backward scales them by the upstream gradient. "none": the forward
    computes the losses alone and the backward runs the chunks again with the upstream
    gradient as each row's scale. ``shards``: as for ``_run``."""

    @staticmethod
    def forward(ctx, x_s, w_s, b_s, x_t, w_t, b_t, target, valid, row_scale, divergence, beta,
                temperature, hard_weight, soft_weight, reduced, needs, shards):
        cfg = (divergence, beta, temperature, hard_weight, soft_weight)
        ctx.cfg, ctx.reduced, ctx.needs, ctx.shards = cfg, reduced, needs, shards
        ctx.dtypes = tuple(None if x is None else x.dtype for x in (x_s, w_s, b_s, x_t, w_t, b_t))
        if reduced:
            loss, grads = _run(x_s, w_s, b_s, x_t, w_t, b_t, target, valid,
                               row_scale if any(needs) else None, cfg, needs, shards)
            # (in the computation dtype: rounded once, after the upstream gradient's scaling)
            ctx.save_for_backward(*(g for g in grads if g is not None))
            return (loss * row_scale).sum()
        loss, _ = _run(x_s, w_s, b_s, x_t, w_t, b_t, target, valid, None, cfg, needs, shards)
        ctx.save_for_backward(x_s, w_s, b_s, x_t, w_t, b_t, target, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduced:
            saved = iter(ctx.saved_tensors)
            grads = tuple(next(saved) * grad if n else None for n in ctx.needs)
        else:
            _, grads = _run(*ctx.saved_tensors, grad, ctx.cfg, ctx.needs, ctx.shards)
        return _cast(grads, ctx.dtypes, ctx.shards) + (None,) * 11


def _check_pair(prefix, x, w, b, lead=None):
    """One model's hidden states ``(..., D)``, classifier ``(V, D)`` and bias ``(V,)``."""
    names = (f"{prefix}_input", f"{prefix}_weight", f"{prefix}_bias")
    _common.check_classifier_shapes(x, w, names[:2])
    if lead is not None and tuple(x.shape[:-1]) != lead:
        raise ArgumentError(f"flce: {prefix}_input's leading dimensions {tuple(x.shape[:-1])} "
                            f"must equal student_input's {lead} (one teacher row per student "
                            f"token)")
    _common.check_classifier_dtypes(x, w, b, names)


def _options(divergence, beta, temperature, hard_weight, soft_weight, ignore_index, reduction):
    """The options, checked: ``(divergence, beta, Options, hard_weight, soft_weight)``, with
    "jsd" at beta 0 and 1 as the KL it is there (TRL's and Liger's convention)."""
    if not isinstance(divergence, str) or divergence not in DIVERGENCES:
        raise ArgumentError(f"flce: divergence must be one of {DIVERGENCES}, got "
                            f"{divergence!r}")
    beta = _common.number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ArgumentError(f"flce: beta must be in [0, 1], got {beta}")
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    opts = _common.Options(ignore_index, reduction, temperature=temperature)
    weights = []
    for name, value in (("hard_weight", hard_weight), ("soft_weight", soft_weight)):
        value = _common.number(name, value)
        if not math.isfinite(value):
            raise ArgumentError(f"flce: {name} must be a finite number, got {value}")
        weights.append(value)
    return divergence, beta, opts, weights[0], weights[1]


def linear_distillation(student_input, student_weight, teacher_input, teacher_weight,
                        target=None, *, divergence="jsd", beta=0.5, temperature=1.0,
                        hard_weight=0.0, soft_weight=1.0, ignore_index=-100, reduction="mean",
                        student_bias=None, teacher_bias=None, shift=False):
    r"""Collapse-safe knowledge distillation loss of a student's and a teacher's classifiers:
    ``hard_weight * hard + soft_weight * soft`` per token, where ``soft`` is the divergence
    between the teacher's and the student's ``softmax(logits / temperature)`` and ``hard`` is
    flce's collapse-safe cross-entropy of the student's un-tempered logits on ``target``.

    Logits ``student_input @ student_weight.T + student_bias`` and likewise for the teacher,
    computed in row chunks (the ``[N, V]`` logits are never held whole) in the input's dtype
    with float32 accumulation (float64 for float64 inputs). Every log-probability is taken from
    its distribution's largest logit, so loss and gradients keep their relative accuracy where
    both models are confident on the same token (docs/numerics.md, "Distillation"), where
    ``F.kl_div(F.log_softmax(...))`` returns rounding noise.

    Args:
        student_input: ``(..., D_S)`` hidden states, float32, bfloat16, float16 or float64.
        student_weight: ``(V, D_S)``, student_input's dtype or float32 master weights.
        teacher_input: ``(..., D_T)``, the same leading dimensions; ``D_T`` may differ.
        teacher_weight: ``(V, D_T)``, teacher_input's dtype or float32; the same V.
        target: ``(...)`` class indices or ``ignore_index``; optional unless ``hard_weight``
            is set or tokens are to be ignored.
        divergence: ``"forward_kl"`` ``KL(teacher || student)``, ``"reverse_kl"``
            ``KL(student || teacher)``, ``"jsd"`` the generalized Jensen-Shannon divergence
            ``beta KL(T || M) + (1 - beta) KL(S || M)`` with ``M = beta T + (1 - beta) S``
            (TRL's ``generalized_jsd_loss``, Liger's ``LigerFusedLinearJSDLoss``); at
            ``beta = 0`` it is ``"forward_kl"``, at ``beta = 1`` ``"reverse_kl"``, as theirs.
        beta: in ``[0, 1]``, used by ``"jsd"``.
        temperature: divides both models' logits in the soft term (not in the hard one).
        hard_weight, soft_weight: the terms' weights.
        ignore_index: tokens whose target is this contribute neither term and no gradient,
            and are not counted by ``"mean"``.
        reduction: ``"mean"`` over the non-ignored tokens (0 when there is none, as Liger and
            TRL give), ``"sum"``, ``"none"`` (shape ``(...)``, 0 at ignored tokens).
        student_bias, teacher_bias: optional ``(V,)``, the weight's dtype.
        shift: ``True`` (or an int k): the token at position i is scored against
            ``target[..., i + k]`` and the last k positions of each sequence are ignored, as in
            :func:`flce.linear_cross_entropy` (without a target: only those positions are).

    The teacher's tensors get gradients only where they require grad (typically the teacher
    runs under ``torch.no_grad()`` or is frozen, and none are computed).

    Returns:
        The loss, float32 (float64 for float64 inputs).
    """
    return _loss(_prepare(student_input, student_weight, teacher_input, teacher_weight, target,
                          divergence, beta, temperature, hard_weight, soft_weight, ignore_index,
                          reduction, student_bias, teacher_bias, shift))


class _Call(NamedTuple):
    """A call's checked arguments (``_prepare``)."""
    tensors: tuple      # (x_s [N, D_S], w_s, b_s, x_t [N, D_T], w_t, b_t)
    target: object      # [N] int64, shifted; ignore_index where ignored (zeros without target)
    has_target: bool
    cfg: tuple          # (divergence, beta, temperature, hard_weight, soft_weight)
    ignore_index: int
    reduction: str
    shift: int
    lead: tuple         # student_input's leading dimensions
    needs: tuple        # which of tensors get a gradient


def _prepare(student_input, student_weight, teacher_input, teacher_weight, target, divergence,
             beta, temperature, hard_weight, soft_weight, ignore_index, reduction, student_bias,
             teacher_bias, shift, shard=False):
    """linear_distillation's arguments checked, as a ``_Call``. ``shard``: the classifiers are
    one vocabulary shard (flce.parallel), which may be empty, and the targets' range is checked
    against the whole vocabulary there."""
    _check_pair("student", student_input, student_weight, student_bias)
    _check_pair("teacher", teacher_input, teacher_weight, teacher_bias,
                tuple(student_input.shape[:-1]))
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ArgumentError(f"flce: teacher_weight's V ({teacher_weight.shape[0]}) must equal "
                            f"student_weight's ({student_weight.shape[0]}): one vocabulary")
    if student_weight.shape[0] == 0 and not shard:
        raise ArgumentError("flce: student_weight and teacher_weight must have at least one "
                            "class (V >= 1): a distribution over no class has no divergence")
    divergence, beta, opts, hard_weight, soft_weight = _options(
        divergence, beta, temperature, hard_weight, soft_weight, ignore_index, reduction)
    k = _common.shift_amount(shift)
    lead = tuple(student_input.shape[:-1])
    if target is None:
        if hard_weight != 0.0:
            raise ArgumentError(f"flce: hard_weight={hard_weight} needs target (the hard loss "
                                f"is the student's cross-entropy on it)")
        if k and not lead:
            raise ArgumentError("flce: shift needs student_input of shape (..., T, D)")
    else:
        _common.check_target(target, lead, "student_input's leading dimensions")
        if target.dtype.is_floating_point:
            raise DtypeError(f"flce: target must hold class indices (an integer tensor), got "
                             f"{target.dtype}")
    _common.check_one_device((("student_input", student_input),
                              ("student_weight", student_weight),
                              ("teacher_input", teacher_input),
                              ("teacher_weight", teacher_weight), ("target", target),
                              ("student_bias", student_bias), ("teacher_bias", teacher_bias)))
    v = student_weight.shape[0]
    t = target
    if t is None:
        t = torch.zeros(lead, dtype=torch.int64, device=student_input.device)
    if k:
        t = _common.shift_target(t, opts.ignore_index, k)
    # (contiguous: a broadcast target's view has stride 0, the CPU op reads rows of it)
    t = t.reshape(-1).to(torch.int64).contiguous()
    if target is not None and not shard:
        _common.check_target_range(t, v, opts.ignore_index)
    n = t.numel()
    x_s = student_input.reshape(n, student_input.shape[-1])
    x_t = teacher_input.reshape(n, teacher_input.shape[-1])
    tensors = (x_s, student_weight, student_bias, x_t, teacher_weight, teacher_bias)
    grad = torch.is_grad_enabled()
    needs = tuple(bool(grad and x is not None and x.requires_grad) for x in tensors)
    return _Call(tensors, t, target is not None,
                 (divergence, beta, opts.temperature, hard_weight, soft_weight),
                 opts.ignore_index, opts.reduction, k, lead, needs)


def _loss(call, shards=None):
    """linear_distillation's loss of a ``_Call``; ``shards``: as for ``_run``."""
    t = call.target
    valid = t != call.ignore_index
    reduced = call.reduction != "none"
    cdt = _compute_dtype(call.tensors[0], call.tensors[3])
    row_scale = valid.to(cdt)
    if call.reduction == "mean":
        row_scale = row_scale / valid.sum().clamp(min=1).to(cdt)
    loss = _Distillation.apply(*call.tensors, t, valid, row_scale, *call.cfg, reduced,
                               call.needs, shards)
    if reduced:
        return loss
    return _common.unshift(loss.reshape(call.lead), call.shift, "none")


class LinearDistillation(torch.nn.Module):
    """``nn.Module`` form of :func:`linear_distillation`; call as ``module(student_input,
    student_weight, teacher_input, teacher_weight, target=None, student_bias=None,
    teacher_bias=None)``."""

    def __init__(self, *, divergence="jsd", beta=0.5, temperature=1.0, hard_weight=0.0,
                 soft_weight=1.0, ignore_index=-100, reduction="mean", shift=False):
        super().__init__()
        _options(divergence, beta, temperature, hard_weight, soft_weight, ignore_index,
                 reduction)
        _common.shift_amount(shift)
        self.divergence = divergence
        self.beta = beta
        self.temperature = temperature
        self.hard_weight = hard_weight
        self.soft_weight = soft_weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.shift = shift

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, target=None,
                student_bias=None, teacher_bias=None):
        return linear_distillation(student_input, student_weight, teacher_input, teacher_weight,
                                   target, divergence=self.divergence, beta=self.beta,
                                   temperature=self.temperature, hard_weight=self.hard_weight,
                                   soft_weight=self.soft_weight, ignore_index=self.ignore_index,
                                   reduction=self.reduction, student_bias=student_bias,
                                   teacher_bias=teacher_bias, shift=self.shift)

    def extra_repr(self):
        return (f"divergence={self.divergence!r}, beta={self.beta}, "
                f"temperature={self.temperature}, hard_weight={self.hard_weight}, "
                f"soft_weight={self.soft_weight}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}, shift={self.shift}")
