"""Hugging Face transformers causal LMs with flce computing the loss.

One generic mechanism for every ``*ForCausalLM`` model, nothing copied from transformers:

* a forward pre-hook on the output embedding (``model.get_output_embeddings()``, the ``lm_head``)
  records the final hidden states and, unless logits are wanted, hands the head an empty slice of
  them, so the ``[N, V]`` logits are never built (the model's own softcap / ``.float()`` then run on
  an empty tensor);
* the model's own ``forward`` runs unchanged with ``labels=None`` (so every argument, cache, output
  class and model-specific step keeps working across transformers versions), and the loss is then
  computed from the recorded hidden states and ``lm_head.weight`` with
  :func:`flce.linear_cross_entropy`, reproducing ``ForCausalLMLoss``: shifted labels (or the
  caller's ``shift_labels``), ``num_items_in_batch`` normalization, ``logits_to_keep``, the
  logit transform the config describes (softcap, scale, unpadded vocabulary) and a MoE router
  ``aux_loss``;
* once per model, the logits the model returns for one position per sequence are compared with
  that transform, so a model that changes its logits some other way is refused, not silently
  trained on a different loss.

Calls without ``labels`` (generation, inference) go straight to the original forward.
"""
import dataclasses
import functools
import inspect
import types

import torch
import torch.nn.functional as F

from .._common import is_dtensor as _is_dtensor
from ..api import linear_cross_entropy

__all__ = ["patch", "unpatch", "patched", "causal_lm_loss"]

_IGNORE_INDEX = -100
# Classes patched with ``patch(cls)``: class -> its original forward, and its return_logits.
_PATCHED_CLASSES = {}
_CLASS_RETURN_LOGITS = {}


class _HeadState:
    """What the head's pre-hook shares with the patched forward during one call."""

    __slots__ = ("active", "keep_logits", "probe", "hidden", "verified")

    def __init__(self):
        self.active = False
        self.keep_logits = False
        self.probe = False  # give the head one position per sequence, to check its logits
        self.hidden = None
        self.verified = False  # the model's logits were found to be what flce computes


def _capture(module, args):
    """The head's forward pre-hook. It reads its state from the module, so copies of a patched
    model (``copy.deepcopy``) each use their own."""
    state = module._flce_state
    if not state.active:
        return None
    hidden = args[0]
    state.hidden = hidden
    if state.keep_logits:
        return None
    weight = getattr(module, "weight", None)
    if _is_dtensor(weight) and not _is_dtensor(hidden):
        # A DTensor head multiplies only DTensors, and DTensor cannot view empty tensors:
        # one position per sequence, replicated.
        from torch.distributed.tensor import DTensor, Replicate

        mesh = weight.device_mesh
        stub = DTensor.from_local(hidden[..., :1, :].detach(), mesh, [Replicate()] * mesh.ndim,
                                  run_check=False)
    else:
        stub = hidden[..., :1 if state.probe else 0, :].detach()
    return (stub,) + tuple(args[1:])


def _install_hook(head):
    state = getattr(head, "_flce_state", None)
    if state is None:
        state = _HeadState()
        head._flce_state = state
        head.register_forward_pre_hook(_capture)
    return state


def _remove_hook(head):
    for key, hook in list(head._forward_pre_hooks.items()):
        if hook is _capture:
            del head._forward_pre_hooks[key]
    vars(head).pop("_flce_state", None)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("flce.patch needs Hugging Face transformers (pip install "
                          "transformers)") from e
    return transformers


def _resolve_class(name):
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(name)
    if class_name is None:
        raise ValueError(f"flce.patch: model type {name!r} has no causal-LM class in transformers "
                         f"{transformers.__version__} (known model types are the keys of "
                         "transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, e.g. 'llama')")
    return getattr(transformers, class_name)


def _check_class(cls):
    transformers = _transformers()
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise TypeError(f"flce.patch: expected a transformers causal-LM model, model class or "
                        f"model-type string, got {cls!r}")
    if "labels" not in inspect.signature(cls.forward).parameters:
        raise TypeError(f"flce.patch: {cls.__name__} is not supported: its forward takes no "
                        "`labels` (flce replaces the loss of *ForCausalLM models)")
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        source = None
    if source is not None and "loss_function" not in source:
        # e.g. BartForCausalLM: its own loss on labels it does not shift.
        raise TypeError(f"flce.patch: {cls.__name__} is not supported: its forward computes its "
                        "own loss instead of transformers' loss_function (ForCausalLMLoss)")


