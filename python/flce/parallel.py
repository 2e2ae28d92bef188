"""Vocab-parallel linear cross-entropy over ``torch.distributed`` (tensor parallelism).

Rank ``r`` of a process group holds the rows ``[vocab_start_r, vocab_start_r + V_r)`` of the
classifier. Forward: each rank computes the per-row statistics of its shard with the fused op
``flce::partial_stats`` (``[N, 4]`` fp32: non-target max and sum-exp, the target logit if the
rank owns it, the logit sum), ONE all-gather gives every rank all of them, and ``flce::combine``
turns them into the collapse-safe loss, the same math as on one device. Backward: each rank forms
its shard's gradient tiles from the global row statistics with ``flce::backward``; ``dC`` stays
local and ``dE`` is summed over the group. See docs/parallel.md.

Entry points:

* :func:`vocab_parallel_linear_cross_entropy`: local weight shard + process group (Megatron-style
  models, plain ``torch.distributed`` scripts).
* ``flce.linear_cross_entropy`` with a ``DTensor`` weight sharded on dim 0 over a 1-D mesh
  (TorchTitan-style models) dispatches to :func:`linear_cross_entropy_dtensor`.
* :func:`vocab_parallel_cross_entropy`: a collapse-safe drop-in for Megatron-Core's
  ``tensor_parallel.vocab_parallel_cross_entropy`` for models that keep their own ``lm_head``.

Importing this module is cheap: ``torch.distributed`` is used only inside the functions.
"""
import struct
import sys

import torch

from . import _ops
from .api import _validate, per_token_outputs, reduce_loss

__all__ = [
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_cross_entropy",
    "linear_cross_entropy_dtensor",
    "is_vocab_sharded",
    "clear_layout_cache",
]

_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_REDUCTION_CODES = {"mean": 1, "sum": 2, "none": 3}


# ---------------------------------------------------------------------------------------------
# Collectives. torch >= 2.10 renames the *_into_tensor / *_tensor forms to *_single.
# ---------------------------------------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist


def _all_gather(x, group, world):
    """Concatenation of every rank's ``x`` along dim 0 (all ranks' shapes must agree)."""
    dist = _dist()
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
    return out


def _all_reduce(x, group):
    _dist().all_reduce(x, group=group)
    return x


def _reduce_scatter(x, group, world):
    """Sum over ranks of ``x`` ``[world * n, ...]``, this rank's block ``[n, ...]``."""
    dist = _dist()
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, group=group)
    return out


def _resolve_group(group):
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flce.parallel: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    mesh_cls = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ValueError(f"flce.parallel: group must be a 1-D DeviceMesh, got a "
                             f"{group.ndim}-D mesh; pass mesh[dim_name] for the TP dimension")
        group = group.get_group()
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Shard layout: where each rank's rows sit in the global vocabulary, agreed on once per group and
# local shape, with the cheap cross-rank consistency checks.
# ---------------------------------------------------------------------------------------------
class _Layout:
    __slots__ = ("vocab_start", "vocab_size", "valid_rows", "starts", "sizes")

    def __init__(self, vocab_start, vocab_size, valid_rows, starts, sizes):
        self.vocab_start = vocab_start  # this rank's first global row
        self.vocab_size = vocab_size    # global real vocabulary (softmax and smoothing)
        self.valid_rows = valid_rows    # this shard's rows below vocab_size
        self.starts = starts
        self.sizes = sizes


_LAYOUTS = {}
_LAYOUT_CACHE_SIZE = 256
# Fields of the metadata row; all but the first three must agree across ranks.
_META_FIELDS = ("V_local", "vocab_start", "vocab_size", "N", "D", "input dtype", "weight dtype",
                "bias", "ignore_index", "label_smoothing", "z_loss", "softcap", "reduction",
                "sequence_parallel", "temperature")


