"""What the public entry points share: argument validation, option normalization, the choice of
path, and the reduction of per-token outputs.

``flce.api`` (one device), ``flce.parallel`` (vocab-parallel) and ``flce.logits`` (cross-entropy
on given logits) import from here; nothing here imports them.
"""
import collections
import math
import numbers
import os

import torch
import torch.autograd.forward_ad as _fwad

from . import _composite, _ops

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
REDUCTIONS = ("mean", "sum", "none")
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value. A ``ValueError``, and also the ``RuntimeError`` that torch raises
    for most of the same mistakes (``label_smoothing=1.2``, a target of the wrong shape, ...), so
    that code written against ``F.cross_entropy`` catches it as it is."""


class DtypeError(TypeError, NotImplementedError):
    """A tensor of a dtype flce does not take (integer logits, a bool target, ...). A
    ``TypeError``, and also what torch's ``F.cross_entropy`` raises for it: a
    ``NotImplementedError`` for the logits ("not implemented for 'Long'"), a ``RuntimeError``
    for the target ("expected target dtype to be Long or Byte"); NotImplementedError is a
    RuntimeError, so that code written against torch catches it as it is."""


class Options:
    """The loss options, validated and normalized to Python numbers (``softcap`` 0.0: none)."""

    __slots__ = ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap",
                 "temperature")

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                 softcap=None, temperature=1.0):
        self.ignore_index = index("ignore_index", ignore_index)
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ArgumentError(f"flce: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.label_smoothing = number("label_smoothing", label_smoothing)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ArgumentError(f"flce: label_smoothing must be in [0, 1], got {label_smoothing}")
        # Written so that NaN fails too; inf would silently turn every loss into NaN or inf.
        self.z_loss = number("z_loss", z_loss)
        if not 0 <= self.z_loss < math.inf:
            raise ArgumentError(f"flce: z_loss must be a finite number >= 0, got {z_loss}")
        self.softcap = 0.0 if softcap is None else number("softcap", softcap)
        if softcap is not None and not 0 < self.softcap < math.inf:
            raise ArgumentError(f"flce: softcap must be a positive finite number or None, got "
                                f"{softcap}")
        self.temperature = number("temperature", temperature)
        if not 0 < self.temperature < math.inf:
            raise ArgumentError(f"flce: temperature must be a positive finite number, got "
                                f"{temperature!r}")

    def op_args(self):
        """(ignore_index, label_smoothing, z_loss, softcap) as the flce:: ops take them."""
        return self.ignore_index, self.label_smoothing, self.z_loss, self.softcap


def number(name, value):
    """A real scalar option as a Python float: an int or float (numpy scalars too), or a 0-d real
    tensor that does not require grad (read once, a host sync for a CUDA tensor). Booleans,
    strings and tensors that require grad are refused: flce does not differentiate with respect
    to its options."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not (value.is_floating_point() or value.dtype in (
                torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
            raise TypeError(f"flce: {name} must be a number or a 0-d real tensor, got a tensor "
                            f"of shape {tuple(value.shape)} and dtype {value.dtype}")
        if value.requires_grad:
            raise TypeError(f"flce: {name} is a tensor that requires grad, but flce does not "
                            f"differentiate with respect to {name}; pass a number, e.g. "
                            f"float({name}.detach())")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"flce: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def index(name, value):
    """A class index option (``ignore_index``) as a Python int; None means -100, as in torch.
    Floats are refused (torch raises too): a truncated 1.5 would silently disagree with the
    mean's count of ignored rows."""
    if value is None:
        return -100
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"flce: {name} must be an int or None, got {type(value).__name__} "
                        f"{value!r}")
    value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ArgumentError(f"flce: {name} must fit in int64 (the targets' dtype), got {value}")
    return value


def check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flce: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_flags(**flags):
    """TypeError for a flag that is not True or False (a string such as 'no' would be truthy)."""
    for name, flag in flags.items():
        if flag not in (True, False):
            raise TypeError(f"flce: {name} must be True or False, got {flag!r}")


def unbatched_target(input, target):
    """A 1-D input (one token) takes its class id as a 0-d target, or, as torch takes it, a
    ``(1,)`` one (the result is 0-d either way)."""
    if isinstance(input, torch.Tensor) and input.dim() == 1 and \
            isinstance(target, torch.Tensor) and not is_soft(target) and \
            tuple(target.shape) == (1,):
        return target.reshape(())
    return target