def _check_instance(model):
    _check_class(type(model))
    from transformers.loss.loss_utils import LOSS_MAPPING
    name = type(model).__name__
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) and not (isinstance(weight, torch.Tensor)
                                                       and weight.dim() == 2):
        raise TypeError(f"flce.patch: {name} is not supported: get_output_embeddings() returned "
                        f"{type(head).__name__}, not a linear head with a (vocab, hidden) weight")
    if model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        raise TypeError(f"flce.patch: {name} is not supported: its loss_function is "
                        f"{getattr(model.loss_function, '__name__', model.loss_function)!r}, "
                        "not transformers' ForCausalLMLoss, which is what flce replaces")
    return head


@functools.lru_cache(maxsize=None)
def _positional_names(forward):
    params = list(inspect.signature(forward).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds and p.name != "self")


def patch(model, *, return_logits=None):
    """Make a transformers causal LM compute its training loss with flce.

    Args:
        model: a model instance (patched in place and returned), a model class (every instance's
            forward is patched; returned) or a model-type string such as ``"llama"`` (its
            ``*ForCausalLM`` class is patched and returned).
        return_logits: whether forward calls that get ``labels`` also return the logits. ``None``
            (default): only in eval mode (``model.training`` False); in training ``logits`` is
            ``None`` and never materialized. A call can override it with ``return_logits=``.
            Patching a patched model again sets it anew (an instance's setting wins over its
            class's).

    Calls without ``labels`` (generation, inference) are unchanged.
    """
    if return_logits not in (None, True, False):
        raise TypeError(f"flce.patch: return_logits must be None, True or False, got "
                        f"{return_logits!r}")
    if isinstance(model, str):
        model = _resolve_class(model)
    if isinstance(model, type):
        _check_class(model)
        _CLASS_RETURN_LOGITS[model] = return_logits
        if model not in _PATCHED_CLASSES:
            original = model.forward
            _PATCHED_CLASSES[model] = original
            cls = model

            @functools.wraps(original)
            def forward(self, *args, **kwargs):
                if not vars(self).get("_flce_checked"):
                    _check_instance(self)  # (its head and loss_function, once per instance)
                    self._flce_checked = True
                keep = vars(self).get("_flce_return_logits", _CLASS_RETURN_LOGITS[cls])
                return _forward(self, original.__get__(self), args, kwargs, keep)

            model.forward = forward
        return model
    head = _check_instance(model)
    if _is_patched(model):
        model._flce_return_logits = return_logits
        return model
    _install_hook(head)
    # Keep a forward someone else set on the instance (accelerate's autocast wrapper, say).
    model._flce_previous_forward = vars(model).get("forward")
    model._flce_return_logits = return_logits
    original = model.forward

    @functools.wraps(getattr(original, "__func__", original))
    def forward(self, *args, **kwargs):
        # Looked up per call, and bound as a method: a deepcopy of the model calls its own.
        previous = self._flce_previous_forward
        original = type(self).forward.__get__(self) if previous is None else previous
        return _forward(self, original, args, kwargs, self._flce_return_logits)

    model.forward = types.MethodType(forward, model)
    return model


def _is_patched(model):
    return "_flce_previous_forward" in vars(model) or type(model) in _PATCHED_CLASSES


def unpatch(model):
    """Undo :func:`patch` on a model instance, class or model-type string; returns it."""
    if isinstance(model, str):
        model = _resolve_class(model)
    if isinstance(model, type):
        original = _PATCHED_CLASSES.pop(model, None)
        _CLASS_RETURN_LOGITS.pop(model, None)
        if original is not None:
            model.forward = original
        return model
    if "_flce_previous_forward" not in vars(model) and type(model) in _PATCHED_CLASSES:
        raise ValueError(f"flce.unpatch: {type(model).__name__} is patched as a class "
                         f"(flce.patch({type(model).__name__})): unpatch the class")
    vars(model).pop("_flce_return_logits", None)
    if "_flce_previous_forward" in vars(model):
        previous = vars(model).pop("_flce_previous_forward")
        if previous is None:
            del model.forward
        else:
            model.forward = previous
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        _remove_hook(head)
    return model


class patched:
    """``with flce.patched(model): ...`` patches for the block and restores the model after.

    A model (or class) that was already patched before the block stays patched.
    """

    def __init__(self, model, *, return_logits=None):
        self.model = model
        self.return_logits = return_logits
        self._was_patched = False
        self._restore = None

    def __enter__(self):
        m = self.model
        cls = _resolve_class(m) if isinstance(m, str) else m
        if isinstance(cls, type):
            self._was_patched = cls in _PATCHED_CLASSES
            keep = _CLASS_RETURN_LOGITS.get(cls)
            self._restore = lambda: _CLASS_RETURN_LOGITS.__setitem__(cls, keep)
        else:
            self._was_patched = _is_patched(cls)
            keep = vars(cls).get("_flce_return_logits", _patch_missing)
            self._restore = lambda: (vars(cls).pop("_flce_return_logits", None)
                                     if keep is _patch_missing
                                     else setattr(cls, "_flce_return_logits", keep))
        return patch(m, return_logits=self.return_logits)

    def __exit__(self, *exc):
        if not self._was_patched:
            unpatch(self.model)
        else:
            self._restore()  # (the setting the model had before the block)
        return False


