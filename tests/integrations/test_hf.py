"""flce.patch on tiny transformers causal LMs: same loss and gradients as the unpatched model."""
import copy

import pytest
import torch
import torch.nn.functional as F

import flce
from flce import reference
from hf_models import COMMON, FAMILIES, VOCAB, batch, tiny_model, transformers

FP32 = 2.0 ** -24


pytestmark = pytest.mark.usefixtures("one_thread")


def _shifted(labels):
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def _oracle_loss(model64, ids, mask, labels):
    """Float64 loss summed over tokens from the unpatched float64 model's (softcapped) logits."""
    logits = model64(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.float64
    return reference.logits_cross_entropy(logits.reshape(-1, VOCAB), _shifted(labels).reshape(-1),
                                          reduction="sum")


def _grads(model):
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _micro_batches(model, batches, num_items):
    total = 0.0
    for ids, mask, labels in batches:
        out = model(input_ids=ids, attention_mask=mask, labels=labels,
                    num_items_in_batch=num_items)
        out.loss.backward()
        total += out.loss.detach().double()
    return total, _grads(model)


def _assert_close_to_oracle(name, got, ref, oracle):
    """flce's error vs float64 within twice the unpatched fp32 model's error (its rounding)."""
    loss_f, grads_f = got
    loss_h, grads_h = ref
    loss_o, grads_o = oracle
    err_h = abs(loss_h - loss_o).item()
    err_f = abs(loss_f - loss_o).item()
    assert err_f <= max(2 * err_h, 16 * FP32 * abs(loss_o).item()), (name, err_f, err_h)
    for n, g_o in grads_o.items():
        scale = g_o.norm().item()
        e_h = (grads_h[n] - g_o).norm().item() / scale
        e_f = (grads_f[n] - g_o).norm().item() / scale
        assert e_f <= 2 * e_h + 4 * FP32, (name, n, e_f, e_h)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_loss_and_grads_match_unpatched(family):
    model = tiny_model(family)
    model64 = copy.deepcopy(model).double()
    ids, mask, labels = batch()

    def run(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert out.loss.dtype == torch.float32
        return out, out.loss.detach().double(), _grads(m)

    oracle_loss = _oracle_loss(model64, ids, mask, labels) / (_shifted(labels) != -100).sum()
    oracle_loss.backward()
    oracle = (oracle_loss.detach(), _grads(model64))
    out_h, *ref = run(model)
    assert flce.patch(model) is model
    out_f, *got = run(model)
    assert out_f.logits is None and out_h.logits.shape == (*ids.shape, VOCAB)
    _assert_close_to_oracle(family, got, ref, oracle)

    config = model.config
    if any(getattr(config, k, None) is not None
           for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        # The check above can fail: the loss without the config's logit transform is far off.
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        plain = flce.integrations.causal_lm_loss(hidden, model.lm_head.weight, labels)
        assert abs(plain.item() - oracle[0].item()) > 1e3 * abs(got[0] - oracle[0]).item() + 1e-3

    # Gradient accumulation: two micro-batches normalized by the tokens of both.
    b1, b2 = batch(seed=2), batch(seed=3, pad=5)
    n_items = sum((_shifted(b[2]) != -100).sum() for b in (b1, b2))
    total = sum(_oracle_loss(model64, *b) for b in (b1, b2)) / n_items
    total.backward()
    oracle = (total.detach(), _grads(model64))
    got = _micro_batches(model, (b1, b2), n_items)
    flce.unpatch(model)
    ref = _micro_batches(model, (b1, b2), n_items)
    _assert_close_to_oracle(family + " grad-accum", got, ref, oracle)


def _moe_config(kind):
    """Tiny MoE configs whose router loss is added with a coefficient of 0.5, spelt as each
    model spells it: Mixtral's config.router_aux_loss_coef, JetMoE's config.aux_loss_coef,
    DBRX's config.ffn_config.moe_loss_weight (each model keeps it as an attribute)."""
    if kind == "mixtral":
        return transformers.AutoConfig.for_model(
            "mixtral", **{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2,
                          "output_router_logits": True, "router_aux_loss_coef": 0.5})
    if kind == "jetmoe":
        return transformers.JetMoeConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            kv_channels=16, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1,
            output_router_logits=True, aux_loss_coef=0.5)
    return transformers.DbrxConfig(
        vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, max_seq_len=64,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        output_router_logits=True,
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=2, moe_top_k=1, moe_loss_weight=0.5))


@pytest.mark.parametrize("kind", ["mixtral", "jetmoe", "dbrx"])
def test_moe_router_aux_loss_is_added(kind):
    config = _moe_config(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids, mask, labels = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert 0.5 * ref.aux_loss.item() > 0.1  # large enough to be missed
    flce.patch(model)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)


def _tuple_places_equal(got, ref, what):
    """The patched model's tuple against the unpatched one's, place by place: the loss within
    fp32 rounding of the two computations, every other place the same object kind and value."""
    assert len(got) == len(ref), (what, len(got), len(ref))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0, msg=what)
    for i, (g, r) in enumerate(zip(got[1:], ref[1:]), 1):
        if r is None or g is None:
            assert g is None and r is None, (what, i)
        elif isinstance(r, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.shape == r.shape, (what, i)
            torch.testing.assert_close(g, r, rtol=0, atol=0, msg=f"{what}: place {i}")
        else:
            assert type(g) is type(r) and len(g) == len(r), (what, i)
            _tuple_places_equal((got[0],) + tuple(g), (ref[0],) + tuple(r), f"{what}[{i}]")


def _tiny_moe(kind):
    torch.manual_seed(0)
    config = _moe_config(kind)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", list(FAMILIES) + ["mixtral", "jetmoe", "dbrx"])
def test_tuple_output_matches_unpatched_place_by_place(family):
    # A MoE model with router logits returns (loss, aux_loss, logits, ..., router_logits): the
    # patched tuple keeps that order (it once put the logits second, where the unpatched model
    # has the aux_loss).
    model = tiny_model(family) if family in FAMILIES else _tiny_moe(family)
    ids, mask, labels = batch()
    model.eval()
    with torch.no_grad():
        ref = model(ids, mask, labels=labels, use_cache=False, return_dict=False)
        flce.patch(model)
        got = model(ids, mask, labels=labels, use_cache=False, return_dict=False,
                    return_logits=True)
        _tuple_places_equal(got, ref, family)
        # without the logits (training's default) their place is kept, None
        got = model(ids, mask, labels=labels, use_cache=False, return_dict=False,
                    return_logits=False)
        logits_at = next(i for i, r in enumerate(ref) if isinstance(r, torch.Tensor)
                         and r.shape == (*ids.shape, VOCAB))
        assert got[logits_at] is None
        _tuple_places_equal(got[:logits_at] + got[logits_at + 1:],
                            ref[:logits_at] + ref[logits_at + 1:], family + " no logits")


def test_tied_embeddings_share_the_gradient():
    model = flce.patch(tiny_model("llama-tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    g_patched = model.lm_head.weight.grad.clone()
    model.zero_grad()
    flce.unpatch(model)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.testing.assert_close(g_patched, model.lm_head.weight.grad, rtol=1e-5, atol=1e-7)


def test_logits_only_when_asked_and_inference_unchanged():
    model = tiny_model("gemma2")
    ids, mask, labels = batch()
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels)
        ref_gen = model.generate(ids[:, :5], attention_mask=mask[:, :5], max_new_tokens=4,
                                 do_sample=False)
    flce.patch(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)  # eval: logits kept
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
        assert model(input_ids=ids, labels=labels, return_logits=False).logits is None
        no_labels = model(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(no_labels.logits, ref.logits, rtol=0, atol=0)
        gen = model.generate(ids[:, :5], attention_mask=mask[:, :5], max_new_tokens=4,
                             do_sample=False)
    assert torch.equal(gen, ref_gen)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and out.loss.requires_grad
    out = model(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    tup = model(ids, mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0
    torch.testing.assert_close(tup[0], ref.loss, rtol=1e-5, atol=0)
    # the unpatched tuple's places: (loss, logits, cache), the logits None in training
    assert tup[1] is None and len(tup) == len(ref.to_tuple())
    tup = model(ids, mask, labels=labels, return_dict=False, return_logits=True)
    torch.testing.assert_close(tup[1], ref.logits, rtol=0, atol=0)


def test_logits_to_keep_and_shift_labels():
    model = tiny_model("qwen3")
    ids, mask, labels = batch(seq=14)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    flce.patch(model)
    shifted = _shifted(labels)
    for keep, rows in ((4, slice(-4, None)), (torch.tensor([1, 5, 9]), [1, 5, 9])):
        want = reference.logits_cross_entropy(logits[:, rows].reshape(-1, VOCAB),
                                              shifted[:, rows].reshape(-1))
        got = model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=keep).loss
        assert abs(got.item() - want.item()) < 1e-5 * abs(want.item()), keep
    # Pre-shifted labels (context parallelism) are used as given.
    other = torch.roll(shifted, 1, dims=1)
    want = reference.logits_cross_entropy(logits.reshape(-1, VOCAB), other.reshape(-1))
    got = model(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=other).loss
    assert abs(got.item() - want.item()) < 1e-5 * abs(want.item())
    with pytest.raises(ValueError, match="labels of shape"):
        model(input_ids=ids, labels=labels[:, :5])


def test_patch_class_string_context_manager_and_unpatch():
    cls = transformers.LlamaForCausalLM
    original = cls.forward
    ids, mask, labels = batch()
    model = tiny_model("llama")
    with flce.patched(model) as m:
        assert m is model and m(input_ids=ids, labels=labels).logits is None
    assert model(input_ids=ids, labels=labels).logits is not None
    try:
        assert flce.patch("llama") is cls and cls.forward is not original
        model = tiny_model("llama")  # built after patching the class
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits is None
        flce.unpatch("llama")
        assert cls.forward is original
        ref = model(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
        with flce.patched(cls):
            assert model(input_ids=ids, labels=labels).logits is None
        assert cls.forward is original
    finally:
        flce.unpatch(cls)


def test_patching_again_sets_return_logits_and_class_patches_check_instances():
    ids, mask, labels = batch()
    model = flce.patch(tiny_model("llama"), return_logits=True)
    assert model(input_ids=ids, labels=labels).logits is not None
    flce.patch(model, return_logits=False)  # (ignored before: the first setting stayed)
    assert model(input_ids=ids, labels=labels).logits is None
    with flce.patched(model, return_logits=True):
        assert model(input_ids=ids, labels=labels).logits is not None
    assert model(input_ids=ids, labels=labels).logits is None  # (the setting before the block)
    flce.unpatch(model)
    cls = transformers.LlamaForCausalLM
    try:
        flce.patch(cls)
        # an instance the instance patch would refuse (its own loss_function) is refused here too
        odd = tiny_model("llama")
        odd.loss_function = lambda *a, **k: torch.zeros(())
        with pytest.raises(TypeError, match="loss_function"):
            odd(input_ids=ids, labels=labels)
        model = tiny_model("llama")
        flce.patch(model, return_logits=True)  # the instance's setting, over its class's
        assert model(input_ids=ids, labels=labels).logits is not None
        with pytest.raises(ValueError, match="unpatch the class"):
            flce.unpatch(model)
    finally:
        flce.unpatch(cls)


def test_a_copy_of_a_patched_model_is_patched_and_independent():
    model = flce.patch(tiny_model("llama"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)
    ids, mask, labels = batch()
    got = [m(input_ids=ids, attention_mask=mask, labels=labels) for m in (model, twin)]
    assert got[0].logits is None and got[1].logits is None
    flce.unpatch(model)
    flce.unpatch(twin)
    for m, out in zip((model, twin), got):
        ref = m(input_ids=ids, attention_mask=mask, labels=labels)
        assert ref.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)


def test_unsupported_models_get_clear_errors():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=VOCAB)
    with pytest.raises(TypeError, match="LlamaModel is not supported"):
        flce.patch(transformers.LlamaModel(config))
    with pytest.raises(TypeError, match="LlamaForSequenceClassification is not supported"):
        flce.patch(transformers.LlamaForSequenceClassification(config))
    with pytest.raises(ValueError, match="model type 'no-such-model'"):
        flce.patch("no-such-model")
    with pytest.raises(TypeError, match="expected a transformers causal-LM"):
        flce.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="return_logits"):
        flce.patch(tiny_model("llama"), return_logits="yes")
    model = tiny_model("llama")
    model.loss_function = lambda *a, **k: None
    with pytest.raises(TypeError, match="ForCausalLMLoss"):
        flce.patch(model)


class _DoubledLogits(transformers.LlamaForCausalLM):
    """A model that changes its logits in a way no config attribute describes."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits * 2
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out


def test_unknown_logit_transform_is_refused_not_dropped():
    model = tiny_model("llama")
    model = _DoubledLogits(model.config)
    flce.patch(model)
    ids, mask, labels = batch()
    with pytest.raises(RuntimeError, match="changes them in a way flce does not reproduce"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


def test_unknown_logit_transform_is_refused_in_eval_too():
    # The first call may keep its logits (eval mode, return_logits=True): they are checked
    # there, rather than an evaluation before the first training step reporting another loss.
    for call in (lambda m, *a: m.eval()(input_ids=a[0], attention_mask=a[1], labels=a[2]),
                 lambda m, *a: m(input_ids=a[0], attention_mask=a[1], labels=a[2],
                                 return_logits=True)):
        model = flce.patch(_DoubledLogits(tiny_model("llama").config))
        with pytest.raises(RuntimeError, match="changes them in a way flce does not reproduce"):
            call(model, *batch())


def test_models_with_their_own_loss_are_refused():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, decoder_layers=1,
                                     encoder_layers=1, decoder_attention_heads=2,
                                     encoder_attention_heads=2, decoder_ffn_dim=64,
                                     encoder_ffn_dim=64)
    with pytest.raises(TypeError, match="BartForCausalLM is not supported: its forward computes"):
        flce.patch(transformers.BartForCausalLM(config))


def _train(model, steps, corpus):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids = corpus[step % len(corpus)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


def test_short_training_run_follows_the_unpatched_curve():
    # A synthetic corpus with structure to learn: arithmetic progressions of token ids.
    g = torch.Generator().manual_seed(4)
    starts = torch.randint(3, VOCAB, (8, 4, 1), generator=g)
    steps_ = torch.randint(1, 4, (8, 4, 1), generator=g)
    corpus = 3 + (starts + steps_ * torch.arange(16)) % (VOCAB - 3)
    base = tiny_model("llama-tied")
    ref = _train(copy.deepcopy(base), 40, corpus)
    got = _train(flce.patch(copy.deepcopy(base)), 40, corpus)
    assert ref[-5:].mean() < 0.7 * ref[:5].mean()  # it learns
    # Measured: 2e-6 apart after 40 AdamW steps (fp32 summation order only).
    assert (got - ref).abs().max() < 1e-5 * ref.max(), (got - ref).abs().max()


def test_autocast_bf16_with_fp32_master_weights():
    model = tiny_model("llama")
    model64 = copy.deepcopy(model).double()
    ids, mask, labels = batch()
    oracle = _oracle_loss(model64, ids, mask, labels) / (_shifted(labels) != -100).sum()
    oracle.backward()
    g64 = model64.lm_head.weight.grad
    results = {}
    for name in ("unpatched", "patched"):
        if name == "patched":
            flce.patch(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert out.loss.dtype == torch.float32
        assert model.lm_head.weight.grad.dtype == torch.float32
        results[name] = (out.loss.item(), model.lm_head.weight.grad.double())
        model.zero_grad()
    for name, (loss, grad) in results.items():
        # bf16 rounding of the hidden states and weights (2^-8) bounds both paths.
        assert abs(loss - oracle.item()) < 2 ** -7 * abs(oracle.item()), name
        assert (grad - g64).norm() < 2 ** -6 * g64.norm(), name
    err = {n: abs(l - oracle.item()) for n, (l, _) in results.items()}
    assert err["patched"] <= 2 * err["unpatched"] + 4 * FP32 * abs(oracle.item()), err


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids, mask, labels = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    ref_grads = _grads(model)
    compiled = torch.compile(flce.patch(model), backend="aot_eager", fullgraph=True)
    out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_trainer_with_gradient_accumulation(tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (16, 12), generator=g)
    labels = ids.clone()
    labels[::3, :4] = -100  # uneven token counts: num_items_in_batch matters
    data = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]

    def train(patch):
        model = tiny_model("gemma2")
        if patch:
            flce.patch(model)
        args = transformers.TrainingArguments(
            str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=4, logging_steps=1, learning_rate=1e-3, use_cpu=True, save_strategy="no",
            report_to=[], disable_tqdm=True, seed=0, data_seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

    ref, ref_model = train(False)
    got, model = train(True)
    assert len(ref) == 4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    # Adam turns fp32 rounding of near-zero gradients into O(lr) steps: allow 1% of one step.
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-2 * 1e-3)
