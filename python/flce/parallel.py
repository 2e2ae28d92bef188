"""Vocab-parallel linear cross-entropy over ``torch.distributed`` (tensor parallelism).

Rank ``r`` of a process group holds the rows ``[vocab_start_r, vocab_start_r + V_r)`` of the
classifier and calls the single-device ops with its shard's place in the vocabulary. Training
(CUDA backend) runs ``flce::sum_and_grad`` with the group, which all-gathers each chunk of rows'
statistics inside the op. The per-token path runs one family of ops (``_ShardOps``): each rank's
row statistics of its shard (``flce::partial_stats``: ``[N, 5]`` fp32, the non-target max and
sum-exp, the target logit if the rank owns it, the logit sum, the entropy's sum), ONE
all-gather, ``flce::combine`` into the collapse-safe loss (the same math as on one device), and
a backward local to the rank from the combined statistics (``flce::backward``: ``dC`` stays
local, ``dE`` is summed over the group in fp32 and rounded once). A group of one rank is the
single-device call: the same ops, no collective. See docs/parallel.md.

Entry points:

* :func:`vocab_parallel_linear_cross_entropy`: local weight shard + process group (Megatron-style
  models, plain ``torch.distributed`` scripts).
* :func:`vocab_parallel_linear_distillation`: ``flce.linear_distillation`` with the student's and
  the teacher's classifiers sharded over the same rows (flce.distill's chunk loop, whose row
  math reduces over the shards through ``_VocabShard``: three small collectives per chunk).
* ``flce.linear_cross_entropy`` with a ``DTensor`` weight sharded on dim 0 over a 1-D mesh
  (TorchTitan-style models) dispatches to :func:`linear_cross_entropy_dtensor`.
* :func:`cross_entropy`: cross-entropy on this rank's logit columns (the op pair
  ``flce::logits_stats`` / ``flce::logits_backward``, one all-gather of ``[N, 5]`` statistics);
  :func:`vocab_parallel_cross_entropy`, a collapse-safe drop-in for Megatron-Core's
  ``tensor_parallel.vocab_parallel_cross_entropy`` on it; ``flce.cross_entropy`` of a
  ``DTensor`` sharded over the classes (TorchTitan's ``loss_parallel``) dispatches to
  :func:`cross_entropy_dtensor`.

Importing this module is cheap: ``torch.distributed`` is used only inside the functions.
"""
import hashlib
import math
import struct
import sys
from typing import Callable, NamedTuple

import torch

from . import _common, _ops, distill
from ._common import ArgumentError

