"""Fake (meta) kernels and autograd for the flce::* ops declared in csrc/ops_def.h.

``register(namespace, cuda_format)`` attaches them to a namespace with those schemas: ``flce``
(the library), and in the tests ``flce_cuda_host``, the CUDA binding built against the host
emulation of its kernels (tests/cuda_emulation.py). ``ops`` is the namespace the API calls.
"""
import torch
from torch.fx.node import has_side_effect

from . import _C  # noqa: F401  (registers torch.ops.flce.*)
from . import _composite

ops = torch.ops.flce

# Whether the CPU backend's bf16 tile GEMMs run on AMX (cpuid and the environment, read once):
# flce/api.py's default training path for bf16 on the CPU depends on it.
CPU_BF16_AMX = bool(torch.ops.flce.cpu_bf16_amx())
# The CPU single pass's logit sizes (csrc/cpu/single_pass.h): rows per block, the logits' bytes
# for fp32 and for 16-bit inputs, columns per tile, tile row padding (floats).
(CPU_FUSED_ROWS, CPU_FUSED_WORKSPACE, CPU_FUSED_WORKSPACE_16, CPU_WIDE_TILE,
 CPU_TILE_PAD) = (int(x) for x in torch.ops.flce.cpu_single_pass_layout())

# Row layouts of the ops (csrc/include/flce/layout.h): partials (m, s, z_t, sum_z, u), stats
# (m_x, s_x, z_t, u_x), a target distribution's state (m_x, s_x, p, u_x, y_a, y_rest, g).
PARTIAL_COLS, STATS_COLS, SOFT_COLS = (int(x) for x in torch.ops.flce.row_layout())


def is_cuda_backend(t):
    """Whether ``t`` is served by the CUDA backend (a CUDA tensor): the path choices that
    depend on the backend ask this."""
    return t.device.type == "cuda"