def check_soft_ignore_index(ignore_index):
    """Probability targets have no ignored rows: an ignore_index that could name a class (>= 0)
    is refused, as torch's F.cross_entropy refuses it, rather than silently left unused; a
    negative one names none and is accepted, as torch accepts it."""
    if ignore_index is not None and ignore_index >= 0:
        raise ArgumentError(f"flce: ignore_index is not supported with probability targets, got "
                            f"ignore_index={ignore_index} (as torch's F.cross_entropy)")


def is_soft(target):
    """Probability (soft) targets: a floating-point target tensor."""
    return isinstance(target, torch.Tensor) and target.dtype.is_floating_point


def check_soft_target(target, shape, name, class_shape=None):
    """Probability targets: float32, bfloat16, float16 or float64, shaped like ``shape``;
    ``class_shape``: what class-index targets would be shaped like, named in the error when a
    floating target has it (class ids cast to float by mistake)."""
    if target.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"flce: probability targets must be float32, bfloat16, float16 or "
                        f"float64, got {target.dtype}")
    if tuple(target.shape) != tuple(shape):
        hint = ""
        if class_shape is not None and tuple(target.shape) == tuple(class_shape):
            hint = (f"; a floating target shaped like class indices ({target.dtype}): class "
                    f"indices must be an integer tensor (target.long())")
        raise ArgumentError(f"flce: probability targets must have shape {tuple(shape)} ({name}), "
                            f"got {tuple(target.shape)}{hint}")


def soft_class_weights(weight, c, dtype):
    """Per-class weights for probability targets, cast to the computation dtype, or None."""
    return None if weight is None else _cast_class_weights(weight, c, dtype)


def reduce_rows(loss, reduction, shape):
    """Reduce per-row losses over every row (probability targets: torch's ``"mean"`` divides by
    the number of rows, with class weights too)."""
    if reduction == "none":
        return loss.reshape(shape)
    return loss.sum() if reduction == "sum" else loss.sum() / loss.shape[0]


def check_target(target, lead, lead_name, hint=""):
    """Class-index targets shaped like ``lead`` (``hint``: appended to a shape error)."""
    check_tensor("target", target)
    if target.dtype.is_complex:
        raise DtypeError(f"flce: target must hold class indices (an integer tensor) or "
                        f"probabilities (a floating tensor), got {target.dtype}")
    if target.dtype == torch.bool:
        raise DtypeError("flce: target must hold class indices (an integer tensor), got "
                        "torch.bool")
    if tuple(target.shape) != tuple(lead):
        raise ArgumentError(f"flce: target must have shape {tuple(lead)} ({lead_name}), got "
                            f"{tuple(target.shape)}{hint}")


def check_inplace_target(logits, input, name):
    """``inplace_backward=True`` writes the gradient over the storage of ``logits`` ``[rows, C]``
    with a unit column stride (``input``'s rows, or a copy of them): refused where that would be
    silently wrong rather than merely overwrite what the caller gave up. Called only where the
    in-place backward will run (gradients enabled, the fused ops). The backward also bumps the
    logits' version counter (``increment_version``), so that anything else that saved them (a
    softcap's tanh, a second loss, a retained graph's second backward) raises torch's "modified
    by an inplace operation" error instead of reading the gradient as logits. Sizes and strides
    only: torch.compile traces it."""
    if not logits.requires_grad:
        return  # no backward, nothing written
    root = input if input._base is None else input._base
    if root.is_leaf:
        raise ArgumentError(f"flce: inplace_backward=True would write the gradient over {name}, "
                            f"which is {'a view of ' if input._base is not None else ''}a leaf "
                            f"tensor that requires grad (its data would become its gradient); "
                            f"pass inplace_backward=False")
    # (unit column stride: rows overlap where one row's stride is shorter than a row, a stride
    # of 0 included, for one column too)
    rows, c = logits.shape
    if rows > 1 and abs(logits.stride(0)) < c:
        raise ArgumentError(f"flce: inplace_backward=True needs {name} whose elements do not share "
                            f"memory (an expand()ed or broadcast view would sum several rows' "
                            f"gradients into one); pass inplace_backward=False")