_patch_missing = object()


def _forward(model, original, args, kwargs, return_logits):
    if len(args) > 1:
        names = _positional_names(getattr(original, "__func__", original))
        if len(args) > len(names):
            raise TypeError(f"{type(model).__name__}.forward got {len(args)} positional "
                            f"arguments, takes at most {len(names)}")
        kwargs = {**dict(zip(names[1:], args[1:])), **kwargs}
        args = args[:1]
    labels = kwargs.pop("labels", None)
    want_logits = kwargs.pop("return_logits", return_logits)
    if labels is None:
        return original(*args, **kwargs)
    if want_logits is None:
        want_logits = not model.training
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)

    head = model.get_output_embeddings()
    state = _install_hook(head)
    # Once per model, in eager mode: check that its logits are what flce computes from the
    # config (catches a logit transform this module does not know, instead of dropping it): one
    # position per sequence, or the first of the logits a call keeps.
    probe = not (state.verified or torch.compiler.is_compiling() or _is_dtensor(head.weight))
    state.active, state.keep_logits, state.probe, state.hidden = True, bool(want_logits), probe, None
    try:
        out = original(*args, labels=None, return_dict=True, **kwargs)
        hidden = state.hidden
    finally:
        state.active, state.hidden = False, None
    if hidden is None:
        raise RuntimeError(f"flce.patch: {type(model).__name__}.forward never called its output "
                           "embedding (get_output_embeddings()); this model is not supported")

    _unshard_fsdp(head)
    weight, bias, scale, softcap = _head_from_config(model, head)
    if probe:
        _check_logits(model, out.logits, hidden, weight, bias, scale, softcap)
        state.verified = True
    loss = causal_lm_loss(hidden, weight, labels, bias=bias, logit_scale=scale, softcap=softcap,
                          num_items_in_batch=kwargs.get("num_items_in_batch"),
                          shift_labels=kwargs.get("shift_labels"),
                          logits_to_keep=kwargs.get("logits_to_keep", 0))
    aux_loss = getattr(out, "aux_loss", None)
    if aux_loss is not None:
        loss = loss + _aux_loss_coef(model) * aux_loss.to(loss.device)

    fields = dict(out)  # (the fields that are set, in order)
    fields["loss"] = loss
    fields["logits"] = out.logits if want_logits else None
    if return_dict:
        return type(out)(**fields)
    # transformers' tuple (its to_tuple drops None fields) in the output class's field order, as
    # the unpatched model's: a MoE model's aux_loss comes before the logits. The logits' place is
    # kept (None where they are not returned).
    return tuple(fields.get(f.name) for f in dataclasses.fields(out)
                 if f.name in ("loss", "logits") or fields.get(f.name) is not None)


def _aux_loss_coef(model):
    """The coefficient the model adds its MoE router loss with (``loss += coef * aux_loss`` in
    its forward): the attribute its ``__init__`` sets (``router_aux_loss_coef``; JetMoE's
    ``aux_loss_coef``; DBRX's from ``ffn_config.moe_loss_weight``), else its config's."""
    config = _text_config(model)
    for owner, name in ((model, "router_aux_loss_coef"), (model, "aux_loss_coef"),
                        (config, "router_aux_loss_coef"), (config, "aux_loss_coef")):
        coef = getattr(owner, name, None)
        if isinstance(coef, (int, float)):
            return coef
    raise RuntimeError(f"flce.patch: {type(model).__name__} returns a router aux_loss, but flce "
                       "does not know the coefficient it adds it with; it is not supported "
                       "(unpatch it)")


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_from_config(model, head):
    """The head's weight and bias and the logit transform the model applies after the head.

    transformers' causal LMs transform logits by, at most: a padded vocabulary cut to
    ``unpadded_vocab_size``; a scale (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``);
    a tanh softcap (``final_logit_softcapping``, RecurrentGemma's ``logits_soft_cap``, xLSTM's
    ``output_logit_soft_cap``).
    """
    config = _text_config(model)
    weight, bias = head.weight, getattr(head, "bias", None)
    unpadded = getattr(config, "unpadded_vocab_size", None)
    if unpadded is not None and unpadded < weight.shape[0]:
        weight = weight[:unpadded]
        bias = None if bias is None else bias[:unpadded]
    scale = getattr(config, "logit_scale", None)
    if getattr(config, "logits_scaling", None) is not None:
        scale = 1.0 / config.logits_scaling
    softcap = None
    for name in ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"):
        if getattr(config, name, None) is not None:
            softcap = getattr(config, name)
            break
    if scale is not None and not isinstance(scale, (int, float)):
        scale = None  # not a number: not a logit multiplier
    return weight, bias, scale, softcap