def refuse_double_backward(what, remedy):
    """A backward that computes its gradients in the forward (or with collectives) cannot make
    them differentiable: under create_graph=True it says so instead of returning gradients
    that autograd would treat as constants (a silently wrong double backward)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"flce: double backward (a backward with create_graph=True, "
                           f"torch.autograd.functional.hessian, ...) is not supported through "
                           f"{what}; {remedy} computes differentiable gradients")


def can_write_in_place(logits):
    """Whether the in-place logits backward (logits_backward_) may run: not in a graph traced
    with symbolic shapes, where inductor's decompose_auto_functionalized pass fails on the
    mutating op ("graph node count mismatch", torch 2.14); such a graph takes the functional
    logits_backward (the gradient in a buffer of its own)."""
    return not any(isinstance(s, torch.SymInt) for s in logits.shape)


def _grad_like(t, wanted, dtype=None):
    """The gradient of ``t`` as a backward op returns it, or its placeholder ``[0]`` in ``t``'s
    dtype where it is not asked for (every backend's: the input's for dE, the weight's for dW and
    the bias', which has the weight's dtype)."""
    if not wanted:
        return t.new_empty((0,))
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def _soft_outputs(rows):
    """soft_forward's outputs for the rows of ``rows``: loss, lse [N], stats [N, SOFT_COLS] fp32,
    pivot [N] int64, entropy [N]."""
    n = rows.shape[0]
    f32 = dict(dtype=torch.float32)
    return (rows.new_empty((n,), **f32), rows.new_empty((n,), **f32),
            rows.new_empty((n, SOFT_COLS), **f32), rows.new_empty((n,), dtype=torch.int64),
            rows.new_empty((n,), **f32))


def scale_deferred(nsops, ctx, grad_loss, divisor, deferred, dtypes, needed):
    """The single pass's gradients (grad_input, grad_weight, grad_bias) from its deferred ones
    (ops_def.h sum_and_grad) and the upstream gradient of its loss: each in ``dtypes``' dtype,
    None where ``needed`` says so. A deferred gradient already in its dtype is scaled in place
    and returned as it is (``ctx.consumed``: a second backward through the graph raises)."""
    if getattr(ctx, "consumed", False):
        raise RuntimeError("flce: the single pass's gradients were scaled in place by the "
                           "first backward through this graph; a second one "
                           "(retain_graph=True) needs single_pass=False")
    # The upstream gradient over the divisor, in double: a mean's 1/count is not rounded to
    # fp32. Every token ignored: the mean is NaN (as torch) but the gradients are zero, not
    # 0 * inf.
    scale = torch.where(divisor > 0, grad_loss.to(torch.float64) / divisor, 0.0)
    grads = []
    for p, dt, need in zip(deferred, dtypes, needed):
        # An unrequested gradient is [0]; a requested one [k, *shape] even for an empty
        # input (N = 0), whose gradient is then the empty [0, D], not None.
        if not need or p.dim() < 2:
            grads.append(None)
        elif p.shape[0] == 1 and p.dtype == dt and p.is_contiguous() and \
                type(p) is torch.Tensor and not torch.compiler.is_compiling():
            # Already in the gradient's dtype: scaled in place, the gradient is the deferred
            # buffer itself (no second buffer of dW's size). Not while a compiler traces
            # the backward (a tensor subclass there): its graph keeps the functional op.
            nsops.scale_grad_(p, scale)
            ctx.consumed = True
            grads.append(p[0])
        else:
            grads.append(nsops.scale_grad(p, scale, dt))
    return grads


def register(namespace, cuda_format):
    """Fake kernels and autograd for the ops of ``torch.ops.<namespace>``. ``cuda_format(input)``
    says whether the backend serving ``input`` returns sum_and_grad's grad_weight in the
    weight's dtype (the CUDA backend) rather than in fp32 (see ops_def.h)."""
    nsops = getattr(torch.ops, namespace)

    def name(op):
        return f"{namespace}::{op}"

    @torch.library.register_fake(name("partial_stats"))
    def _partial_stats_fake(input, weight, target, bias, vocab_start, ignore_index, softcap,
                            temperature=1.0):
        return input.new_empty((input.shape[0], PARTIAL_COLS), dtype=torch.float32)

    @torch.library.register_fake(name("combine"))
    def _combine_fake(partials, target, vocab_size, ignore_index, label_smoothing, z_loss):
        n = partials.shape[1]
        return (partials.new_empty((n,)), partials.new_empty((n,)),
                partials.new_empty((n, STATS_COLS)), partials.new_empty((n,)))

    @torch.library.register_fake(name("forward"))
    def _forward_fake(input, weight, target, bias, ignore_index, label_smoothing, z_loss,
                      softcap, temperature=1.0, exact_bf16_grad=None):
        n = input.shape[0]
        f32 = dict(dtype=torch.float32, device=input.device)
        return (input.new_empty((n,), **f32), input.new_empty((n,), **f32),
                input.new_empty((n, STATS_COLS), **f32), input.new_empty((n,), **f32))

    @torch.library.register_fake(name("backward"))
    def _backward_fake(grad_loss, grad_lse, input, weight, target, bias, stats, vocab_start,
                       vocab_size, ignore_index, label_smoothing, z_loss, softcap, output_mask,
                       grad_entropy=None, temperature=1.0, exact_bf16_grad=None,
                       grad_input_fp32=False):
        grad_bias = _grad_like(bias, output_mask[2]) if bias is not None else weight.new_empty((0,))
        gi = _grad_like(input, output_mask[0], torch.float32 if grad_input_fp32 else None)
        return (gi, _grad_like(weight, output_mask[1]), grad_bias)

    def setup_context(ctx, inputs, output):
        input, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap = inputs[:8]
        temperature = inputs[8] if len(inputs) > 8 else 1.0
        exact = inputs[9] if len(inputs) > 9 else None  # not the forward's: the backward's
        stats = output[2]
        ctx.save_for_backward(input, weight, target, bias, stats)
        ctx.options = (ignore_index, label_smoothing, z_loss, softcap, temperature, exact)
        ctx.mark_non_differentiable(stats)

    def backward(ctx, grad_loss, grad_lse, grad_stats, grad_entropy):
        input, weight, target, bias, stats = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap, temperature, exact = ctx.options
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[3]]
        if not any(mask):
            return (None,) * 10
        if torch.is_grad_enabled():
            # create_graph=True: the gradients must be differentiable themselves, which the
            # backward kernel's are not. The same formulas again, in torch ops.
            opts = _composite.OpOptions(ignore_index, label_smoothing, z_loss, softcap,
                                        temperature)
            with torch.enable_grad():
                outs = _composite.per_token(input, weight, target, bias, opts)
                gi, gw, gb = _composite.grads_with_graph(
                    outs, (grad_loss, grad_lse, grad_entropy),
                    [t if m else None for t, m in zip((input, weight, bias), mask)])
            return (gi, gw, None, gb) + (None,) * 6
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        gi, gw, gb = nsops.backward(grad_loss, grad_lse, input, weight, target, bias, stats, 0,
                                    weight.shape[0], ignore_index, label_smoothing, z_loss,
                                    softcap, mask, grad_entropy, temperature, exact)
        return (gi if mask[0] else None, gw if mask[1] else None, None,
                gb if mask[2] else None) + (None,) * 6

    torch.library.register_autograd(name("forward"), backward, setup_context=setup_context)

    # return_predicted_tokens: forward, partial_stats, logits_forward and logits_stats with the
    # argmax's column (ops_def.h): the base op's fake (and autograd), plus an int64 [N] output
    # that takes no gradient. (The *_stats ones run inside the vocab-parallel autograd Function:
    # no autograd of their own.)
    def with_argmax(fake):
        def argmax_fake(first, *args, **kwargs):
            out = fake(first, *args, **kwargs)
            out = out if isinstance(out, tuple) else (out,)
            return out + (first.new_empty((first.shape[0],), dtype=torch.int64),)

        return argmax_fake

    def register_argmax(op, fake, setup, grad):
        def argmax_setup_context(ctx, inputs, output):
            setup(ctx, inputs, output[:4])
            ctx.mark_non_differentiable(output[4])

        def argmax_backward(ctx, grad_loss, grad_lse, grad_stats, grad_entropy, grad_argmax):
            return grad(ctx, grad_loss, grad_lse, grad_stats, grad_entropy)

        torch.library.register_fake(name(op))(with_argmax(fake))
        torch.library.register_autograd(name(op), argmax_backward,
                                        setup_context=argmax_setup_context)

    register_argmax("forward_argmax", _forward_fake, setup_context, backward)
    torch.library.register_fake(name("partial_stats_argmax"))(with_argmax(_partial_stats_fake))

    # Target distributions (probability targets; class targets with weights and smoothing).
    @torch.library.register_fake(name("soft_partial_stats"))
    def _soft_partial_stats_fake(input, weight, target, bias, class_weight, vocab_start,
                                 vocab_size, ignore_index, label_smoothing, softcap, temperature):
        n = input.shape[0]
        return (input.new_empty((n, SOFT_COLS), dtype=torch.float32),
                input.new_empty((n,), dtype=torch.int64))

    @torch.library.register_fake(name("soft_combine"))
    def _soft_combine_fake(partials, pivot, z_weight, z_loss):
        n = partials.shape[1]
        return (partials.new_empty((n,)), partials.new_empty((n,)),
                partials.new_empty((n, SOFT_COLS)), pivot.new_empty((n,)), partials.new_empty((n,)))

    @torch.library.register_fake(name("soft_forward"))
    def _soft_forward_fake(input, *_):
        return _soft_outputs(input)

    @torch.library.register_fake(name("soft_backward"))
    def _soft_backward_fake(grad_loss, grad_lse, grad_entropy, input, weight, target, bias,
                            class_weight, stats, pivot, z_weight, vocab_start, vocab_size,
                            ignore_index, label_smoothing, z_loss, softcap, temperature,
                            output_mask, grad_input_fp32=False):
        grad_bias = _grad_like(bias, output_mask[2]) if bias is not None else weight.new_empty((0,))
        gi = _grad_like(input, output_mask[0], torch.float32 if grad_input_fp32 else None)
        return (gi, _grad_like(weight, output_mask[1]), grad_bias)

    def soft_setup_context(ctx, inputs, output):
        (input, weight, target, bias, class_weight, z_weight, ignore_index, label_smoothing,
         z_loss, softcap, temperature) = inputs
        _, _, stats, pivot, _ = output
        ctx.save_for_backward(input, weight, target, bias, class_weight, z_weight, stats, pivot)
        ctx.options = _composite.OpOptions(ignore_index, label_smoothing, z_loss, softcap,
                                           temperature)
        ctx.mark_non_differentiable(stats, pivot)

    def soft_backward(ctx, grad_loss, grad_lse, grad_stats, grad_pivot, grad_entropy):
        input, weight, target, bias, class_weight, z_weight, stats, pivot = ctx.saved_tensors
        o = ctx.options
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[3]]
        none = (None,) * 7
        if not any(mask):
            return (None,) * 4 + none
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, as above
            with torch.enable_grad():
                outs = _composite.soft_linear_per_token(input, weight, target, bias, o,
                                                        class_weight, z_weight)
                gi, gw, gb = _composite.grads_with_graph(
                    outs, (grad_loss, grad_lse, grad_entropy),
                    [t if m else None for t, m in zip((input, weight, bias), mask)])
            return (gi, gw, None, gb) + none
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        gi, gw, gb = nsops.soft_backward(
            grad_loss, grad_lse, grad_entropy, input, weight, target, bias, class_weight, stats,
            pivot, z_weight, 0, weight.shape[0], o.ignore_index, o.label_smoothing, o.z_loss,
            o.softcap, o.temperature, mask)
        return (gi if mask[0] else None, gw if mask[1] else None, None,
                gb if mask[2] else None) + none

    torch.library.register_autograd(name("soft_forward"), soft_backward,
                                    setup_context=soft_setup_context)

    @torch.library.register_fake(name("sum_and_grad"))
    def _sum_and_grad_fake(input, weight, target, bias, ignore_index, label_smoothing, z_loss,
                           softcap, output_mask, mean, vocab_start=0, vocab_size=-1,
                           group_name=None, group_size=1, temperature=1.0,
                           exact_bf16_grad=None):
        # [1, *shape] (ops_def.h): dE and dbias fp32, dW fp32 or (CUDA) in the weight's dtype
        def deferred(t, wanted, dtype):
            return t.new_empty((1, *t.shape), dtype=dtype) if wanted else t.new_empty((0,))
        grad_bias = (deferred(bias, output_mask[2], torch.float32) if bias is not None
                     else weight.new_empty((0,)))
        return (input.new_empty((), dtype=torch.float32), input.new_empty((), dtype=torch.float64),
                deferred(input, output_mask[0], torch.float32),
                deferred(weight, output_mask[1],
                         weight.dtype if cuda_format(input) else torch.float32), grad_bias)

    @torch.library.register_fake(name("scale_grad"))
    def _scale_grad_fake(deferred, scale, dtype):
        return deferred.new_empty(deferred.shape[1:], dtype=dtype)

    @torch.library.register_fake(name("scale_grad_"))
    def _scale_grad_inplace_fake(deferred, scale):
        return None

    @torch.library.register_fake(name("check_target"))
    def _check_target_fake(target, vocab_size, ignore_index):
        return None

    # (no output: without this a compiled graph would drop the check as dead code)
    has_side_effect(nsops.check_target.default)

    @torch.library.register_fake(name("soft_sum_and_grad"))
    def _soft_sum_and_grad_fake(input, weight, target, bias, class_weight, z_weight,
                                ignore_index, label_smoothing, z_loss, softcap, temperature,
                                output_mask, mean):
        return _sum_and_grad_fake(input, weight, target, bias, ignore_index, label_smoothing,
                                  z_loss, softcap, output_mask, mean)

    def sum_setup_context(ctx, inputs, output):
        input, weight, target, bias = inputs[:4]
        _, divisor, gi, gw, gb = output
        ctx.save_for_backward(divisor, gi, gw, gb)
        ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.inputs = len(inputs)
        ctx.mark_non_differentiable(divisor, gi, gw, gb)

    def sum_backward(ctx, grad_loss, *_):
        refuse_double_backward("the single pass (flce::sum_and_grad)", "single_pass=False")
        divisor, *deferred = ctx.saved_tensors
        needed = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
        gi, gw, gb = scale_deferred(nsops, ctx, grad_loss, divisor, deferred, ctx.dtypes, needed)
        return (gi, gw, None, gb) + (None,) * (ctx.inputs - 4)

    torch.library.register_autograd(name("sum_and_grad"), sum_backward,
                                    setup_context=sum_setup_context)
    torch.library.register_autograd(name("soft_sum_and_grad"), sum_backward,
                                    setup_context=sum_setup_context)

    # Cross-entropy on given logits.
    @torch.library.register_fake(name("logits_stats"))
    def _logits_stats_fake(logits, target, vocab_start, ignore_index, softcap, temperature,
                           with_sum, with_entropy):
        return logits.new_empty((logits.shape[0], PARTIAL_COLS), dtype=torch.float32)

    @torch.library.register_fake(name("logits_forward"))
    def _logits_forward_fake(logits, target, ignore_index, label_smoothing, z_loss, softcap,
                             temperature, with_entropy, inplace_backward=False):
        n = logits.shape[0]
        f32 = dict(dtype=torch.float32)
        return (logits.new_empty((n,), **f32), logits.new_empty((n,), **f32),
                logits.new_empty((n, STATS_COLS), **f32), logits.new_empty((n,), **f32))

    @torch.library.register_fake(name("logits_backward"))
    def _logits_backward_fake(grad_loss, grad_lse, grad_entropy, logits, *_):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    # flce.linear_distillation's row math (python/flce/distill.py calls it inside its
    # autograd.Function, so it needs no autograd of its own): it writes its outputs in place and
    # returns nothing.
    @torch.library.register_fake(name("distill_rows_"))
    def _distill_rows_fake(z_s, z_t, loss, target, valid, divergence, beta, temperature,
                           hard_weight, soft_weight, grad_s, grad_t):
        return None

    @torch.library.register_fake(name("logits_backward_"))
    def _logits_backward_inplace_fake(*_):
        return None

    def logits_setup_context(ctx, inputs, output):
        logits, target, ignore_index, label_smoothing, z_loss, softcap, temperature = inputs[:7]
        ctx.inplace = bool(inputs[8]) if len(inputs) > 8 else False
        ctx.save_for_backward(logits, target, output[2])
        ctx.options = _composite.OpOptions(ignore_index, label_smoothing, z_loss, softcap,
                                           temperature)
        ctx.mark_non_differentiable(output[2])

    def logits_backward(ctx, grad_loss, grad_lse, grad_stats, grad_entropy):
        logits, target, stats = ctx.saved_tensors
        none = (None,) * 8
        if not ctx.needs_input_grad[0]:
            return (None,) + none
        o = ctx.options
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, as above
            with torch.enable_grad():
                outs = _composite.logits_per_token(
                    logits.to(_composite.compute_dtype(logits.dtype)), target, o)
                grad, = _composite.grads_with_graph(outs, (grad_loss, grad_lse, grad_entropy),
                                                    [logits])
            return (grad,) + none
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        args = (grad_loss, grad_lse, grad_entropy, logits, target, stats, 0, logits.shape[1],
                o.ignore_index, o.label_smoothing, o.z_loss, o.softcap, o.temperature)
        if ctx.inplace and can_write_in_place(logits):
            # The caller gave up the logits (inplace_backward=True): their storage becomes the
            # gradient's, and no [N, V] buffer is allocated.
            nsops.logits_backward_(*args)
            torch.autograd.graph.increment_version(logits)
            return (logits,) + none
        return (nsops.logits_backward(*args),) + none

    torch.library.register_autograd(name("logits_forward"), logits_backward,
                                    setup_context=logits_setup_context)
    register_argmax("logits_forward_argmax", _logits_forward_fake, logits_setup_context,
                    logits_backward)
    torch.library.register_fake(name("logits_stats_argmax"))(with_argmax(_logits_stats_fake))

    # Target distributions on given logits.
    @torch.library.register_fake(name("soft_logits_stats"))
    def _soft_logits_stats_fake(logits, target, class_weight, vocab_start, vocab_size,
                                ignore_index, label_smoothing, softcap, temperature):
        n = logits.shape[0]
        return (logits.new_empty((n, SOFT_COLS), dtype=torch.float32),
                logits.new_empty((n,), dtype=torch.int64))

    @torch.library.register_fake(name("soft_logits_forward"))
    def _soft_logits_forward_fake(logits, *_):
        return _soft_outputs(logits)

    @torch.library.register_fake(name("soft_logits_backward"))
    def _soft_logits_backward_fake(grad_loss, grad_lse, grad_entropy, logits, *_):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    def soft_logits_setup_context(ctx, inputs, output):
        (logits, target, class_weight, z_weight, ignore_index, label_smoothing, z_loss, softcap,
         temperature) = inputs
        _, _, stats, pivot, _ = output
        ctx.save_for_backward(logits, target, class_weight, z_weight, stats, pivot)
        ctx.options = _composite.OpOptions(ignore_index, label_smoothing, z_loss, softcap,
                                           temperature)
        ctx.mark_non_differentiable(stats, pivot)

    def soft_logits_backward(ctx, grad_loss, grad_lse, grad_stats, grad_pivot, grad_entropy):
        logits, target, class_weight, z_weight, stats, pivot = ctx.saved_tensors
        none = (None,) * 8
        if not ctx.needs_input_grad[0]:
            return (None,) + none
        o = ctx.options
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, as above
            with torch.enable_grad():
                z = logits.to(_composite.compute_dtype(logits.dtype))
                outs = (_composite.soft_per_token(z, target, o, class_weight)[:3]
                        if target.dtype.is_floating_point else
                        _composite.logits_per_token(z, target, o, weight=class_weight))
                grad, = _composite.grads_with_graph(outs, (grad_loss, grad_lse, grad_entropy),
                                                    [logits])
            return (grad,) + none
        if grad_loss is None:
            grad_loss = stats.new_zeros(()).expand(stats.shape[0])
        return (nsops.soft_logits_backward(
            grad_loss, grad_lse, grad_entropy, logits, target, class_weight, stats, pivot,
            z_weight, 0, logits.shape[1], o.ignore_index, o.label_smoothing, o.z_loss, o.softcap,
            o.temperature),) + none

    torch.library.register_autograd(name("soft_logits_forward"), soft_logits_backward,
                                    setup_context=soft_logits_setup_context)


register("flce", lambda t: t.device.type == "cuda")