def _cast_class_weights(weight, c, dtype):
    """Per-class weights ``(c,)``, checked, in the computation dtype (float64 for float64 inputs,
    else float32)."""
    check_tensor("weight", weight)
    check_class_weight_grad(weight)
    if tuple(weight.shape) != (c,) or not weight.dtype.is_floating_point:
        raise ArgumentError(f"flce: weight must be a floating-point tensor of shape ({c},) "
                            f"(per-class weights, one per class), got {weight.dtype} "
                            f"{tuple(weight.shape)}")
    return weight.to(torch.float64 if dtype == torch.float64 else torch.float32)


def class_weights(weight, c, target, ignore_index, dtype):
    """Per-class weights as torch takes them: ``(weight cast to the computation dtype, each row's
    target weight (0 where ignored))``; ``(None, None)`` without weights."""
    if weight is None:
        return None, None
    w = _cast_class_weights(weight, c, dtype)
    valid = target != ignore_index
    if c == 0:  # (no class to index: every valid target is out of range, which is raised later)
        return w, torch.zeros(target.shape, dtype=w.dtype, device=w.device)
    row = torch.where(valid, w[torch.where(valid, target, 0).clamp(0, c - 1)], 0.0)
    return w, row


def check_target_range(target, c, ignore_index):
    """IndexError for a class target outside ``[0, c)`` that is not ``ignore_index``, where torch
    ops compute the loss (the composite path), as the fused ops raise it: at once on the CPU, on
    CUDA without a host sync (flce::check_target). Under a functorch transform the check reads
    the tensor beneath the wrappers (every batch's targets under vmap)."""
    if not torch.compiler.is_compiling():
        while torch._C._functorch.is_functorch_wrapped_tensor(target):
            target = torch._C._functorch.get_unwrapped(target)
    if target.numel():
        _ops.ops.check_target(target, c, ignore_index)


def check_class_weight_grad(weight):
    """Per-class weights are constants of the loss, as in torch's F.cross_entropy (which refuses
    them too): their gradient is not computed, and a weight that requires grad would otherwise
    get None or a partial one."""
    if weight.requires_grad and torch.is_grad_enabled():
        raise ArgumentError("flce: the per-class weights (weight / class_weight) are not "
                            "differentiable, as in torch's F.cross_entropy; pass them detached")


def check_one_device(named):
    for n, t in named:
        if t is not None:
            check_tensor(n, t)
    devices = {(n, t.device) for n, t in named if t is not None}
    if len({d for _, d in devices}) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in sorted(devices, key=lambda x: x[0]))
        raise ArgumentError(f"flce: all tensors must be on one device, got {listing}")


def check_classifier_shapes(x, w, names=("input", "weight")):
    """Hidden states ``(..., D)`` and a classifier ``(V, D)`` as nn.Linear stores it."""
    xn, wn = names
    check_tensor(xn, x)
    check_tensor(wn, w)
    if x.dim() < 1:
        raise ArgumentError(f"flce: {xn} must have shape (..., D), got a 0-d tensor")
    if w.dim() != 2:
        k_dim = "; torch's K-dimensional classifier is not supported" if wn == "weight" else ""
        raise ArgumentError(f"flce: {wn} must have shape (V, D), got {tuple(w.shape)}{k_dim}")
    if x.shape[-1] != w.shape[1]:
        hint = (f"; {wn} looks transposed: flce takes it as nn.Linear stores it, (V, D) "
                f"(lm_head.weight, not lm_head.weight.T)"
                if x.shape[-1] == w.shape[0] else "")
        raise ArgumentError(f"flce: {xn}'s last dimension ({x.shape[-1]}) must equal {wn}'s "
                            f"D ({w.shape[1]}); {xn} {tuple(x.shape)}, {wn} "
                            f"{tuple(w.shape)}{hint}")


def check_classifier_dtypes(x, w, b, names=("input", "weight", "bias")):
    """The compute dtype of ``x``, ``w`` in it or fp32 master weights, ``b`` ``(V,)`` in
    ``w``'s dtype."""
    xn, wn, bn = names
    if x.dtype not in FLOAT_DTYPES:
        raise DtypeError(f"flce: {xn} must be float32, bfloat16, float16 or float64, got "
                         f"{x.dtype}")
    if w.dtype not in (x.dtype, torch.float32):
        raise DtypeError(f"flce: {wn} must have {xn}'s dtype ({x.dtype}) or be float32 "
                         f"master weights, got {w.dtype}")
    if b is not None:
        check_tensor(bn, b)
        if tuple(b.shape) != (w.shape[0],):
            raise ArgumentError(f"flce: {bn} must have shape ({w.shape[0]},), got "
                                f"{tuple(b.shape)}")
        if b.dtype != w.dtype:
            raise DtypeError(f"flce: {bn} must have {wn}'s dtype ({w.dtype}), got {b.dtype}")