__all__ = [
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_linear_distillation",
    "cross_entropy",
    "vocab_parallel_cross_entropy",
    "cross_entropy_dtensor",
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
    """(group, this rank in it, its size) for a ``group=`` argument, checked on this rank alone
    before any collective: a rank whose group is wrong cannot meet the others in one (see
    docs/parallel.md for what that leaves uncaught)."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flce.parallel: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    mesh_cls = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            raise ArgumentError(f"flce.parallel: group must be a 1-D DeviceMesh, got a "
                                f"{group.ndim}-D mesh; pass mesh[dim_name] for the TP dimension")
        group = group.get_group()
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ArgumentError(f"flce.parallel: global rank {dist.get_rank()} is not a member of "
                            f"group (torch.distributed.new_group returned NON_GROUP_MEMBER "
                            f"here); pass the group of the ranks that hold the vocabulary shards")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"flce.parallel: group must be a torch.distributed ProcessGroup, a 1-D "
                        f"DeviceMesh or None (WORLD), got {type(group).__name__} {group!r}")
    return group, dist.get_rank(group), dist.get_world_size(group)


def _group_fingerprint(group):
    """The group's size and a hash of its members' global ranks in group-rank order, for the
    exchange: ranks whose collectives met over groups that differ raise."""
    members = _dist().get_process_group_ranks(group)
    digest = hashlib.sha256(repr(list(members)).encode()).digest()
    return [len(members), int.from_bytes(digest[:7], "little")]


# ---------------------------------------------------------------------------------------------
# Shard layout: where each rank's rows sit in the global vocabulary, agreed on once per group and
# local shape, with the cheap cross-rank consistency checks.
# ---------------------------------------------------------------------------------------------
class _Layout:
    __slots__ = ("vocab_start", "vocab_size", "valid_rows", "starts", "sizes")

    def __init__(self, vocab_start, vocab_size, valid_rows, starts, sizes):
        self.vocab_start = vocab_start  # this rank's first global row (at most vocab_size)
        self.vocab_size = vocab_size    # global real vocabulary (softmax and smoothing)
        self.valid_rows = valid_rows    # this shard's rows below vocab_size
        self.starts = starts
        self.sizes = sizes


_LAYOUTS = {}
_LAYOUT_CACHE_SIZE = 256
# Fields of the metadata row; those from N to temperature must agree across ranks. "error": this
# rank's own arguments failed a check (its message follows in a second exchange); "target min"
# and "target max": the range of its non-ignored targets (ignored ones count as 0).
# (shift, reduce_input_grad and whether input needs a gradient: ranks that differ there meet
# different collectives in the backward, or own different target columns)
_META_FIELDS = ("V_local", "vocab_start", "vocab_size", "N", "D", "input dtype", "weight dtype",
                "bias", "ignore_index", "label_smoothing", "z_loss", "softcap", "reduction",
                "sequence_parallel", "temperature", "single pass", "class weights", "targets",
                "exact_bf16_grad", "shift", "reduce_input_grad", "input requires grad",
                "return_predicted_tokens", "group size", "group members", "error", "target min", "target max")
# flce.parallel.vocab_parallel_linear_distillation's row: the same first three fields and last
# five, between them its own ("D": the student's hidden size; "requires grad": a bitmask of the
# six tensors that get a gradient, which decides the collectives of the backward).
_DISTILL_FIELDS = ("V_local", "vocab_start", "vocab_size", "N", "D", "teacher D", "input dtype",
                   "weight dtype", "teacher input dtype", "teacher weight dtype", "bias",
                   "teacher bias", "ignore_index", "divergence", "beta", "temperature",
                   "hard_weight", "soft_weight", "reduction", "targets", "shift",
                   "reduce_input_grad", "requires grad", "group size", "group members", "error",
                   "target min", "target max")
_DISTILL_DTYPES = {**_DTYPE_CODES, torch.float64: 4}  # (the distillation takes float64)
_DTYPE_NAMES = {v: k for k, v in _DISTILL_DTYPES.items()}


def clear_layout_cache():
    """Forget the shard layouts agreed on so far (e.g. after re-creating process groups)."""
    _LAYOUTS.clear()


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _exchange_device(group):
    """Where the metadata row is all-gathered: the current CUDA device for NCCL, else the CPU."""
    backend = str(_dist().get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _target_range(target, ignore_index, device):
    """[min, max] of the non-ignored targets (ignored ones as 0), on the exchange device."""
    if target is None or target.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    t = target.reshape(-1).to(torch.int64)
    t = torch.where(t == ignore_index, torch.zeros_like(t), t)
    return torch.stack([t.min(), t.max()]).to(device)


def _layout(group, rank, world, meta, explicit_size, check_ranks, error=None, target=None,
            ignore_index=-100, fields=_META_FIELDS):
    """Shard offsets and the global vocabulary for this call, from an exchange of every rank's
    metadata row (``fields``), after which every rank raises the same error or none does.

    ``meta``: this rank's row of ``fields`` up to "group size" (ignored when ``error`` is set:
    the exception this rank's own argument checks raised); the group's fingerprint follows it. The
    exchange all-gathers one int64 row per rank, with this rank's target range, and every rank
    checks every row: a rank with bad arguments, ranks that disagree on a shape, an option or
    the group's members, shards that do not tile the vocabulary, or a target out of range on any
    rank raise the same exception on all ranks, before any collective that could hang. It costs
    one small all-gather and reads it on the host (a device sync under NCCL) per call;
    ``check_ranks=False`` makes it once per group and row instead, skipped by a rank whose row
    matches an agreed one, which is only safe while all ranks make identical calls (a rank
    whose arguments change alone then meets a different collective: docs/parallel.md).

    A world of one rank exchanges nothing: its own error is raised as it is, and its targets are
    checked by the ops, as on one device.
    """
    if world == 1 and error is not None:
        raise error
    err, tmin, tmax = (fields.index(f) for f in ("error", "target min", "target max"))
    meta = [0] * err if error is not None else meta + _group_fingerprint(group)
    key = (id(group), rank, world, fields) + tuple(meta)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is group and not check_ranks and error is None:
        return hit[1]
    if world == 1:
        rows = [meta + [0, 0, 0]]
    else:
        device = _exchange_device(group)
        row = torch.cat([torch.tensor(meta + [int(error is not None)], dtype=torch.int64,
                                      device=device),
                         _target_range(target if error is None else None, ignore_index, device)])
        rows = _all_gather(row[None], group, world).tolist()
        _raise_rank_errors(rows, error, group, world, err)
    mine = rows[rank]
    for f in range(3, err):
        values = [r[f] for r in rows]
        if any(v != mine[f] for v in values):
            raise ArgumentError(f"flce.parallel: ranks disagree on {fields[f]}: "
                                f"{_describe(fields[f], values)} (rank r at position r)")
    sizes = [r[0] for r in rows]
    given = [r[1] >= 0 for r in rows]
    if any(given) != all(given):
        raise ArgumentError(f"flce.parallel: pass vocab_start on every rank or on none; got "
                            f"{[r[1] if r[1] >= 0 else None for r in rows]} (by rank)")
    if all(given):
        starts = [r[1] for r in rows]
    else:
        starts = [sum(sizes[:r]) for r in range(world)]
    # (an empty shard may share its start with the next one: it goes first)
    order = sorted(range(world), key=lambda r: (starts[r], sizes[r]))
    end = 0
    for r in order:
        if starts[r] != end:
            raise ArgumentError(f"flce.parallel: vocabulary shards must tile [0, V) without "
                                f"gaps or overlaps; shard starts {starts}, sizes {sizes} (by "
                                f"rank)")
        end += sizes[r]
    sizes_given = {r[2] for r in rows}
    if len(sizes_given) != 1:
        raise ArgumentError(f"flce.parallel: ranks disagree on vocab_size: {[r[2] for r in rows]}")
    vocab_size = sizes_given.pop() if explicit_size else end
    if explicit_size and not 0 < vocab_size <= end:
        raise ArgumentError(f"flce.parallel: vocab_size must be in [1, {end}] (the rows of all "
                            f"shards), got {vocab_size}")
    if vocab_size <= 0:
        raise ArgumentError("flce.parallel: every vocabulary shard is empty")
    for r, rr in enumerate(rows):
        bad = rr[tmin] if rr[tmin] < 0 else (rr[tmax] if rr[tmax] >= vocab_size else None)
        if bad is not None:
            raise IndexError(f"flce.parallel: rank {r} has a target of {bad}, out of range for "
                             f"a vocabulary of {vocab_size} (and not ignore_index = "
                             f"{rr[fields.index('ignore_index')]})")
    # A shard wholly in the vocabulary's padding is an empty shard at its end (its ops, the CUDA
    # single pass's shard check and the class weights' slice, see no row past vocab_size).
    start = min(starts[rank], vocab_size)
    valid = max(0, min(sizes[rank], vocab_size - start))
    layout = _Layout(start, vocab_size, valid, tuple(starts), tuple(sizes))
    if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    _LAYOUTS[key] = (group, layout)
    return layout


def _raise_rank_errors(rows, error, group, world, err):
    """Where any rank's own arguments failed a check: every rank raises that rank's exception
    (the first such rank's, by rank), with its message, which a second exchange brings. Its
    class: TypeError, IndexError, NotImplementedError and DtypeError as they are; any other
    exception (a ValueError, or a RuntimeError such as a tensor's ambiguous truth value) as
    ArgumentError, which is both a ValueError and a RuntimeError. ``err``: the rows' "error"
    field."""
    if not any(r[err] for r in rows):
        return
    messages = [None] * world
    mine = None if error is None else (type(error).__name__, str(error))
    _dist().all_gather_object(messages, mine, group=group)
    failed = [r for r in range(world) if rows[r][err]]
    name, text = messages[failed[0]]
    cls = {"TypeError": TypeError, "IndexError": IndexError, "DtypeError": _common.DtypeError,
           "NotImplementedError": NotImplementedError}.get(name, ArgumentError)
    others = f" (ranks {failed} have bad arguments)" if len(failed) > 1 else ""
    raise cls(f"flce.parallel: rank {failed[0]}'s arguments are invalid: {text}{others}")


def _check_vocab_start(vocab_start):
    # (int64: it travels in the ranks' exchange of their arguments, an int64 tensor)
    if vocab_start is not None and (not isinstance(vocab_start, int) or
                                    not 0 <= vocab_start <= _common.INT64_MAX):
        raise ArgumentError(f"flce.parallel: vocab_start must be a non-negative int64, got "
                            f"{vocab_start!r}")


def _check_vocab_size(vocab_size):
    if vocab_size is not None and (not isinstance(vocab_size, int) or
                                   isinstance(vocab_size, bool) or
                                   not 0 < vocab_size <= _common.INT64_MAX):
        raise ArgumentError(f"flce.parallel: vocab_size must be a positive int64, got "
                            f"{vocab_size!r}")


def _describe(name, values):
    if name.endswith("dtype"):
        return str([str(_DTYPE_NAMES.get(v, v)).replace("torch.", "") for v in values])
    if name in ("label_smoothing", "z_loss", "softcap", "temperature", "beta", "hard_weight",
                "soft_weight"):
        return str([struct.unpack("<d", struct.pack("<q", v))[0] for v in values])
    if name == "divergence":
        return str([distill.DIVERGENCES[v] for v in values])
    if name == "reduction":
        codes = {v: k for k, v in _REDUCTION_CODES.items()}
        return str([codes[v] for v in values])
    if name == "group members":
        return (f"hashes {values} of their group's global ranks: the ranks passed different "
                f"groups as group=")
    return str(values)


# ---------------------------------------------------------------------------------------------
# The fused vocab-parallel op.
# ---------------------------------------------------------------------------------------------
class _Tokens(NamedTuple):
    """The op's tokens as the caller's, over several ranks. ``mode`` "sum": every rank passes the
    same tokens, whose gradient is summed over the group; "gather" (sequence parallelism): every
    rank's tokens in rank order, and this rank's block of the summed gradient; None: one rank, or
    the gradient left as this rank's part for the caller to reduce (reduce_input_grad=False).

    The ranks' parts of the gradient are summed in fp32 and rounded once to the tokens' dtype
    (``reduce``): rounding each part first and summing in 16 bits, as a TP region's backward
    does, puts 16-bit dE above its rounding floor (docs/parallel.md)."""
    mode: object = None
    group: object = None
    world: int = 1

    def gather(self, x):
        return _all_gather(x, self.group, self.world) if self.mode == "gather" else x

    def reduce(self, part, dtype):
        """The tokens' gradient from this rank's fp32 part ``part`` (the op's own buffer)."""
        if self.mode == "sum":
            part = _all_reduce(part.contiguous(), self.group)
        elif self.mode == "gather":
            part = _reduce_scatter(part, self.group, self.world)
        return part.to(dtype)


def _tokens(group, world, reduce_input_grad, sequence_parallel):
    if world > 1 and sequence_parallel:
        return _Tokens("gather", group, world)
    if world > 1 and reduce_input_grad:
        return _Tokens("sum", group, world)
    return _Tokens()


def _shard_rows(weight, bias, layout):
    """The shard without its vocabulary padding rows (views: those rows never enter the softmax
    and get a zero gradient)."""
    if layout.valid_rows < weight.shape[0]:
        weight = weight.narrow(0, 0, layout.valid_rows)
        bias = None if bias is None else bias.narrow(0, 0, layout.valid_rows)
    return weight, bias


class _SinglePass(torch.autograd.Function):
    """The single pass over several ranks (flce::sum_and_grad with the group), with the tokens'
    collective: ``call(x, w, b)`` runs the op on the tokens (all ranks' under sequence
    parallelism); backward scales its deferred gradients (flce._ops.scale_deferred), grad_input
    in fp32 for the tokens' fp32 sum over the group."""

    @staticmethod
    def forward(ctx, tokens, call, x, w, b):
        x = tokens.gather(x)
        loss, divisor, gi, gw, gb = call(x, w, b)
        ctx.save_for_backward(divisor, gi, gw, gb)
        ctx.tokens = tokens
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        _ops.refuse_double_backward("the single pass (flce::sum_and_grad)", "single_pass=False")
        divisor, *deferred = ctx.saved_tensors
        reduce = ctx.tokens.mode is not None
        dtypes = ((torch.float32 if reduce else ctx.dtypes[0]),) + ctx.dtypes[1:]
        gi, gw, gb = _ops.scale_deferred(_ops.ops, ctx, grad_loss, divisor, deferred, dtypes,
                                         ctx.needs_input_grad[2:])
        if reduce and gi is not None:
            gi = ctx.tokens.reduce(gi, ctx.dtypes[0])
        return None, None, gi, gw, gb


# ---------------------------------------------------------------------------------------------
# The per-token path over the shards, one autograd Function for every family of ops whose flow
# is: this rank's row statistics, ONE all-gather of them, their combination into the global
# per-token outputs, and a backward local to the rank from the combined statistics.
# ---------------------------------------------------------------------------------------------
class _ShardOps(NamedTuple):
    """One family of ops over the vocabulary shards, as callables over the family's tensors
    ``*tensors`` (the call's options and layout are bound in them):

    * ``one_device(*tensors) -> (loss, lse, stats, entropy)``: the single-device op, with its
      own registered autograd (a world of one rank runs it, and nothing else);
    * ``partial(*tensors) -> [N, C]`` fp32: this rank's row statistics (any C);
    * ``combine(gathered, *tensors) -> (loss, lse, stats, entropy)``: ``gathered``
      ``[world, N, C]`` every rank's statistics in rank order; the global per-token outputs,
      the same on every rank, and ``stats`` for the backward (not differentiable);
    * ``backward(needs, grads, stats, *tensors) -> one gradient per tensor``: ``needs[i]``
      whether ``tensors[i]`` wants its gradient (None where not), ``grads`` the upstream
      ``(grad_loss [N] fp32, grad_lse or None, grad_entropy or None)``;
    * ``partial_argmax(*tensors) -> ([N, 5], [N] int64)`` (return_predicted_tokens; families
      of class targets only): ``partial``'s statistics and the global column of each row's
      largest non-target logit on this shard (the ``*_argmax`` ops' values).
    """
    one_device: Callable
    partial: Callable
    combine: Callable
    backward: Callable
    partial_argmax: Callable = None


def _per_token(family, tensors, group, world, tokens=_Tokens(), predicted=False):
    """(loss, lse, stats, entropy) [N] of ``family`` (a ``_ShardOps``) over the shards of
    ``group``: ``family.one_device`` for one rank, else partial, one all-gather, combine.
    ``tokens``: the collective of a linear family's tokens (``tensors[0]``). ``predicted``
    (return_predicted_tokens): a fifth output, the argmax column of each row over all shards
    (_merge_argmax; through _OverShards on one rank too)."""
    if world == 1 and not predicted:
        return family.one_device(*tensors)
    return _OverShards.apply(family, group, world, tokens, predicted, *tensors)


def _merge_argmax(gathered, argmax):
    """The ranks' ``*_argmax`` columns ``argmax`` [world, N] (global; -1: the shard has no
    non-target column, -2: a NaN non-target logit) merged into the whole vocabulary's, as one
    shard's tiles are: the column of the largest non-target max m (``gathered[..., 0]``, each
    rank's partial statistics) among the ranks that have one, the lowest column of equals; -2
    where any rank has -2, -1 where none has a column."""
    has = argmax >= 0
    m = torch.where(has, gathered[..., 0], float("-inf"))
    win = has & (m == m.amax(0))
    col = torch.where(win, argmax, _common.INT64_MAX).amin(0)
    col = torch.where(win.any(0), col, -1)
    return torch.where((argmax == -2).any(0), -2, col)


class _OverShards(torch.autograd.Function):
    """_per_token's autograd over several ranks: forward the tokens' gather (sequence
    parallelism) and one all-gather of the statistics; backward each rank's gradients of its
    shard, and the tokens' summed over the group in fp32 (``_Tokens``)."""

    @staticmethod
    def forward(ctx, family, group, world, tokens, predicted, *tensors):
        tensors = (tokens.gather(tensors[0]),) + tensors[1:]
        if predicted:
            partials, argmax = family.partial_argmax(*tensors)
        else:
            partials = family.partial(*tensors)
        gathered = _all_gather(partials, group, world).view(world, *partials.shape) \
            if world > 1 else partials[None]
        loss, lse, stats, entropy = family.combine(gathered, *tensors)
        if predicted:
            # (one more all-gather, of int64 [N], only when asked)
            if world > 1:
                argmax = _merge_argmax(gathered,
                                       _all_gather(argmax, group, world).view(world, -1))
            ctx.mark_non_differentiable(argmax)
        ctx.save_for_backward(*tensors, stats)
        ctx.family, ctx.tokens = family, tokens
        ctx.mark_non_differentiable(stats)
        out = loss, lse, stats, entropy
        return out + (argmax,) if predicted else out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_stats, grad_entropy, *_grad_argmax):
        _ops.refuse_double_backward("the vocab-parallel path", "the single-device entry point")
        *tensors, stats = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        none = (None,) * 5
        if not any(needs):
            return none + (None,) * len(tensors)
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        reduce = ctx.tokens.mode is not None
        grads = list(ctx.family.backward(needs, (grad_loss, grad_lse, grad_entropy), stats,
                                         *tensors, fp32_input_grad=reduce))
        if reduce and needs[0]:
            grads[0] = ctx.tokens.reduce(grads[0], tensors[0].dtype)
        return none + tuple(g if need else None for g, need in zip(grads, needs))


def _linear_ops(layout, opts, exact_bf16_grad=None):
    """The linear family over tensors (x, w, b, t): flce::partial_stats, flce::combine,
    flce::backward (one device: flce::forward), bf16 gradients as exact_bf16_grad asks."""
    ii, ls, z, sc, temp = (opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap,
                           opts.temperature)

    def one_device(x, w, b, t):
        return _ops.ops.forward(x, w, t, b, ii, ls, z, sc, temp, exact_bf16_grad)

    def partial(x, w, b, t):
        return _ops.ops.partial_stats(x, w, t, b, layout.vocab_start, ii, sc, temp)

    def partial_argmax(x, w, b, t):
        return _ops.ops.partial_stats_argmax(x, w, t, b, layout.vocab_start, ii, sc, temp)

    def combine(gathered, x, w, b, t):
        return _ops.ops.combine(gathered, t, layout.vocab_size, ii, ls, z)

    def backward(needs, grads, stats, x, w, b, t, fp32_input_grad=False):
        grad_loss, grad_lse, grad_entropy = grads
        return _ops.ops.backward(grad_loss, grad_lse, x, w, t, b, stats, layout.vocab_start,
                                 layout.vocab_size, ii, ls, z, sc, list(needs[:3]), grad_entropy,
                                 temp, exact_bf16_grad, fp32_input_grad) + (None,)

    return _ShardOps(one_device, partial, combine, backward, partial_argmax)


def _logits_ops(layout, options, with_entropy, inplace):
    """The logits family over tensors (logits, t): flce::logits_stats, flce::combine,
    flce::logits_backward(_) (one device: flce::logits_forward). ``options``: (ignore_index,
    label_smoothing, z_loss, softcap, temperature)."""
    ii, ls, z, sc, temp = options

    def one_device(logits, t):
        return _ops.ops.logits_forward(logits, t, ii, ls, z, sc, temp, with_entropy, inplace)

    def partial(logits, t):
        return _ops.ops.logits_stats(logits, t, layout.vocab_start, ii, sc, temp, ls != 0.0,
                                     with_entropy)

    def partial_argmax(logits, t):
        return _ops.ops.logits_stats_argmax(logits, t, layout.vocab_start, ii, sc, temp,
                                            ls != 0.0, with_entropy)

    def combine(gathered, logits, t):
        return _ops.ops.combine(gathered, t, layout.vocab_size, ii, ls, z)

    def backward(needs, grads, stats, logits, t, fp32_input_grad=False):
        args = grads + (logits, t, stats, layout.vocab_start, layout.vocab_size) + tuple(options)
        if inplace and _ops.can_write_in_place(logits):
            _ops.ops.logits_backward_(*args)
            torch.autograd.graph.increment_version(logits)  # (_common.check_inplace_target)
            return logits, None
        return _ops.ops.logits_backward(*args), None

    return _ShardOps(one_device, partial, combine, backward, partial_argmax)


def _pack(state, pivot):
    """A target distribution's [..., 7] fp32 state and int64 pivot as one fp32 tensor [..., 9]
    (the pivot's bits in two columns), so that one all-gather carries both."""
    return torch.cat([state, pivot.contiguous().view(torch.float32).view(*pivot.shape, 2)], -1)


def _unpack(packed):
    """_pack's inverse: (state [..., 7], pivot [...]). (The pivot's columns copied out: a view
    of them starts at an odd float offset, which no int64 view may, and for one row
    ``.contiguous()`` keeps that view.)"""
    pivot = packed[..., _ops.SOFT_COLS:].clone(memory_format=torch.contiguous_format)
    return packed[..., :_ops.SOFT_COLS], pivot.view(torch.int64).squeeze(-1)


def _distribution_ops(layout, opts, logits_level=False):
    """The target distributions (probability targets; class targets with class weights and label
    smoothing) over tensors (operands..., target, cw, z_weight): flce::soft_partial_stats,
    soft_combine, soft_backward, one device soft_forward; or on given logits (logits_level:
    operands (logits,)) soft_logits_stats / soft_logits_backward / soft_logits_forward.
    target: this shard's probabilities [N, V_local] or global class ids [N]; cw: this shard's
    class weights (fp32) or None; z_weight: the rows' z-loss weights or None (their target
    mass). stats carry the pivot (_pack)."""
    ii, ls, z, sc, temp = (opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap,
                           opts.temperature)
    start, size = layout.vocab_start, layout.vocab_size
    ops = _ops.ops

    def one_device(*tensors):
        *operands, y, cw, zw = tensors
        if logits_level:
            out = ops.soft_logits_forward(operands[0], y, cw, zw, ii, ls, z, sc, temp)
        else:
            x, w, b = operands
            out = ops.soft_forward(x, w, y, b, cw, zw, ii, ls, z, sc, temp)
        loss, lse, stats, pivot, entropy = out
        return loss, lse, _pack(stats, pivot), entropy

    def partial(*tensors):
        *operands, y, cw, zw = tensors
        if logits_level:
            return _pack(*ops.soft_logits_stats(operands[0], y, cw, start, size, ii, ls, sc, temp))
        x, w, b = operands
        return _pack(*ops.soft_partial_stats(x, w, y, b, cw, start, size, ii, ls, sc, temp))

    def combine(gathered, *tensors):
        zw = tensors[-1]
        loss, lse, stats, pivot, entropy = ops.soft_combine(*_unpack(gathered), zw, z)
        return loss, lse, _pack(stats, pivot), entropy

    def backward(needs, grads, stats, *tensors, fp32_input_grad=False):
        *operands, y, cw, zw = tensors
        state, pivot = _unpack(stats)
        if logits_level:
            g = ops.soft_logits_backward(*grads, operands[0], y, cw, state, pivot, zw, start, size,
                                         ii, ls, z, sc, temp)
            return g, None, None, None
        x, w, b = operands
        gi, gw, gb = ops.soft_backward(*grads, x, w, y, b, cw, state, pivot, zw, start, size, ii,
                                       ls, z, sc, temp, list(needs[:3]), fp32_input_grad)
        return gi, gw, gb, None, None, None

    return _ShardOps(one_device, partial, combine, backward)


def _check_distribution(target, soft, class_weight, opts, x, shift=False,
                        sequence_parallel=False, return_accuracy=False,
                        return_predicted_tokens=False):
    """This rank's checks of a target distribution over the shards (probability targets, or
    class weights with label smoothing); whether the call is one."""
    if not (soft or (class_weight is not None and opts.label_smoothing)):
        return False
    what = "probability targets" if soft else "class weights with label smoothing"
    if soft:
        _common.check_soft_ignore_index(opts.ignore_index)
    if soft and target.requires_grad and torch.is_grad_enabled():
        # (the shards' ops return no gradient for the targets: refused, never left out silently)
        raise ArgumentError("flce.parallel: probability targets that require grad are not "
                            "supported over vocabulary shards (no gradient of the targets); "
                            "pass target.detach(), or use the single-device call")
    if not _common.fused_distribution(x):
        raise TypeError(f"flce.parallel: {what} over vocabulary shards need the fused target "
                        f"distributions, which the CUDA backend runs only with "
                        f"FLCE_CUDA_OPT_IN=distributions (docs/api.md)")
    for name, flag in (("shift", shift), ("sequence_parallel", sequence_parallel),
                       ("return_accuracy", return_accuracy),
                       ("return_predicted_tokens", return_predicted_tokens)):
        if flag:
            raise ArgumentError(f"flce.parallel: {name}=True is not supported with {what} over "
                                f"vocabulary shards")
    return True


def vocab_parallel_linear_cross_entropy(input, weight_local, target, *, group=None,
                                        bias_local=None, ignore_index=-100, reduction="mean",
                                        label_smoothing=0.0, z_loss=0.0, softcap=None,
                                        temperature=1.0, return_lse=False, return_entropy=False,
                                        return_accuracy=False, shift=False, class_weight=None,
                                        vocab_start=None, vocab_size=None,
                                        reduce_input_grad=True, sequence_parallel=False,
                                        check_ranks=True, single_pass=None,
                                        exact_bf16_grad=None, return_predicted_tokens=False):
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
            dimensions (this rank's token shard when ``sequence_parallel``); or probabilities
            ``(..., V_local)``: this rank's shard of them, beside its classifier rows
            (docs/parallel.md).
        group: the tensor-parallel ``ProcessGroup`` or a 1-D ``DeviceMesh`` (default: WORLD).
        bias_local: optional ``(V_local,)``.
        vocab_start: this rank's first global row; default: the ranks' shards in rank order
            (offsets from one all-gather of the shard sizes, cached per group and shape).
        vocab_size: the real global vocabulary; shard rows at or beyond it (vocabulary padding)
            never enter the softmax and get zero gradient. Default: all rows of all shards.
        reduce_input_grad: all-reduce ``input``'s gradient over the group (default: the ranks'
            contributions summed in fp32 and rounded once, so that 16-bit gradients stay at
            their rounding floor). Pass False when the caller's TP region does it (Megatron's
            ``copy_to_tensor_model_parallel_region`` backward); each rank then gets its shard's
            contribution in ``input``'s dtype.
        sequence_parallel: ``input`` and ``target`` are sharded over tokens along dim 0 (equal
            shards); they are all-gathered before and ``input``'s gradient is reduce-scattered
            after. The loss covers all ranks' tokens: for ``reduction="none"`` its shape is
            ``(world * input.shape[0], *input.shape[1:-1])``, in rank order.
        check_ranks: exchange every rank's shapes, options, local argument errors and target
            range on every call (default: one small all-gather, read on the host: a device
            sync per call under NCCL), so that every rank raises the same error instead of one
            rank raising and the others hanging in a collective. False: once per group and
            shape (no sync), only safe while every rank makes identical calls
            (docs/parallel.md).
        class_weight: optional per-class weights of the whole vocabulary ``(vocab_size,)``,
            the same on every rank, torch's semantics (each token's loss times its target's
            weight, ``"mean"`` over those weights; with label smoothing or probability targets,
            the target distributions of docs/parallel.md).
        return_accuracy, shift: as for ``flce.linear_cross_entropy`` (the accuracy from the
            combined statistics, the same on every rank; ``shift`` not with
            ``sequence_parallel``, whose ranks hold pieces of the sequences).
        single_pass: as for ``flce.linear_cross_entropy``: by default the CUDA backend trains
            (mean/sum, no return_lse, gradients needed) with the single pass, whose chunks of
            rows all-gather their ``[rows, 4]`` statistics inside the op.
        exact_bf16_grad: as for ``flce.linear_cross_entropy`` (the CPU backend's recompute
            backward and the CUDA backend's single pass take it).
        return_predicted_tokens: as for ``flce.linear_cross_entropy``: each token's argmax over
            the whole vocabulary (global ids, the same on every rank; one more all-gather, of
            int64 ``[N]``, only when asked). Class-id targets only.

    Returns:
        The loss in float32 (identical on all ranks), then the per-token lse when ``return_lse``,
        the per-token entropy when ``return_entropy``, the accuracy when ``return_accuracy`` and
        the predicted tokens when ``return_predicted_tokens``. Every rank must backpropagate the
        same upstream gradient into it.
    """
    return _common.unshift(_vocab_parallel_linear(
        input, weight_local, target, group=group, bias_local=bias_local,
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, softcap=softcap, temperature=temperature, return_lse=return_lse,
        return_entropy=return_entropy, return_accuracy=return_accuracy, shift=shift,
        class_weight=class_weight, vocab_start=vocab_start, vocab_size=vocab_size,
        reduce_input_grad=reduce_input_grad, sequence_parallel=sequence_parallel,
        check_ranks=check_ranks, single_pass=single_pass, exact_bf16_grad=exact_bf16_grad,
        return_predicted_tokens=return_predicted_tokens), _common.shift_amount(shift), reduction)


def _vocab_parallel_linear(input, weight_local, target, *, group, bias_local, ignore_index,
                           reduction, label_smoothing, z_loss, softcap, temperature, return_lse,
                           return_entropy, return_accuracy, shift, class_weight, vocab_start,
                           vocab_size, reduce_input_grad, sequence_parallel, check_ranks,
                           single_pass, exact_bf16_grad, return_predicted_tokens=False):
    """vocab_parallel_linear_cross_entropy's outputs with the last ``shift`` positions (ignored)
    kept (flce.linear_cross_entropy's DTensor path drops them itself)."""
    group, rank, world = _resolve_group(group)
    # This rank's own checks; their failure goes into the exchange, so that every rank raises it.
    try:
        shift = _common.shift_amount(shift)
        opts = _common.Options(ignore_index, reduction, label_smoothing, z_loss, softcap,
                               temperature)
        soft = _common.is_soft(target)
        _common.validate_linear(input, weight_local, target, bias_local)
        _check_local(input, weight_local, bias_local, target if soft else None)
        _check_class_weight(class_weight)
        _common.check_flags(return_predicted_tokens=return_predicted_tokens)
        distribution = _check_distribution(target, soft, class_weight, opts, input, shift,
                                           sequence_parallel, return_accuracy,
                                           return_predicted_tokens)
        _check_vocab_start(vocab_start)
        exact_bf16_grad = _common.exact_bf16_grad(exact_bf16_grad, input)
        _check_vocab_size(vocab_size)
        if sequence_parallel and not reduce_input_grad:
            raise ArgumentError("flce.parallel: sequence_parallel=True reduce-scatters input's "
                                "gradient itself; reduce_input_grad=False is not supported with it")
        _common.check_flags(return_lse=return_lse, return_entropy=return_entropy,
                            return_accuracy=return_accuracy)
        if shift and sequence_parallel:
            raise ArgumentError("flce.parallel: shift=True is not supported with "
                                "sequence_parallel (each rank holds a piece of the sequences)")
        if sequence_parallel and input.dim() < 2:
            raise ArgumentError("flce.parallel: sequence_parallel needs input of shape "
                                "(tokens, ..., D)")
        per_token = return_lse or return_entropy or return_accuracy or return_predicted_tokens

        def use_single(x, w, b, shards):
            return _common.plan(x, (w, b), classes=w.shape[0], distribution=distribution,
                                row_weight=class_weight is not None, single_pass=single_pass,
                                reduction=reduction, per_token=per_token,
                                shards=shards).single_pass
        single = use_single(input, weight_local, bias_local, world)
        d = input.shape[-1]
        if shift:
            target = _common.shift_target(target, opts.ignore_index, shift)
        if soft:
            lead = tuple(target.shape[:-1])
            # (not reshape(-1, V_local): an empty shard must reach the exchange on every rank)
            q = target.reshape(math.prod(lead), weight_local.shape[0])
            x = input.reshape(q.shape[0], d)
            t = None
        else:
            lead = tuple(target.shape)
            x = input.reshape(target.numel(), d)
            t = target.reshape(-1).to(torch.int64)
        meta = [weight_local.shape[0], -1 if vocab_start is None else vocab_start,
                -1 if vocab_size is None else vocab_size, x.shape[0], d,
                _DTYPE_CODES[input.dtype], _DTYPE_CODES[weight_local.dtype],
                int(bias_local is not None), opts.ignore_index, _float_bits(opts.label_smoothing),
                _float_bits(opts.z_loss), _float_bits(opts.softcap), _REDUCTION_CODES[reduction],
                int(bool(sequence_parallel)), _float_bits(opts.temperature), int(single),
                _weights_meta(class_weight), int(soft),
                -1 if exact_bf16_grad is None else int(exact_bf16_grad), shift,
                int(bool(reduce_input_grad)),
                int(torch.is_grad_enabled() and input.requires_grad),
                int(return_predicted_tokens)]
        error = None
    except Exception as e:  # (any type: see _raise_rank_errors)
        error, t, meta = e, None, None
    layout = _layout(group, rank, world, meta, vocab_size is not None, check_ranks, error=error,
                     target=t, ignore_index=None if error else opts.ignore_index)
    if sequence_parallel and world > 1:
        t = _all_gather(t, group, world)
        lead = (world * lead[0],) + lead[1:]
    w, b = _shard_rows(weight_local, bias_local, layout)
    tokens = _tokens(group, world, bool(reduce_input_grad), bool(sequence_parallel))
    if world == 1:
        # flce.linear_cross_entropy's choice, which on the CPU depends on the shapes
        single = use_single(x, w, b, 1)
    if single:
        # The single pass's own op, with the group: every chunk of rows all-gathers its
        # statistics inside it. One rank: its gradients through the op's registered autograd.
        mask = [x.requires_grad, w.requires_grad, b is not None and b.requires_grad]

        def call(x, w, b):
            return _ops.ops.sum_and_grad(x, w, t, b, *opts.op_args(), mask, reduction == "mean",
                                         layout.vocab_start, layout.vocab_size,
                                         group.group_name if world > 1 else None, world,
                                         temperature=opts.temperature,
                                         exact_bf16_grad=exact_bf16_grad)
        if world == 1:
            return call(x, w, b)[0]
        return _SinglePass.apply(tokens, call, x, w, b)
    row_weight = None if soft else _row_weights(class_weight, layout, t, opts.ignore_index)
    if distribution:
        y = q.narrow(1, 0, w.shape[0]) if soft else t
        tensors = (x, w, b, y, _shard_class_weight(class_weight, layout, w.shape[0]), row_weight)
        loss, lse, _, entropy = _per_token(_distribution_ops(layout, opts), tensors, group, world,
                                           tokens)
        return _common.distribution_outputs(loss, lse, entropy, t, opts, lead, row_weight,
                                            return_lse, return_entropy)
    loss, lse, stats, entropy, *argmax = _per_token(
        _linear_ops(layout, opts, exact_bf16_grad), (x, w, b, t), group, world, tokens,
        return_predicted_tokens)
    return _common.outputs_from_stats(loss, lse, stats, entropy, t, opts, lead, row_weight,
                                      return_lse, return_entropy, return_accuracy,
                                      argmax[0] if argmax else None)


def _check_local(*tensors):
    """What the vocab-parallel path does not serve: float64 (flce.linear_cross_entropy's
    composite path is single-device), functorch transforms and forward-mode AD."""
    if _common.needs_composite(*tensors):
        raise TypeError("flce.parallel: float64 inputs, functorch transforms (torch.func) and "
                        "forward-mode AD are not supported by the vocab-parallel path; use "
                        "float32/bfloat16/float16 and reverse-mode autograd")


# ---------------------------------------------------------------------------------------------
# Distillation over vocabulary shards: flce.linear_distillation's chunk loop and row math, whose
# reductions over a row's columns run over the shards (_VocabShard).
# ---------------------------------------------------------------------------------------------
# An empty shard's stand-in column for its "largest logit" (-inf): above every real column, so
# that a real -inf logit wins the tie (float64-exact, as the gathered columns travel in float64).
_NO_COLUMN = float(2 ** 62)


class _VocabShard(distill._Columns):
    """The distillation row math's reductions (``distill._Columns``) on this rank's shard, the
    global columns ``[start, start + rows)``: local reductions, then one collective per call
    (``argmax``: an all-gather of each row's local largest logit and its column, merged as
    torch.argmax over the whole row; ``reduce``: an all-reduce SUM of the local sums and of the
    picked entries, each from the rank that holds its column and 0 from the others). ``width``:
    the widest shard, by which every rank plans the same chunks; ``reduce_input``: the inputs'
    gradient summed over the group in fp32 (``_Tokens``) and rounded once."""

    def __init__(self, layout, group, world, tokens):
        self.start, self.rows = layout.vocab_start, layout.valid_rows
        self.group, self.world, self.tokens = group, world, tokens
        self.width = max(layout.sizes)

    def _local(self, a):
        """(whether this shard holds column a, its local column there, 0 elsewhere)"""
        i = a - self.start
        own = (i >= 0) & (i < self.rows)
        return own, torch.where(own, i, 0)

    def argmax(self, *zs):
        parts = []
        for z in zs:
            if z.shape[1]:
                i = z.argmax(dim=1, keepdim=True)
                parts += [z.gather(1, i).double(), (i + self.start).double()]
            else:
                parts += [z.new_full((z.shape[0], 1), -math.inf, dtype=torch.float64),
                          z.new_full((z.shape[0], 1), _NO_COLUMN, dtype=torch.float64)]
        g = _all_gather(torch.cat(parts, 1), self.group, self.world)
        g = g.view(self.world, -1, 2 * len(zs))
        out = []
        for k, z in enumerate(zs):
            value, column = g[..., 2 * k], g[..., 2 * k + 1]
            nan = value.isnan()
            # the largest value (a NaN above all: amax propagates it), the lowest column of equals
            best = value.amax(0)
            win = torch.where(nan.any(0), nan, value == best)
            a = torch.where(win, column, math.inf).amin(0).to(torch.int64)
            out.append((a[:, None], best[:, None].to(z.dtype)))
        return out

    def reduce(self, sums, picks=(), dtype=None):
        parts = [x.sum(1, keepdim=True, dtype=dtype) for x in sums]
        parts += [torch.where(self._local(a)[0], self.get(x, a), 0.0).to(dtype or x.dtype)
                  for x, a in picks]
        if not parts:
            return [], []
        total = _all_reduce(torch.cat(parts, 1), self.group).split(1, dim=1)
        return list(total[:len(sums)]), list(total[len(sums):])

    def get(self, x, a):
        if not x.shape[1]:
            return x.new_zeros(a.shape)
        return x.gather(1, self._local(a)[1])

    def put(self, x, a, value):
        if not x.shape[1]:
            return x
        own, i = self._local(a)
        return x.scatter(1, i, torch.where(own, value, x.gather(1, i)))

    def reduce_input(self, g, dtype):
        return self.tokens.reduce(g, dtype)


def vocab_parallel_linear_distillation(student_input, student_weight_local, teacher_input,
                                       teacher_weight_local, target=None, *, group=None,
                                       divergence="jsd", beta=0.5, temperature=1.0,
                                       hard_weight=0.0, soft_weight=1.0, ignore_index=-100,
                                       reduction="mean", student_bias_local=None,
                                       teacher_bias_local=None, shift=False, vocab_start=None,
                                       vocab_size=None, reduce_input_grad=True,
                                       check_ranks=True):
    r"""Collapse-safe knowledge distillation (:func:`flce.linear_distillation`) with the
    student's and the teacher's classifiers sharded over the same vocabulary rows of ``group``.

    Every rank passes the same tokens (``student_input``, ``teacher_input``, ``target``) and its
    own rows of both classifiers, the same global rows of each; the result equals
    ``flce.linear_distillation`` with the full weights on every rank, up to fp32 rounding
    (docs/parallel.md, "Distillation over vocabulary shards"). The options are those of
    ``flce.linear_distillation``; the mean runs over all non-ignored tokens.

    Per chunk of rows, each rank computes its shard's logits of both models, and the row math
    (the single-device call's torch ops: the CPU backend's fused row op takes whole rows) runs
    with its reductions over the shards in three collectives on ``[rows, k]`` tensors: an
    all-gather of each distribution's local largest logit and its column, an all-reduce of the
    local sums and of each model's logit at the other's dominant class and the student's at
    the target, and an all-reduce of the divergence's sums. Each rank forms its shard's logit
    gradients, whose weight (and bias) gradients stay local; the inputs' gradients are summed
    over the group in fp32 and rounded once.

    Args:
        student_input: ``(..., D_S)``; teacher_input: ``(..., D_T)``, the same on every rank.
        student_weight_local: ``(V_local, D_S)``, teacher_weight_local: ``(V_local, D_T)``:
            this rank's rows of the classifiers (the same rows of both); shards may be uneven
            (also empty) and sit in rank order unless ``vocab_start`` says otherwise.
        target: ``(...)`` global vocabulary ids or ``ignore_index``, as for
            ``flce.linear_distillation``.
        group: the tensor-parallel ``ProcessGroup`` or a 1-D ``DeviceMesh`` (default: WORLD).
        student_bias_local, teacher_bias_local: optional ``(V_local,)``.
        vocab_start, vocab_size, reduce_input_grad, check_ranks: as for
            :func:`vocab_parallel_linear_cross_entropy` (rows at or beyond ``vocab_size`` enter
            neither distribution and get zero gradient; ``reduce_input_grad`` covers both
            inputs).

    Returns:
        The loss, float32 (float64 for float64 inputs), identical on all ranks. Every rank must
        backpropagate the same upstream gradient into it.
    """
    group, rank, world = _resolve_group(group)
    # This rank's own checks; their failure goes into the exchange, so that every rank raises it.
    try:
        call = distill._prepare(student_input, student_weight_local, teacher_input,
                                teacher_weight_local, target, divergence, beta, temperature,
                                hard_weight, soft_weight, ignore_index, reduction,
                                student_bias_local, teacher_bias_local, shift, shard=True)
        _check_vocab_start(vocab_start)
        _check_vocab_size(vocab_size)
        x_s, w_s, b_s, x_t, w_t, b_t = call.tensors
        div, beta, temp, hard, soft = call.cfg
        meta = ([w_s.shape[0], -1 if vocab_start is None else vocab_start,
                 -1 if vocab_size is None else vocab_size, x_s.shape[0], x_s.shape[1],
                 x_t.shape[1]]
                + [_DISTILL_DTYPES[x.dtype] for x in (x_s, w_s, x_t, w_t)]
                + [int(b_s is not None), int(b_t is not None), call.ignore_index,
                   distill.DIVERGENCES.index(div)]
                + [_float_bits(f) for f in (beta, temp, hard, soft)]
                + [_REDUCTION_CODES[call.reduction], int(call.has_target), call.shift,
                   int(bool(reduce_input_grad)), sum(n << i for i, n in enumerate(call.needs))])
        error = None
    except Exception as e:  # (any type: see _raise_rank_errors)
        error, call, meta = e, None, None
    layout = _layout(group, rank, world, meta, vocab_size is not None, check_ranks, error=error,
                     target=None if error else call.target,
                     ignore_index=None if error else call.ignore_index, fields=_DISTILL_FIELDS)
    w_s, b_s = _shard_rows(w_s, b_s, layout)
    w_t, b_t = _shard_rows(w_t, b_t, layout)
    call = call._replace(tensors=(x_s, w_s, b_s, x_t, w_t, b_t))
    if world == 1:
        # the single-device call on the shard without its padding rows
        if call.has_target:
            _common.check_target_range(call.target, layout.vocab_size, call.ignore_index)
        return distill._loss(call)
    tokens = _tokens(group, world, bool(reduce_input_grad), False)
    return distill._loss(call, _VocabShard(layout, group, world, tokens))


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
                                 return_entropy=False, return_accuracy=False, shift=False,
                                 class_weight=None, exact_bf16_grad=None,
                                 return_predicted_tokens=False):
    """``flce.linear_cross_entropy`` for a ``DTensor`` weight ``Shard(0)`` on a 1-D mesh.

    ``input`` and ``target`` may be plain tensors (the same on every rank) or DTensors on the
    weight's mesh (any placement: they are redistributed to ``Replicate``, whose backward hands
    each rank its slice of the all-reduced input gradient). Probability targets ``(..., V)``, a
    plain tensor or a DTensor, are split over the ranks as the weight's rows are (each rank reads
    its own classes). ``bias`` must be a DTensor with the weight's placement. The loss (and lse)
    come back as plain tensors, identical on all ranks.
    """
    return _common.unshift(_linear_dtensor(
        input, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        temperature=temperature, return_lse=return_lse, return_entropy=return_entropy,
        return_accuracy=return_accuracy, shift=shift, class_weight=class_weight,
        exact_bf16_grad=exact_bf16_grad, return_predicted_tokens=return_predicted_tokens),
        _common.shift_amount(shift), reduction)


def _linear_dtensor(input, weight, target, *, bias, ignore_index, reduction, label_smoothing,
                    z_loss, softcap, temperature, return_lse, return_entropy, return_accuracy,
                    shift, class_weight, exact_bf16_grad, return_predicted_tokens=False):
    """linear_cross_entropy_dtensor's outputs with the last ``shift`` positions (ignored)
    kept (flce.linear_cross_entropy drops them itself)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ArgumentError(f"flce: a DTensor weight must be sharded over the vocabulary, "
                            f"placements (Shard(0),) on a 1-D mesh; got {tuple(weight.placements)} "
                            f"on a {mesh.ndim}-D mesh (redistribute it, or slice a 1-D sub-mesh)")

    def local(name, t, placements):
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != mesh:
            raise ArgumentError(f"flce: {name} is a DTensor on a different mesh than weight")
        if placements is not None and tuple(t.placements) != placements:
            raise ArgumentError(f"flce: a DTensor {name} must have weight's placements "
                                f"{placements}, got {tuple(t.placements)}")
        if placements is None:
            t = t.redistribute(mesh, [Replicate()])
        return t.to_local()

    if bias is not None and not isinstance(bias, DTensor):
        raise ArgumentError("flce: with a DTensor weight, bias must be a DTensor with placements "
                            "(Shard(0),) on the same mesh")
    target = (_class_columns(target, mesh, "target") if _common.is_soft(target)
              else local("target", target, None))
    return _vocab_parallel_linear(
        local("input", input, None), weight.to_local(), target,
        group=mesh.get_group(), bias_local=local("bias", bias, (Shard(0),)),
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        z_loss=z_loss, softcap=softcap, temperature=temperature, return_lse=return_lse,
        return_entropy=return_entropy, return_accuracy=return_accuracy, shift=shift,
        class_weight=local("class_weight", class_weight, None), vocab_start=None,
        vocab_size=None, reduce_input_grad=True, sequence_parallel=False, check_ranks=True,
        single_pass=None, exact_bf16_grad=exact_bf16_grad,
        return_predicted_tokens=return_predicted_tokens)


# ---------------------------------------------------------------------------------------------
# Cross-entropy on vocab-parallel logits: flce.parallel.cross_entropy, the Megatron-Core drop-in,
# and flce.cross_entropy on a DTensor sharded over the classes (TorchTitan's loss_parallel).
# ---------------------------------------------------------------------------------------------
def cross_entropy(logits, target, *, group=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                  return_lse=False, return_entropy=False, return_accuracy=False,
                  class_weight=None, vocab_start=None, inplace_backward=False,
                  check_ranks=True, return_predicted_tokens=False):
    """Collapse-safe cross-entropy of logits sharded over the classes of ``group``.

    Every rank passes the same tokens' targets and its own logit columns; the result equals
    ``flce.cross_entropy`` of the full logits (classes last) on every rank, up to fp32
    rounding, with torch's semantics and the options of :func:`flce.cross_entropy`.

    Args:
        logits: ``(..., V_local)`` this rank's columns (float32, bfloat16 or float16; read in
            their dtype, never copied); shards in rank order unless ``vocab_start`` says
            otherwise (sizes may differ).
        target: ``(...)`` global class ids or ``ignore_index``; or probabilities shaped like
            ``logits``: this rank's columns of them.
        group: the process group or a 1-D DeviceMesh (default: WORLD).
        vocab_start: this rank's first global column (on every rank, or on none).
        inplace_backward: write the gradient over this rank's logits (as Megatron does).
        check_ranks: as :func:`vocab_parallel_linear_cross_entropy` (one small exchange per
            call, so that every rank raises the same error).
        return_predicted_tokens: each token's argmax over all ranks' classes (global ids; one
            more all-gather, of int64 ``[N]``, only when asked). Class-id targets only.

    One all-gather of ``[N, 5]`` fp32 statistics forward, no collective backward: each rank's
    gradient is its logits'. Returns the loss (identical on all ranks), then the lse, the
    entropy, the accuracy and the predicted tokens when asked, as :func:`flce.cross_entropy`.
    """
    group, rank, world = _resolve_group(group)
    try:
        opts = _common.Options(ignore_index, reduction, label_smoothing, z_loss, softcap,
                               temperature)
        soft = _check_logits(logits, target, "logits")
        _common.check_flags(return_lse=return_lse, return_entropy=return_entropy,
                            return_accuracy=return_accuracy, inplace_backward=inplace_backward,
                            return_predicted_tokens=return_predicted_tokens)
        _check_vocab_start(vocab_start)
        _check_class_weight(class_weight)
        distribution = _check_distribution(target, soft, class_weight, opts, logits,
                                           return_accuracy=return_accuracy,
                                           return_predicted_tokens=return_predicted_tokens)
        if distribution and inplace_backward:
            raise ArgumentError("flce.parallel: inplace_backward=True takes class-index targets "
                                "without class weights and label smoothing together")
        lead = tuple(target.shape[:-1] if soft else target.shape)
        x = _local_rows(logits, math.prod(lead))
        _check_inplace(inplace_backward, x, logits, "logits")
        t = None if soft else target.reshape(-1).to(torch.int64)
        meta = _logits_meta(x, vocab_start, opts.ignore_index, opts.label_smoothing,
                            opts.z_loss, opts.softcap, reduction, opts.temperature, class_weight,
                            soft, return_predicted_tokens)
        error = None
    except Exception as e:  # (any type: see _raise_rank_errors)
        error, t, meta = e, None, None
    layout = _layout(group, rank, world, meta, False, check_ranks, error=error, target=t,
                     ignore_index=None if error else opts.ignore_index)
    if distribution:
        y = _local_rows(target, x.shape[0]) if soft else t
        row_weight = None if soft else _row_weights(class_weight, layout, t, opts.ignore_index)
        tensors = (x, y, _shard_class_weight(class_weight, layout, x.shape[1]), row_weight)
        loss, lse, _, entropy = _per_token(_distribution_ops(layout, opts, logits_level=True),
                                           tensors, group, world)
        return _common.distribution_outputs(loss, lse, entropy, t, opts, lead, row_weight,
                                            return_lse, return_entropy)
    options = (opts.ignore_index, opts.label_smoothing, opts.z_loss, opts.softcap,
               opts.temperature)
    row_weight = _row_weights(class_weight, layout, t, opts.ignore_index)
    family = _logits_ops(layout, options, bool(return_entropy), bool(inplace_backward))
    loss, lse, stats, entropy, *argmax = _per_token(family, (x, t), group, world,
                                                    predicted=return_predicted_tokens)
    return _common.outputs_from_stats(loss, lse, stats, entropy, t, opts, lead, row_weight,
                                      return_lse, return_entropy, return_accuracy,
                                      argmax[0] if argmax else None)


def _check_inplace(inplace, x, logits, name):
    """This rank's refusal of inplace_backward over x, the rows of logits (raised into the
    exchange)."""
    if inplace and torch.is_grad_enabled():
        _common.check_inplace_target(x, logits, name)


def _check_logits(logits, target, name):
    _common.check_tensor(name, logits)
    if logits.dtype not in _DTYPE_CODES:
        raise _common.DtypeError(f"flce: {name} must be float32, bfloat16 or float16, got "
                                 f"{logits.dtype}")
    if logits.dim() < 1:
        raise ArgumentError(f"flce: {name} must have shape (..., V_local), got a 0-d tensor")
    _common.check_tensor("target", target)
    soft = _common.is_soft(target)
    if soft:
        _common.check_soft_target(target, logits.shape, f"{name}'s shape: this shard's columns")
    else:
        _common.check_target(target, logits.shape[:-1], f"{name}'s leading dimensions")
    _check_local(logits, target if soft else None)
    return soft


def _logits_meta(x, vocab_start, ignore_index, smoothing, z_loss, softcap, reduction,
                 temperature, class_weight=None, soft=False, predicted=False):
    """The fields of _META_FIELDS that a logits-level call has (no D, bias or weight):
    x [N, V_local] this rank's rows."""
    code = _DTYPE_CODES[x.dtype]
    return [x.shape[1], -1 if vocab_start is None else vocab_start, -1, x.shape[0], 0, code,
            code, 0, ignore_index, _float_bits(smoothing), _float_bits(z_loss),
            _float_bits(softcap), _REDUCTION_CODES[reduction], 0, _float_bits(temperature), 0,
            _weights_meta(class_weight), int(soft), -1, 0, 1, 0, int(bool(predicted))]