def clear_layout_cache():
    """Forget the shard layouts agreed on so far (e.g. after re-creating process groups)."""
    _LAYOUTS.clear()


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _layout(group, rank, world, device, meta, explicit_size, check_ranks):
    """Shard offsets and the global vocabulary for this call, from a cached one-time exchange.

    The exchange all-gathers one int64 row per rank (``_META_FIELDS``): every rank sees the same
    rows and raises the same error, so a disagreement is an exception on all ranks, not a hang.
    The cache key is everything the row holds, so a rank whose key changes re-checks; ranks must
    make the same calls in the same order, as for every collective.
    """
    key = (id(group), rank, world, str(device)) + tuple(meta)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is group and not check_ranks:
        return hit[1]
    rows = _all_gather(torch.tensor([meta], dtype=torch.int64, device=device), group,
                       world).tolist()
    mine = rows[rank]
    for f in range(3, len(_META_FIELDS)):
        values = [r[f] for r in rows]
        if any(v != mine[f] for v in values):
            raise ValueError(f"flce.parallel: ranks disagree on {_META_FIELDS[f]}: "
                             f"{_describe(f, values)} (rank r at position r)")
    sizes = [r[0] for r in rows]
    given = [r[1] >= 0 for r in rows]
    if any(given) != all(given):
        raise ValueError(f"flce.parallel: pass vocab_start on every rank or on none; got "
                         f"{[r[1] if r[1] >= 0 else None for r in rows]} (by rank)")
    if all(given):
        starts = [r[1] for r in rows]
    else:
        starts = [sum(sizes[:r]) for r in range(world)]
    order = sorted(range(world), key=lambda r: starts[r])
    end = 0
    for r in order:
        if starts[r] != end:
            raise ValueError(f"flce.parallel: vocabulary shards must tile [0, V) without gaps or "
                             f"overlaps; shard starts {starts}, sizes {sizes} (by rank)")
        end += sizes[r]
    sizes_given = {r[2] for r in rows}
    if len(sizes_given) != 1:
        raise ValueError(f"flce.parallel: ranks disagree on vocab_size: {[r[2] for r in rows]}")
    vocab_size = sizes_given.pop() if explicit_size else end
    if explicit_size and not 0 < vocab_size <= end:
        raise ValueError(f"flce.parallel: vocab_size must be in [1, {end}] (the rows of all "
                         f"shards), got {vocab_size}")
    if vocab_size <= 0:
        raise ValueError("flce.parallel: every vocabulary shard is empty")
    start = starts[rank]
    valid = max(0, min(sizes[rank], vocab_size - start))
    layout = _Layout(start, vocab_size, valid, tuple(starts), tuple(sizes))
    if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = (group, layout)
    return layout


def _check_vocab_start(vocab_start):
    if vocab_start is not None and (not isinstance(vocab_start, int) or vocab_start < 0):
        raise ValueError(f"flce.parallel: vocab_start must be a non-negative int, got "
                         f"{vocab_start!r}")


def _describe(field, values):
    name = _META_FIELDS[field]
    if name in ("input dtype", "weight dtype"):
        codes = {v: k for k, v in _DTYPE_CODES.items()}
        return str([str(codes.get(v, v)).replace("torch.", "") for v in values])
    if name in ("label_smoothing", "z_loss", "softcap", "temperature"):
        return str([struct.unpack("<d", struct.pack("<q", v))[0] for v in values])
    if name == "reduction":
        codes = {v: k for k, v in _REDUCTION_CODES.items()}
        return str([codes[v] for v in values])
    return str(values)


# ---------------------------------------------------------------------------------------------
# The fused vocab-parallel op.
# ---------------------------------------------------------------------------------------------
def _shard_operands(x, weight, bias, group, world, layout, sequence_parallel):
    """The op's operands: all ranks' tokens under sequence parallelism, and the shard without
    its vocabulary padding rows, which never enter the softmax (views, no copy)."""
    if sequence_parallel:
        x = _all_gather(x, group, world)
    if layout.valid_rows < weight.shape[0]:
        weight = weight.narrow(0, 0, layout.valid_rows)
        bias = None if bias is None else bias.narrow(0, 0, layout.valid_rows)
    return x, weight, bias