def validate_linear(input, weight, target, bias):
    """The tensors of a linear cross-entropy call (options: :class:`Options`)."""
    check_classifier_shapes(input, weight)
    lead = tuple(input.shape[:-1])
    extra = len(lead) + (1 if is_soft(target) else 0)  # a probability target's V
    if isinstance(target, torch.Tensor) and target.dim() > extra and \
            tuple(target.shape[:len(lead)]) == lead:
        raise ArgumentError(f"flce: target {tuple(target.shape)} has dimensions beyond input's "
                            f"leading ones {lead}: torch's K-dimensional classifier "
                            f"(out_features) is not supported")
    if is_soft(target):
        check_soft_target(target, lead + (weight.shape[0],), "input's leading dimensions, then V",
                          class_shape=lead)
    else:
        check_target(target, lead, "input's leading dimensions")
    check_classifier_dtypes(input, weight, bias)
    check_one_device((("input", input), ("weight", weight), ("target", target), ("bias", bias)))


def needs_composite(*tensors):
    """Whether the call must take the differentiable composite path (flce._composite) instead
    of the fused ops: float64 inputs (no float64 kernels), or a caller that sees through the
    op with a functorch transform (torch.func.grad, vmap, jvp, ...) or forward-mode AD, which
    the fused ops' autograd formulas do not serve."""
    present = [t for t in tensors if t is not None]
    if any(t.dtype == torch.float64 for t in present):
        return True
    if torch.compiler.is_compiling():
        # (dynamo cannot trace the probes below; a compiled region sees plain tensors)
        return False
    for t in present:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
        if _fwad._current_level >= 0 and _fwad.unpack_dual(t).tangent is not None:
            return True
    return False


_THREADS = [torch.get_num_threads()]


def _threads():
    # torch.get_num_threads() would break a torch.compile graph: a compiled call sees the count
    # of the last eager call (or of the import).
    if not torch.compiler.is_compiling():
        _THREADS[0] = torch.get_num_threads()
    return _THREADS[0]