def _weights_meta(class_weight):
    """The class weights' field of the exchange: their length, or -1 without them."""
    return -1 if class_weight is None else class_weight.numel()


def _check_class_weight(class_weight):
    """This rank's checks of replicated per-class weights (the whole vocabulary's, every rank
    the same); their length against the vocabulary comes after the exchange."""
    if class_weight is None:
        return
    _common.check_tensor("class_weight", class_weight)
    _common.check_class_weight_grad(class_weight)
    if class_weight.dim() != 1 or not class_weight.dtype.is_floating_point:
        raise ArgumentError(f"flce.parallel: class_weight must be a 1-D floating-point tensor "
                            f"(one weight per class of the whole vocabulary, the same on every "
                            f"rank), got {class_weight.dtype} {tuple(class_weight.shape)}")


def _shard_class_weight(class_weight, layout, rows):
    """This shard's classes' weights (fp32), or None: the whole vocabulary's weights after the
    exchange checked their length (_row_weights)."""
    if class_weight is None:
        return None
    if class_weight.numel() != layout.vocab_size:
        raise ArgumentError(f"flce.parallel: class_weight must have one weight per class of the "
                            f"vocabulary ({layout.vocab_size}), got {class_weight.numel()}")
    return class_weight.narrow(0, layout.vocab_start, rows).to(torch.float32).contiguous()