class _VocabParallelLinearCE(torch.autograd.Function):
    """Inputs: x [N, D] (this rank's tokens under sequence parallelism), the local shard and
    bias, full-vocabulary targets for all N (gathered) tokens. Outputs loss, lse, entropy [N]
    fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, group, rank, world, layout, options,
                reduce_input_grad, sequence_parallel):
        ignore_index, label_smoothing, z_loss, softcap, temperature = options
        x, w, b = _shard_operands(x, weight, bias, group, world, layout, sequence_parallel)
        partials = _ops.ops.partial_stats(x, w, target, b, layout.vocab_start, ignore_index,
                                          softcap, temperature)
        gathered = _all_gather(partials, group, world).view(world, x.shape[0], _ops.PARTIAL_COLS)
        loss, lse, stats, entropy = _ops.ops.combine(gathered, target, layout.vocab_size,
                                                     ignore_index, label_smoothing, z_loss)
        ctx.save_for_backward(x, w, b, target, stats)
        ctx.setup = (group, world, layout, options, reduce_input_grad, sequence_parallel,
                     weight.shape[0], bias is not None)
        return loss, lse, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_entropy):
        x, w, b, target, stats = ctx.saved_tensors
        (group, world, layout, options, reduce_input_grad, sequence_parallel, rows,
         has_bias) = ctx.setup
        ignore_index, label_smoothing, z_loss, softcap, temperature = options
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                has_bias and ctx.needs_input_grad[2]]
        none = (None,) * 8
        if not any(mask):
            return (None, None, None) + none
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        gi, gw, gb = _ops.ops.backward(grad_loss, grad_lse, x, w, target, b, stats,
                                       layout.vocab_start, layout.vocab_size, ignore_index,
                                       label_smoothing, z_loss, softcap, mask, grad_entropy,
                                       temperature)
        if mask[1] and gw.shape[0] < rows:
            gw = torch.cat([gw, gw.new_zeros((rows - gw.shape[0], gw.shape[1]))])
        if mask[2] and gb.shape[0] < rows:
            gb = torch.cat([gb, gb.new_zeros((rows - gb.shape[0],))])
        if mask[0]:
            if sequence_parallel:
                gi = _reduce_scatter(gi, group, world)
            elif reduce_input_grad:
                gi = _all_reduce(gi, group)
        return (gi if mask[0] else None, gw if mask[1] else None,
                gb if mask[2] else None) + none


class _VocabParallelSinglePass(torch.autograd.Function):
    """The single pass (flce::sum_and_grad with the group: 3 GEMMs, the gradients computed in the
    forward) over the vocabulary shards: per chunk of rows the [rows, 5] partial statistics are
    all-gathered inside the op; the backward scales the deferred gradients and reduces the input
    gradient over the group. Returns the reduced loss (identical on all ranks)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, group, world, layout, options, reduction,
                reduce_input_grad, sequence_parallel):
        ignore_index, label_smoothing, z_loss, softcap, temperature = options
        x, w, b = _shard_operands(x, weight, bias, group, world, layout, sequence_parallel)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        loss, divisor, gi, gw, gb = _ops.ops.sum_and_grad(
            x, w, target, b, ignore_index, label_smoothing, z_loss, softcap, mask,
            reduction == "mean", layout.vocab_start, layout.vocab_size, group.group_name, world,
            temperature)
        ctx.save_for_backward(divisor, gi, gw, gb)
        ctx.setup = (group, world, reduce_input_grad, sequence_parallel, weight.shape[0],
                     (x.dtype, weight.dtype, None if bias is None else bias.dtype), mask)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        divisor, *deferred = ctx.saved_tensors
        group, world, reduce_input_grad, sequence_parallel, rows, dtypes, mask = ctx.setup
        scale = torch.where(divisor > 0, grad_loss.to(torch.float64) / divisor, 0.0)
        gi, gw, gb = (_ops.ops.scale_grad(p, scale, dt) if need and p.dim() >= 2 else None
                      for p, dt, need in zip(deferred, dtypes, mask))
        if gw is not None and gw.shape[0] < rows:
            gw = torch.cat([gw, gw.new_zeros((rows - gw.shape[0], gw.shape[1]))])
        if gb is not None and gb.shape[0] < rows:
            gb = torch.cat([gb, gb.new_zeros((rows - gb.shape[0],))])
        if gi is not None:
            if sequence_parallel:
                gi = _reduce_scatter(gi, group, world)
            elif reduce_input_grad:
                gi = _all_reduce(gi, group)
        return (gi, gw, gb) + (None,) * 8