def cpu_single_pass_bytes(n, v, d, dtype, threads=None):
    """The CPU single pass's memory beyond the gradients (docs/cpu-backend.md): dW's bf16
    compensation, a block of rows' logits and, for 16-bit inputs, the gradients in fp32 from
    the forward to the backward (scale_grad writes the 16-bit gradients beside them; fp32 ones
    are scaled in place and are the gradients) and the weight tiles packed for two GEMMs
    (onednn; an upper bound on the blas path). tests/cpu/test_cpu_memory.py holds the measured
    growth to it."""
    # The row-block logits: tiles of CPU_WIDE_TILE columns for at most CPU_FUSED_ROWS rows and
    # N rounded up to 16, within a workspace bound (the sizes: csrc/cpu/single_pass.h, read
    # through _ops; the rows: flce_cpu.cpp, fused_block_rows).
    t = threads or _threads()
    tiles = -(-v // _ops.CPU_WIDE_TILE)
    rows = min(_ops.CPU_FUSED_ROWS, -(-max(n, 1) // 16) * 16)
    cap = _ops.CPU_FUSED_WORKSPACE if dtype == torch.float32 else _ops.CPU_FUSED_WORKSPACE_16
    logits = min(cap, rows * (tiles + t) * (_ops.CPU_WIDE_TILE + _ops.CPU_TILE_PAD) * 4)
    sixteen = (n + v) * d * 4 + 4 * v * d if dtype != torch.float32 else 0
    return v * d * 2 + logits + sixteen


def cpu_memory_budget(n, v):
    """The memory the CPU's default training path may hold beyond the gradients:
    FLCE_CPU_MEMORY_MB when set, else half an fp32 [N, V] buffer (eager holds about three of
    them: the logits, their fp32 copy or log-softmax, and their gradient)."""
    mb = os.environ.get("FLCE_CPU_MEMORY_MB", "")
    if mb:
        try:
            value = float(mb)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ArgumentError(f"flce: FLCE_CPU_MEMORY_MB must be a number of MB >= 0, got {mb!r}")
        return value * 2 ** 20
    return 2 * n * v


Plan = collections.namedtuple("Plan", ("composite", "distribution", "single_pass"))
Plan.__doc__ = """How one call runs: ``composite`` (flce._composite, differentiable torch ops),
else the fused ops, as a target ``distribution`` (flce::soft_*) or on class ids, by the
``single_pass`` (loss and gradients in the forward: flce::sum_and_grad, soft_sum_and_grad) or
the forward and a recomputing backward."""


def plan(x, params=(), others=(), *, classes, distribution=False, row_weight=False,
         single_pass=None, reduction="mean", per_token=False, argmax=False,
         target_grad=False, inplace=False, linear=True, shards=None):
    """The path of a call, for every entry point (flce.api, flce.parallel): the semantic choice
    is made here and nowhere else; the backends decide only their resource fallbacks (the CUDA
    chunk sizes, the CPU's row blocks).

    x: the rows the op reads ([N, D] hidden states, or [N, C] logits where not ``linear``);
    params: the other tensors that may need gradients (weight, bias); others: further tensors
    read (probability targets, class weights); classes: V (or C). distribution: probability
    targets, or class weights with label smoothing; row_weight: the rows carry their target's
    class weight; per_token: per-token outputs are asked for (the single pass returns the loss
    alone); argmax: an output of the logits' argmax (the accuracy, the predicted tokens), which
    the target distributions' ops do not keep; target_grad: the probability targets need a
    gradient; inplace: cross_entropy's inplace_backward; shards: the number of vocabulary
    shards, for flce.parallel (whose checks have refused what the composite path alone serves,
    and whose ranks must choose alike: an empty shard included; its target distributions have
    no single pass)."""
    composite = shards is None and (
        0 in (x.shape[-1], classes) or needs_composite(x, *params, *others) or
        (distribution and (argmax or target_grad or inplace or not fused_distribution(x))))
    training = torch.is_grad_enabled() and \
        any(t is not None and t.requires_grad for t in (x,) + tuple(params))
    single = False
    if linear and training and not composite and not (row_weight and not distribution) and \
            not (distribution and (shards is not None or _ops.is_cuda_backend(x))):
        # (one device's CPU choice depends on the classifier's shape; several shards' choice is
        # the CUDA rule, made alike on every rank)
        weight = params[0] if (shards or 1) == 1 and params else None
        single = _single_pass_rule(single_pass, reduction, per_token, x, weight)
        if single and (shards or 1) > 1 and not _ops.is_cuda_backend(x):
            if single_pass:
                raise ArgumentError("flce.parallel: single_pass=True over several ranks needs "
                                    "the CUDA backend (the CPU backend's single pass is "
                                    "single-device)")
            single = False
    return Plan(composite, distribution and not composite, single)


def _single_pass_rule(requested, reduction, per_token, x, weight=None):
    """Whether the loss and its gradients come from the single pass (flce::sum_and_grad);
    per_token: lse or entropy outputs are asked for (the single pass returns the loss alone)."""
    if requested is None:
        # fp16 stays on the recompute path: its gradient tile needs a scale that depends on
        # every row's statistics, which the single pass has only row chunk by row chunk.
        if reduction == "none" or per_token or x.dtype == torch.float16:
            return False
        if _ops.is_cuda_backend(x):
            return True
        # The CPU: the fastest exact path within a memory budget (docs/cpu-backend.md). The
        # single pass saves the recompute's logit GEMM but holds dW's compensation for all of V
        # (and 16-bit inputs' gradients in fp32), O(V D) memory where the recompute path's is
        # O(min(N, V) D): it is the default while that stays within cpu_memory_budget. Where
        # bf16 GEMMs run on AMX the logit GEMM is cheap and the single pass's streaming of dW's
        # accumulators costs more than it saves: bf16 keeps the recompute path there, whichever
        # way its tiles are rounded (cpu::bf16_grad).
        if x.dtype == torch.bfloat16 and _ops.CPU_BF16_AMX:
            return False
        if weight is None:
            return False
        n, d = x.shape
        v = weight.shape[0]
        return cpu_single_pass_bytes(n, v, d, x.dtype) <= cpu_memory_budget(n, v)
    check_single_pass(requested, reduction, per_token)
    return requested


def exact_bf16_grad(value, x=None):
    """An exact_bf16_grad argument as the ops take it: None (the backend's default), True or
    False. True for bf16 ``x`` needs the CPU backend: the CUDA backend rounds the gradient tile
    once and has no exact mode (ops_def.h)."""
    if value not in (None, True, False):
        raise TypeError(f"flce: exact_bf16_grad must be None, True or False, got {value!r}")
    value = None if value is None else bool(value)
    if value and x is not None and x.dtype == torch.bfloat16 and _ops.is_cuda_backend(x):
        raise ArgumentError("flce: exact_bf16_grad=True: the CUDA backend rounds bf16 gradient "
                            "tiles once (dE and dW within 1.5x bf16's rounding floor) and has "
                            "no exact mode; pass None or False")
    return value


# FLCE_CUDA_OPT_IN's names: the CUDA backend's paths that have not run on a GPU yet, each opt-in
# until a GPU record (docs/environment.md). "fp64_grad" is read by csrc/cuda/accumulate.cpp.
CUDA_OPT_IN = ("fp64_grad", "distributions", "distill")


def cuda_opt_in(name):
    """Whether FLCE_CUDA_OPT_IN (read at every call: a comma-separated list of CUDA_OPT_IN's
    names) lists ``name``; any other name in it raises ValueError."""
    listed = [n.strip() for n in os.environ.get("FLCE_CUDA_OPT_IN", "").split(",")]
    for n in listed:
        if n and n not in CUDA_OPT_IN:
            raise ValueError(f"flce: FLCE_CUDA_OPT_IN is a comma-separated list of "
                             f"{', '.join(CUDA_OPT_IN)}; got {n!r}")
    return name in listed


def fused_distribution(x):
    """Whether the fused target-distribution ops (flce::soft_forward: probability targets, class
    weights with label smoothing) serve ``x``'s backend: the CPU backend, and the CUDA backend
    with FLCE_CUDA_OPT_IN=distributions (opt-in until its kernels have run on a GPU,
    docs/cuda.md "Target distributions"). Otherwise the CUDA backend takes the composite path
    for them."""
    return not _ops.is_cuda_backend(x) or cuda_opt_in("distributions")


def check_single_pass(requested, reduction, per_token):
    """A single_pass argument that the options allow (None: flce's choice)."""
    if requested is None:
        return
    if requested not in (True, False):
        raise TypeError(f"flce: single_pass must be None, True or False, got {requested!r}")
    if requested and (reduction == "none" or per_token):
        raise ArgumentError("flce: single_pass=True needs reduction 'mean' or 'sum' and none of "
                            "return_lse, return_entropy, return_accuracy, return_z_loss, "
                            "return_predicted_tokens (nor "
                            "z_loss_weighting='none' beside class weights or probability "
                            "targets: each needs the per-token lse; the single pass returns the "
                            f"loss alone); got reduction={reduction!r}, per-token outputs asked: "
                            f"{bool(per_token)}")


_OUTPUT_FIELDS = ("loss", "lse", "entropy", "accuracy", "z_loss", "predicted_tokens")


def _output_types():
    """One NamedTuple class per set of outputs (the loss and any of the others), made here
    rather than on demand: torch.compile traces named_output, not a class's creation. Each is
    printed as ``CrossEntropyOutput`` and importable from this module (the results pickle)."""
    types = {}
    rest = _OUTPUT_FIELDS[1:]
    for mask in range(1, 2 ** len(rest)):
        names = ("loss",) + tuple(f for i, f in enumerate(rest) if mask >> i & 1)
        cls = collections.namedtuple("CrossEntropyOutput", names)
        cls.__qualname__ = "_CrossEntropyOutput_" + "_".join(names[1:])
        cls.__module__ = __name__
        globals()[cls.__qualname__] = cls
        types[names] = cls
    return types


_OUTPUT_TYPES = _output_types()


def named_output(**fields):
    """The entry points' result where more than the loss is returned: a NamedTuple of the
    outputs asked for, in ``_OUTPUT_FIELDS`` order, the loss first (tuple unpacking keeps
    working; ``out.lse`` names them); the loss alone where nothing else is asked for."""
    names = tuple(f for f in _OUTPUT_FIELDS if f in fields)
    if names == ("loss",):
        return fields["loss"]
    return _OUTPUT_TYPES[names](*(fields[f] for f in names))


def per_token_outputs(loss, lse, entropy, lead, return_lse, return_entropy, accuracy=None,
                      predicted=None):
    """``loss`` alone, or ``(loss, [lse], [entropy], [accuracy], [predicted_tokens])`` shaped
    like the target (``accuracy``: already reduced as the loss, or None when not asked for;
    ``predicted``: per row, or None), named (named_output)."""
    out = {"loss": loss}
    if return_lse:
        out["lse"] = lse.reshape(lead)
    if return_entropy:
        out["entropy"] = entropy.reshape(lead)
    if accuracy is not None:
        out["accuracy"] = accuracy
    if predicted is not None:
        out["predicted_tokens"] = predicted.reshape(lead)
    return named_output(**out)


Z_LOSS_WEIGHTING = ("target", "none")


def z_loss_weighting(value):
    if value not in Z_LOSS_WEIGHTING:
        raise ArgumentError(f"flce: z_loss_weighting must be 'target' or 'none', got {value!r}")
    return value


def row_mass(target, class_weight, opts):
    """Each row's target mass Y = sum_c y_c, the weight of its z-loss under the "target" rule
    (float32 [rows]): class ids ``target [rows]``: the target's class weight (1 without them), 0
    where ignored; probabilities ``target [rows, V]``: ``sum_c w_c ((1 - eps) q_c + eps / V)``."""
    if is_soft(target):
        eps = opts.label_smoothing
        q = target.detach().float()
        if class_weight is None:
            return (1 - eps) * q.sum(1) + eps
        cw = class_weight.detach().float()
        return (1 - eps) * (q @ cw) + eps * cw.sum() / max(q.shape[1], 1)
    valid = target != opts.ignore_index
    if class_weight is None:
        return valid.float()
    return torch.where(valid, class_weight.detach().float()[torch.where(valid, target, 0)], 0.0)


def z_loss_output(lse, zw, reduce):
    """return_z_loss: the z-loss terms ``z_loss lse^2 zw`` of the rows (the z-loss coefficient
    already in ``zw``; 0 where zw is, also at an infinite lse), reduced as the loss is
    (``reduce``); detached: a value to log, as Liger's."""
    with torch.no_grad():
        lse = lse.reshape(-1).float()
        return reduce(torch.where(zw == 0, 0.0, zw * lse * lse))


def shift_amount(shift):
    """``shift`` as a number of positions: False 0, True 1 (causal LM), an int k >= 0 the
    target k positions ahead (Cut Cross Entropy's ``shift``)."""
    if isinstance(shift, bool):
        return int(shift)
    if isinstance(shift, numbers.Integral) and not isinstance(shift, torch.Tensor):
        if shift < 0:
            raise ArgumentError(f"flce: shift must be True, False or an int >= 0, got {shift}")
        return int(shift)
    raise TypeError(f"flce: shift must be True, False or an int >= 0, got {shift!r}")


def unshift(out, k, reduction):
    """An entry point's result with ``shift=k``: its per-token outputs (lse, entropy, predicted
    tokens, and with ``reduction="none"`` the loss and accuracy) without the last k positions,
    which have no target: ``(..., T - k)``, as Cut Cross Entropy returns them."""
    if not k:
        return out

    def cut(name, x):
        per_token = name in ("lse", "entropy", "predicted_tokens") or reduction == "none"
        return x[..., :max(0, x.shape[-1] - k)] if per_token else x

    if isinstance(out, torch.Tensor):
        return cut("loss", out)
    return named_output(**{f: cut(f, x) for f, x in zip(out._fields, out)})


def outputs_from_stats(loss, lse, stats, entropy, target, opts, lead, row_weight, return_lse,
                       return_entropy, return_accuracy, argmax=None):
    """An entry point's return value from an op's per-token ``(loss, lse, stats, entropy)``:
    the loss times ``row_weight`` (per-class weights, or None) and reduced as
    ``opts.reduction``, then the per-token outputs asked for (per_token_outputs), the accuracy
    from the row statistics, the predicted tokens from them and ``argmax`` (the ``*_argmax``
    ops' column of each row's largest non-target logit; None: not asked for)."""
    if row_weight is not None:
        loss = loss * row_weight
    acc = accuracy_from_stats(stats, target, opts.ignore_index) if return_accuracy else None
    return per_token_outputs(
        reduce_loss(loss, target, opts.ignore_index, opts.reduction, lead, row_weight), lse,
        entropy, lead, return_lse, return_entropy,
        reduce_accuracy(acc, target, opts.ignore_index, opts.reduction, lead, return_accuracy),
        None if argmax is None else predicted_from_stats(stats, argmax, target,
                                                         opts.ignore_index))


def distribution_outputs(loss, lse, entropy, target, opts, lead, row_weight, return_lse,
                         return_entropy):
    """An entry point's return value from a target distribution's per-token outputs (flce::soft_*):
    probability targets (``target`` None or floating) reduced over every row, class targets as
    torch weights them (``row_weight``), an ignored token's entropy 0 as on the class-target
    path."""
    if target is None or target.dtype.is_floating_point:
        loss = reduce_rows(loss, opts.reduction, lead)
    else:
        if return_entropy:
            entropy = torch.where(target != opts.ignore_index, entropy, 0.0)
        loss = reduce_loss(loss, target, opts.ignore_index, opts.reduction, lead, row_weight)
    return per_token_outputs(loss, lse, entropy, lead, return_lse, return_entropy)


def shift_target(target, ignore_index, k=1):
    """Causal-LM labels shifted inside the loss: the token at position i of a sequence is scored
    against ``target[..., i + k]`` and the last k positions are ignored (unshift drops them
    from the per-token outputs). The hidden states are used as they are (no ``[..., :-k, :]``
    copy of them; the last positions' logits cost k tokens in T). ``target``: ``(..., T)``."""
    if target.dim() == 0:
        raise ArgumentError("flce: shift=True needs target of shape (..., T), got a 0-d tensor")
    k = min(k, target.shape[-1])
    end = target.new_full(tuple(target.shape[:-1]) + (k,), ignore_index)
    return torch.cat([target[..., k:], end], dim=-1)


def accuracy_from_stats(stats, target, ignore_index):
    """The per-token accuracy (_composite.token_accuracy) from the row statistics (m_x, s_x,
    z_t, u_x): m_x is the largest non-target logit, and a NaN logit makes s_x or z_t NaN."""
    return _composite.token_accuracy(stats[:, 2], stats[:, 0], target, ignore_index,
                                     torch.isnan(stats[:, 1]) | torch.isnan(stats[:, 2]))


def predicted_from_stats(stats, argmax, target, ignore_index):
    """return_predicted_tokens from the row statistics (m_x, s_x, z_t, u_x) and ``argmax``, the
    ``*_argmax`` ops' column of m_x (the largest non-target logit, the first of equals; -1: no
    non-target column; -2: a NaN non-target logit): the argmax of the row's logits with
    torch.argmax's ties, the lowest column (the target where z_t > m_x, the lower of the two
    columns where z_t = m_x, +inf included); -1 for ignored tokens and rows with a NaN logit."""
    z_t, m_x = stats[:, 2], stats[:, 0]
    tie = torch.where(argmax < 0, target, torch.minimum(target, argmax))
    pred = torch.where(z_t > m_x, target, torch.where(z_t == m_x, tie, argmax))
    bad = (target == ignore_index) | torch.isnan(z_t) | (argmax == -2)
    return torch.where(bad, -1, pred)


def reduce_accuracy(accuracy, target, ignore_index, reduction, shape, wanted):
    """The accuracy output reduced as the loss is (``"mean"``: the fraction of non-ignored
    tokens whose argmax is the target; ``"sum"``: their count; ``"none"``: per token), or None
    when not ``wanted``."""
    if not wanted:
        return None
    return reduce_loss(accuracy, target, ignore_index, reduction, shape)


def reduce_loss(loss, target, ignore_index, reduction, shape, row_weight=None):
    """Reduce per-token losses as torch does, without host syncs: ``"mean"`` over non-ignored
    tokens, or with per-row weights (torch's per-class ``weight``) their weighted mean."""
    if reduction == "none":
        return loss.reshape(shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    if row_weight is not None:
        # Where every counted token's target weighs 0, torch's mean is 0/0 = NaN, and so are its
        # gradients; label smoothing's terms keep the sum above 0 there (total / 0 was inf).
        weights = row_weight.sum()
        return total / torch.where(weights == 0, math.nan, weights)
    return total / (target != ignore_index).sum()


def is_dtensor(t):
    # By name: importing torch.distributed.tensor here would slow down `import flce`.
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")
