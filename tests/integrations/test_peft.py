"""A frozen classifier (PEFT / LoRA), LoRA adapters and gradient checkpointing with flce.patch.

- A classifier with ``requires_grad=False`` gets no gradient and flce builds no ``(V, D)``
  gradient buffer for it (so runs no dW GEMM into one), on both of the CPU backend's paths: the
  memory profiler sees the buffer's allocation when the weight is trainable and none when frozen.
- A LoRA model (peft) whose base model is patched: the loss and every adapter's gradient equal
  the unpatched LoRA model's (float32; the same tolerance as tests/integrations/test_hf.py's
  Trainer test, 1e-5 relative: both compute one fp32 loss from the same weights, by different
  reductions), and the frozen ``lm_head`` gets no gradient.
- A LoRA adapter on ``lm_head`` itself changes the logits in a way flce.patch does not compute:
  it is refused at the first call, not trained on the base head's loss.
- Gradient checkpointing on a patched model gives the gradients of the model without it.
"""
import pytest
import torch

pytest.importorskip("transformers")
from hf_models import batch, tiny_model  # noqa: E402

import flce  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N, D, V = 37, 48, 1000  # N < D: no other buffer of the step reaches V x D floats


def _allocations(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]


@pytest.mark.parametrize("single_pass", [True, False])
def test_frozen_classifier_gets_no_gradient_and_no_gradient_buffer(single_pass):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, V, (N,), generator=g)
    dw_bytes = V * D * 4
    for frozen in (False, True):
        x = torch.randn(N, D, generator=g, requires_grad=True)
        w = torch.randn(V, D, generator=g).requires_grad_(not frozen)

        def step():
            flce.linear_cross_entropy(x, w, t, single_pass=single_pass).backward()

        sizes = _allocations(step)
        assert x.grad is not None and torch.isfinite(x.grad).all()
        if frozen:
            assert w.grad is None
            assert max(sizes) < dw_bytes, sorted(sizes)[-5:]
        else:
            assert w.grad is not None
            assert dw_bytes in sizes, sorted(sizes)[-5:]  # what the frozen case must not show


def _lora(model, targets):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False)  # nonzero B: every adapter has a gradient
    torch.manual_seed(5)
    return peft.get_peft_model(model, config)


def _loss_and_grads(model, ids, mask, labels, patched):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert (out.logits is None) == patched  # flce computed the loss: no logits in training
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_on_a_patched_model_matches_the_unpatched_one():
    ids, mask, labels = batch()
    ref_model = _lora(tiny_model("llama"), ["q_proj", "v_proj", "down_proj"])
    model = _lora(tiny_model("llama"), ["q_proj", "v_proj", "down_proj"])
    flce.patch(model.get_base_model())
    ref_loss, ref = _loss_and_grads(ref_model, ids, mask, labels, False)
    loss, got = _loss_and_grads(model, ids, mask, labels, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert got.keys() == ref.keys() and all("lora_" in n for n in got), sorted(got)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5 * ref[n].abs().max(),
                                   msg=lambda m: f"{n}: {m}")
    head = model.get_base_model().get_output_embeddings()
    assert not head.weight.requires_grad and head.weight.grad is None


def test_lora_on_the_head_is_refused():
    ids, mask, labels = batch()
    model = _lora(tiny_model("llama"), ["lm_head"])
    flce.patch(model.get_base_model())
    with pytest.raises(RuntimeError, match="not lm_head\\(hidden\\)"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    ids, mask, labels = batch()
    ref_model = tiny_model("llama").train()
    model = flce.patch(tiny_model("llama").train())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing
    # transformers checkpoints the layers' forward (their own hooks stay outside): a sublayer's
    # hook sees the recompute.
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    ref_loss, ref = _loss_and_grads(ref_model, ids, mask, labels, False)
    loss, got = _loss_and_grads(model, ids, mask, labels, True)
    assert len(calls) == 2  # the layer ran again in the backward: checkpointed
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5 * ref[n].abs().max(),
                                   msg=lambda m: f"{n}: {m}")