def _use_single_pass(single_pass, reduction, return_lse, x):
    """The single pass for training on the CUDA backend, as flce.linear_cross_entropy decides."""
    from .api import _single_pass

    use = _single_pass(single_pass, reduction, return_lse, x)
    if use and not _ops.is_cuda_backend(x):
        if single_pass:
            raise ValueError("flce.parallel: single_pass=True needs the CUDA backend (the CPU "
                             "backend's single pass is single-device)")
        return False
    return use


def vocab_parallel_linear_cross_entropy(input, weight_local, target, *, group=None,
                                        bias_local=None, ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, z_loss=0.0, softcap=None,
                                        temperature=1.0, return_lse=False, return_entropy=False,
                                        vocab_start=None, vocab_size=None,
                                        reduce_input_grad=True, sequence_parallel=False,
                                        check_ranks=False, single_pass=None):
    r"""Fused, collapse-safe linear cross-entropy with the vocabulary sharded over ``group``.

    Every rank passes the same tokens (``input``, ``target``) and its own rows of the
    classifier; the result equals ``flce.linear_cross_entropy(input, full_weight, target, ...)``
    on every rank, up to fp32 rounding. The options are those of ``flce.linear_cross_entropy``;
    label smoothing uses the global vocabulary size and the mean runs over all non-ignored
    tokens.

    Args:
        input: ``(..., D)`` hidden states (this rank's token shard when ``sequence_parallel``).
        weight_local: ``(V_local, D)`` this rank's classifier rows; shards may be uneven
            (also empty) and sit in rank order unless ``vocab_start`` says otherwise.
        target: ``(...)`` global vocabulary ids or ``ignore_index``, shaped like input's leading
            dimensions (this rank's token shard when ``sequence_parallel``).
        group: the tensor-parallel ``ProcessGroup`` or a 1-D ``DeviceMesh`` (default: WORLD).
        bias_local: optional ``(V_local,)``.
        vocab_start: this rank's first global row; default: the ranks' shards in rank order
            (offsets from one all-gather of the shard sizes, cached per group and shape).
        vocab_size: the real global vocabulary; shard rows at or beyond it (vocabulary padding)
            never enter the softmax and get zero gradient. Default: all rows of all shards.
        reduce_input_grad: all-reduce ``input``'s gradient over the group (default). Pass False
            when the caller's TP region does it (Megatron's ``copy_to_tensor_model_parallel_
            region`` backward); each rank then gets its shard's contribution.
        sequence_parallel: ``input`` and ``target`` are sharded over tokens along dim 0 (equal
            shards); they are all-gathered before and ``input``'s gradient is reduce-scattered
            after. The loss covers all ranks' tokens: for ``reduction="none"`` its shape is
            ``(world * input.shape[0], *input.shape[1:-1])``, in rank order.
        check_ranks: repeat the cross-rank consistency check (one small all-gather) on every
            call instead of once per shape.
        single_pass: as for ``flce.linear_cross_entropy``: by default the CUDA backend trains
            (mean/sum, no return_lse, gradients needed) with the single pass, whose chunks of
            rows all-gather their ``[rows, 4]`` statistics inside the op.

    Returns:
        The loss in float32 (identical on all ranks), then the per-token lse when ``return_lse``
        and the per-token entropy when ``return_entropy``.
        Every rank must backpropagate the same upstream gradient into it.
    """
    if ignore_index is None:
        ignore_index = -100
    _validate(input, weight_local, target, bias_local, reduction, label_smoothing, z_loss,
              softcap, temperature)
    _check_vocab_start(vocab_start)
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size <= 0):
        raise ValueError(f"flce.parallel: vocab_size must be a positive int, got {vocab_size!r}")
    if sequence_parallel and not reduce_input_grad:
        raise ValueError("flce.parallel: sequence_parallel=True reduce-scatters input's gradient "
                         "itself; reduce_input_grad=False is not supported with it")
    if sequence_parallel and input.dim() < 2:
        raise ValueError("flce.parallel: sequence_parallel needs input of shape (tokens, ..., D)")
    group, rank, world = _resolve_group(group)

    d = input.shape[-1]
    lead = tuple(target.shape)
    x = input.reshape(-1, d)
    t = target.reshape(-1).to(torch.int64)
    softcap = float(softcap or 0.0)
    options = (int(ignore_index), float(label_smoothing), float(z_loss), softcap,
               float(temperature))
    meta = [weight_local.shape[0], -1 if vocab_start is None else vocab_start,
            -1 if vocab_size is None else vocab_size, x.shape[0], d, _DTYPE_CODES[input.dtype],
            _DTYPE_CODES[weight_local.dtype], int(bias_local is not None), options[0],
            _float_bits(options[1]), _float_bits(options[2]), _float_bits(softcap),
            _REDUCTION_CODES[reduction], int(bool(sequence_parallel)),
            _float_bits(temperature)]
    layout = _layout(group, rank, world, input.device, meta, vocab_size is not None,
                     check_ranks)
    if sequence_parallel:
        t = _all_gather(t, group, world)
        lead = (world * lead[0],) + lead[1:]
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad or weight_local.requires_grad
        or (bias_local is not None and bias_local.requires_grad))
    if needs_grad and _use_single_pass(single_pass, reduction, return_lse or return_entropy, x):
        return _VocabParallelSinglePass.apply(x, weight_local, bias_local, t, group, world, layout,
                                              options, reduction, bool(reduce_input_grad),
                                              bool(sequence_parallel))
    loss, lse, entropy = _VocabParallelLinearCE.apply(
        x, weight_local, bias_local, t, group, rank, world, layout, options,
        bool(reduce_input_grad), bool(sequence_parallel))
    return per_token_outputs(reduce_loss(loss, t, ignore_index, reduction, lead), lse, entropy,
                             lead, return_lse, return_entropy)