@torch.no_grad()
def _check_logits(model, logits, hidden, weight, bias, scale, softcap):
    """Compare the model's logits for the probed positions with flce's view of its head."""
    probe = hidden[..., :1, :]
    expected = F.linear(probe, weight, bias).float()
    logits = None if logits is None else logits[..., :1, :]
    if scale is not None:
        expected = expected * scale
    if softcap is not None:
        expected = softcap * torch.tanh(expected / softcap)
    actual = None if logits is None else logits.float()
    ok = actual is not None and actual.shape == expected.shape and bool(torch.allclose(
        actual, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()) + 1e-6))
    if not ok:
        raise RuntimeError(
            f"flce.patch: {type(model).__name__}'s logits are not lm_head(hidden) transformed as "
            f"its config says (scale={scale}, softcap={softcap}); it changes them in a way flce "
            "does not reproduce, so it is not supported (unpatch it)")


def _unshard_fsdp(head):
    # A head that is its own FSDP2 unit was resharded right after its (empty) forward call; bring
    # its full weight back so the loss and FSDP's post-backward reduce-scatter see the unsharded
    # parameter, as they would for the logits of an unpatched model.
    # By name, as flce's DTensor check: importing torch.distributed.fsdp would slow `import flce`.
    if any(c.__name__ == "FSDPModule" and c.__module__.startswith("torch.distributed.fsdp")
           for c in type(head).__mro__):
        head.unshard()


def _slice_positions(t, logits_to_keep):
    """transformers' ``slice_logits_to_keep`` on a ``(batch, seq)`` label tensor."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return t[logits_to_keep]
        return torch.take_along_dim(t, logits_to_keep, dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return t[:, logits_to_keep]


def _op_weight(weight):
    """Gather a DTensor weight the fused op cannot take as is (autograd-aware).

    A weight sharded over the vocabulary (``Shard(0)``) stays a DTensor: flce's vocab-parallel
    path takes it. Replicated or otherwise sharded weights become a plain tensor with
    ``full_tensor()``, whose backward hands each rank its part of the gradient.
    """
    if not _is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Shard

    if weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),):
        try:
            from .. import parallel  # noqa: F401
        except ImportError:  # a build without flce.parallel: gather instead
            pass
        else:
            return weight
    return weight.full_tensor()


def causal_lm_loss(hidden, weight, labels, *, bias=None, logit_scale=None, softcap=None,
                   num_items_in_batch=None, ignore_index=_IGNORE_INDEX, shift_labels=None,
                   logits_to_keep=0):
    """transformers' ``ForCausalLMLoss`` computed by flce from hidden states and the head weight.

    Args:
        hidden: ``(batch, seq, D)`` final hidden states, already sliced by ``logits_to_keep``
            (what the model feeds its ``lm_head``).
        weight: ``(V, D)`` ``lm_head.weight`` (may be float32 master weights with bf16 hidden, or a
            DTensor).
        labels: ``(batch, seq)`` unshifted labels (token ``i``'s label is predicted at ``i - 1``),
            ``ignore_index`` where no loss is wanted. When ``shift_labels`` is given it is used
            instead and ``labels`` only decides that a loss is computed.
        logit_scale: a factor on the logits (Cohere's ``logit_scale``), applied to ``hidden``
            (with ``bias``, to it too), before the softcap.
        softcap: the model's ``final_logit_softcapping`` (Gemma 2/3).
        num_items_in_batch: when given, the loss is the sum over tokens divided by it (gradient
            accumulation), else the mean over non-ignored tokens.
        logits_to_keep: the model's argument; labels covering the full sequence are sliced the
            same way as the hidden states.

    Returns:
        The float32 scalar loss.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if shift_labels.shape != hidden.shape[:-1]:
        shift_labels = _slice_positions(shift_labels, logits_to_keep)
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(f"flce: labels of shape {tuple(labels.shape)} do not match the "
                         f"{tuple(hidden.shape[:-1])} positions the model computes logits for "
                         f"(logits_to_keep={logits_to_keep!r})")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What the head's matmul would run in; the weight stays float32 master weights.
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if logit_scale is not None and logit_scale != 1:
        hidden = hidden * logit_scale
        bias = None if bias is None else bias * logit_scale
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(hidden, _op_weight(weight), shift_labels,
                                bias=None if bias is None else _op_weight(bias),
                                ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