def _row_weights(class_weight, layout, t, ignore_index):
    """Each row's target weight (0 where ignored), after the exchange: every rank holds the
    same lengths, so all raise here or none does."""
    if class_weight is None:
        return None
    if class_weight.numel() != layout.vocab_size:
        raise ArgumentError(f"flce.parallel: class_weight must have one weight per class of the "
                            f"vocabulary ({layout.vocab_size}), got {class_weight.numel()}")
    return _common.class_weights(class_weight.to(t.device), layout.vocab_size, t, ignore_index,
                                 torch.float32)[1]


def _local_rows(logits, rows):
    """[rows, V_local] rows of the logits (a view where the layout allows one).
    (Not reshape(-1, V_local) nor logits[..., 0]: an empty shard must reach the exchange's checks
    on every rank.)"""
    x = logits.reshape(rows, logits.shape[-1])
    return x if x.stride(-1) == 1 or x.shape[1] <= 1 else x.contiguous()


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                 tp_group=None, *, vocab_start=None, inplace_backward=False):
    """Collapse-safe drop-in for Megatron-Core's ``vocab_parallel_cross_entropy``.

    Args:
        vocab_parallel_logits: ``[seq, batch, V / tp]`` (any leading shape) this rank's logit
            columns; equal shards in rank order (rank ``r`` holds ``[r V/tp, (r+1) V/tp)``), as
            in Megatron, unless ``vocab_start`` says otherwise. Read in their dtype (bf16 logits
            are not upcast to an fp32 copy); never modified unless ``inplace_backward``.
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
        inplace_backward: the backward writes the gradient over the logits' storage, as
            Megatron's own backward does (its logits are then gone).

    The ranks exchange their shapes and arguments in one small all-gather per call (as
    :func:`vocab_parallel_linear_cross_entropy`), so that every rank raises the same error.

    Returns:
        Per-token loss, float32, shape ``target.shape``.
    """
    group, rank, world = _resolve_group(tp_group)
    # This rank's own checks; their failure goes into the exchange, so that every rank raises it.
    try:
        if _check_logits(vocab_parallel_logits, target, "vocab_parallel_logits"):
            raise TypeError("flce.parallel: vocab_parallel_cross_entropy takes class ids (as "
                            "Megatron's); probability targets: flce.parallel.cross_entropy")
        smoothing = _common.number("label_smoothing", label_smoothing)
        if not 0.0 <= smoothing < 1.0:
            raise ArgumentError(f"flce: label_smoothing must be in [0, 1), got {label_smoothing}")
        _check_vocab_start(vocab_start)
        lead = target.shape
        logits = _local_rows(vocab_parallel_logits, target.numel())
        _check_inplace(inplace_backward, logits, vocab_parallel_logits, "vocab_parallel_logits")
        t = target.reshape(-1).to(torch.int64)
        meta = _logits_meta(logits, vocab_start, -100, smoothing, 0.0, 0.0, "none", 1.0)
        error = None
    except Exception as e:  # (any type: see _raise_rank_errors)
        error, t, meta = e, None, None
    layout = _layout(group, rank, world, meta, False, True, error=error, target=t)
    # Every rank holds the same sizes, so every rank raises here or none does.
    if 0 in layout.sizes:
        raise ArgumentError(f"flce.parallel: vocab_parallel_logits has an empty vocabulary shard: "
                            f"{list(layout.sizes)} columns (by rank)")
    if vocab_start is None and len(set(layout.sizes)) > 1:
        raise ArgumentError(f"flce.parallel: vocab_parallel_logits shards differ in size across "
                            f"ranks: {list(layout.sizes)} columns (by rank), but without "
                            f"vocab_start each rank's offset is rank * its own size (Megatron's "
                            f"equal shards); pass vocab_start= (this rank's first global column) "
                            f"on every rank")
    v = layout.vocab_size
    eps = smoothing * v / (v - 1) if smoothing > 0 and v > 1 else 0.0
    family = _logits_ops(layout, (-100, eps, 0.0, 0.0, 1.0), False, bool(inplace_backward))
    return _per_token(family, (logits, t), group, world)[0].reshape(lead)