# ---------------------------------------------------------------------------------------------
# DTensor dispatch (flce.linear_cross_entropy with a vocab-sharded DTensor weight).
# ---------------------------------------------------------------------------------------------
def is_vocab_sharded(weight):
    """True when ``weight`` is a ``DTensor`` (flce.linear_cross_entropy then calls
    :func:`linear_cross_entropy_dtensor`, which accepts ``Shard(0)`` on a 1-D mesh)."""
    mod = sys.modules.get("torch.distributed.tensor")
    # No DTensor exists before torch.distributed.tensor has been imported.
    return mod is not None and isinstance(weight, mod.DTensor)


def linear_cross_entropy_dtensor(input, weight, target, *, bias=None, ignore_index=-100,
                                 reduction="mean", label_smoothing=0.0, z_loss=0.0,
                                 softcap=None, temperature=1.0, return_lse=False,
                                 return_entropy=False):
    """``flce.linear_cross_entropy`` for a ``DTensor`` weight ``Shard(0)`` on a 1-D mesh.

    ``input`` and ``target`` may be plain tensors (the same on every rank) or DTensors on the
    weight's mesh (any placement: they are redistributed to ``Replicate``, whose backward hands
    each rank its slice of the all-reduced input gradient). ``bias`` must be a DTensor with the
    weight's placement. The loss (and lse) come back as plain tensors, identical on all ranks.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"flce: a DTensor weight must be sharded over the vocabulary, "
                         f"placements (Shard(0),) on a 1-D mesh; got {tuple(weight.placements)} "
                         f"on a {mesh.ndim}-D mesh (redistribute it, or slice a 1-D sub-mesh)")

    def local(name, t, placements):
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != mesh:
            raise ValueError(f"flce: {name} is a DTensor on a different mesh than weight")
        if placements is not None and tuple(t.placements) != placements:
            raise ValueError(f"flce: a DTensor {name} must have weight's placements "
                             f"{placements}, got {tuple(t.placements)}")
        if placements is None:
            t = t.redistribute(mesh, [Replicate()])
        return t.to_local()

    if bias is not None and not isinstance(bias, DTensor):
        raise ValueError("flce: with a DTensor weight, bias must be a DTensor with placements "
                         "(Shard(0),) on the same mesh")
    return vocab_parallel_linear_cross_entropy(
        local("input", input, None), weight.to_local(), local("target", target, None),
        group=mesh.get_group(), bias_local=local("bias", bias, (Shard(0),)),
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, softcap=softcap, temperature=temperature, return_lse=return_lse,
        return_entropy=return_entropy)


# ---------------------------------------------------------------------------------------------
# Megatron-Core drop-in at the logits level.
# ---------------------------------------------------------------------------------------------
class _VocabParallelLogitsCE(torch.autograd.Function):
    """The row statistics of csrc/include/flce/math.h in torch ops, for [N, V_local] logits.

    Forward = flce::partial_stats on given logits (here: masked max, sum-exp and logit sum in
    fp32), then the all-gather and flce::combine as in the fused path. Backward = math.h's
    row_grad/logit_grad with z_loss = 0 and no lse gradient:
        dz_j = g p_j - u                      (j != t)
        dz_t = g eps' p_t - g (1 - eps') q_t - u,   p_t = sigmoid(z_t - lse_x),
                                                    q_t = sigmoid(lse_x - z_t),  u = g eps' / V
    (row_grad's (A - B) p_t - B q_t - U with A = g, B = g (1 - eps'), U = g eps' / V).
    """

    @staticmethod
    def forward(ctx, logits, target, eps, group, world, layout):
        n, v_local = logits.shape
        lo, vocab_size = layout.vocab_start, layout.vocab_size
        owned = (target >= lo) & (target < lo + v_local)
        tl = torch.where(owned, target - lo, torch.zeros_like(target))[:, None]
        neg_inf = torch.full_like(tl, float("-inf"), dtype=torch.float32)
        # One fp32 working copy, modified in place; the caller's logits are never written.
        z = logits.to(torch.float32, copy=True)
        sum_z = z.sum(1)
        z_t = torch.where(owned[:, None], z.gather(1, tl), neg_inf)
        # The owner drops the target from its sum (collapse-safe lse_x).
        z.scatter_(1, tl, torch.where(owned[:, None], neg_inf, z.gather(1, tl)))
        m = z.amax(1, keepdim=True)
        # An all-target row (V_local = 1) has m = -inf: the empty state (-inf, 0).
        s = z.sub_(torch.where(m == float("-inf"), torch.zeros_like(m), m)).exp_().sum(1)
        # (u, the entropy's sum, is not needed: this function returns the loss alone)
        partials = torch.stack([m[:, 0], s, z_t[:, 0], sum_z, torch.zeros_like(s)], dim=1)
        gathered = _all_gather(partials, group, world).view(world, n, _ops.PARTIAL_COLS)
        loss, _, stats, _ = _ops.ops.combine(gathered, target, vocab_size, -100, eps, 0.0)
        ctx.save_for_backward(logits, target, stats)
        ctx.setup = (eps, lo, vocab_size)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, stats = ctx.saved_tensors
        eps, lo, vocab_size = ctx.setup
        v_local = logits.shape[1]
        m_x, s_x, z_t, _ = stats.unbind(1)
        lse_x = m_x + torch.log(s_x)
        g = torch.where(target == -100, torch.zeros_like(grad_loss), grad_loss.float())
        # math.h's row_grad from (m_x, s_x): p_j = exp(z_j - M) / S with M the row's max logit,
        # so that p_j carries no rounding of lse.
        top = torch.maximum(m_x, z_t)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        denom = s_x * torch.exp(m_x - top) + torch.exp(z_t - top)
        u = g * (eps / vocab_size)
        dz_t = g * eps * torch.sigmoid(z_t - lse_x) - g * (1.0 - eps) * torch.sigmoid(lse_x - z_t)
        dz_t = dz_t - u
        owned = (target >= lo) & (target < lo + v_local)
        tl = torch.where(owned, target - lo, torch.zeros_like(target))[:, None]
        # The upcast is recomputed here rather than saved from the forward.
        grad = logits.to(torch.float32, copy=True).sub_(top[:, None]).exp_().div_(denom[:, None])
        grad.mul_(g[:, None]).sub_(u[:, None])
        grad.scatter_(1, tl, torch.where(owned[:, None], dz_t[:, None], grad.gather(1, tl)))
        return grad.to(logits.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                 tp_group=None, *, vocab_start=None):
    """Collapse-safe drop-in for Megatron-Core's ``vocab_parallel_cross_entropy``.

    Args:
        vocab_parallel_logits: ``[seq, batch, V / tp]`` (any leading shape) this rank's logit
            columns; equal shards in rank order (rank ``r`` holds ``[r V/tp, (r+1) V/tp)``), as
            in Megatron, unless ``vocab_start`` says otherwise. Never modified; bf16/fp16 logits
            are upcast to fp32 inside.
        target: ``[seq, batch]`` global vocabulary ids; -100 marks ignored tokens (loss and
            gradient exactly 0, unlike Megatron, which returns a finite nonzero loss for them
            and relies on the loss mask).
        label_smoothing: Megatron's convention: probability ``1 - alpha`` on the target and
            ``alpha / (V - 1)`` on every other class, i.e. torch's smoothing with
            ``eps = alpha V / (V - 1)`` over the global vocabulary ``V``. (Megatron-Core itself
            takes ``V`` and the log-prob mean from the local partition; both agree at tp = 1.)
        tp_group: the tensor-parallel process group (default: WORLD).
        vocab_start: this rank's first global column, for shards of different sizes or out of
            rank order (pass it on every rank; the shards must tile ``[0, V)``). Without it,
            shards whose sizes differ across ranks raise ``ValueError`` on every rank: the
            offsets ``r V/tp`` would be wrong.

    The shard sizes are checked across ranks with one small all-gather the first time a group
    sees a shape (cached per group and shape, as in :func:`vocab_parallel_linear_cross_entropy`),
    so ranks must make the same calls in the same order.

    Returns:
        Per-token loss, float32, shape ``target.shape``.
    """
    if not isinstance(vocab_parallel_logits, torch.Tensor) or not isinstance(target,
                                                                             torch.Tensor):
        raise TypeError("flce: vocab_parallel_logits and target must be tensors")
    if vocab_parallel_logits.dtype not in _DTYPE_CODES:
        raise TypeError(f"flce: vocab_parallel_logits must be float32, bfloat16 or float16, "
                        f"got {vocab_parallel_logits.dtype}")
    if vocab_parallel_logits.dim() < 1 or target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(f"flce: target must have shape {tuple(vocab_parallel_logits.shape[:-1])}"
                         f" (the logits' leading dimensions), got {tuple(target.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex:
        raise TypeError(f"flce: target must hold class indices, got {target.dtype}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"flce: label_smoothing must be in [0, 1), got {label_smoothing}")
    _check_vocab_start(vocab_start)
    group, rank, world = _resolve_group(tp_group)
    lead = target.shape
    # (Not reshape(-1, V_local): an empty shard must reach the check below on every rank.)
    logits = vocab_parallel_logits.reshape(target.numel(), vocab_parallel_logits.shape[-1])
    code = _DTYPE_CODES[logits.dtype]
    # The fields of _META_FIELDS that a logits-level call has (no D, bias or weight of its own).
    meta = [logits.shape[1], -1 if vocab_start is None else vocab_start, -1, logits.shape[0], 0,
            code, code, 0, -100, _float_bits(label_smoothing), _float_bits(0.0), _float_bits(0.0),
            _REDUCTION_CODES["none"], 0, _float_bits(1.0)]
    layout = _layout(group, rank, world, logits.device, meta, False, False)
    # Every rank holds the same sizes, so every rank raises here or none does.
    if 0 in layout.sizes:
        raise ValueError(f"flce.parallel: vocab_parallel_logits has an empty vocabulary shard: "
                         f"{list(layout.sizes)} columns (by rank)")
    if vocab_start is None and len(set(layout.sizes)) > 1:
        raise ValueError(f"flce.parallel: vocab_parallel_logits shards differ in size across "
                         f"ranks: {list(layout.sizes)} columns (by rank), but without "
                         f"vocab_start each rank's offset is rank * its own size (Megatron's "
                         f"equal shards); pass vocab_start= (this rank's first global column) "
                         f"on every rank")
    v = layout.vocab_size
    eps = float(label_smoothing) * v / (v - 1) if label_smoothing > 0 and v > 1 else 0.0
    loss = _VocabParallelLogitsCE.apply(logits, target.reshape(-1).to(torch.int64), eps, group,
                                        world, layout)
    return loss.reshape(lead)