def _class_columns(target, mesh, name):
    """This rank's classes of probability targets ``(..., C)`` whose classes are sharded over
    ``mesh`` as a DTensor classifier's (``torch.chunk`` of C, in rank order): a DTensor on the
    mesh (any placement) is redistributed to ``Shard(-1)``; a plain tensor is the whole
    distribution, the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(target, DTensor):
        if target.device_mesh != mesh:
            raise ArgumentError(f"flce: {name} is a DTensor on a different mesh than the "
                                f"classifier")
    else:
        target = DTensor.from_local(target, mesh, [Replicate()], run_check=False)
    if target.dim() < 1:
        raise ArgumentError(f"flce: probability targets {name} must have a class dimension, "
                            f"got a 0-d tensor")
    return target.redistribute(mesh, [Shard(target.dim() - 1)]).to_local()


def cross_entropy_dtensor(input, target, *, weight=None, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0,
                          return_lse=False, return_entropy=False, return_accuracy=False,
                          inplace_backward=False, return_predicted_tokens=False):
    """``flce.cross_entropy`` of a ``DTensor`` of logits sharded over the classes: ``(N, C)``
    with placements ``(Shard(1),)`` (or ``Shard(-1)``) on a 1-D mesh, as TorchTitan's
    ``loss_parallel`` hands the loss its ``pred.flatten(0, 1)``. ``target`` may be a plain
    tensor (the same on every rank) or a DTensor on the same mesh (class indices redistributed
    to ``Replicate``; probabilities ``(N, C)`` split over the classes as the logits are), and
    so may the class ``weight`` (redistributed to ``Replicate``). The loss comes back as a
    plain tensor, identical on all ranks; the logits' gradient is a DTensor with their
    placement."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = input.device_mesh
    if input.dim() != 2 or mesh.ndim != 1 or tuple(input.placements) not in ((Shard(1),),
                                                                               (Shard(-1),)):
        raise ArgumentError(f"flce: a DTensor input of cross_entropy must be (N, C) logits sharded "
                            f"over the classes, placements (Shard(1),) on a 1-D mesh; got shape "
                            f"{tuple(input.shape)}, {tuple(input.placements)} on a {mesh.ndim}-D "
                            f"mesh")
    if _common.is_soft(target):
        target = _class_columns(target, mesh, "target")
    elif isinstance(target, DTensor):
        if target.device_mesh != mesh:
            raise ArgumentError("flce: target is a DTensor on a different mesh than input")
        target = target.redistribute(mesh, [Replicate()]).to_local()
    if isinstance(weight, DTensor):
        # (torch's loss_parallel takes the class weights as a plain tensor or a DTensor)
        if weight.device_mesh != mesh:
            raise ArgumentError("flce: weight is a DTensor on a different mesh than input")
        weight = weight.redistribute(mesh, [Replicate()]).to_local()
    return cross_entropy(input.to_local(), target, group=mesh.get_group(),
                         ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                         temperature=temperature, return_lse=return_lse,
                         return_entropy=return_entropy, return_accuracy=return_accuracy,
                         class_weight=weight, inplace_backward=inplace_backward,
                         return_predicted_tokens=return_predicted_tokens)
