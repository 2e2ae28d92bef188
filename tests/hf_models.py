"""Tiny randomly initialized transformers causal LMs for the integration tests (no hub access)."""
import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 320
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Softcaps small enough that dropping them changes the loss by far more than the tolerance.
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
    "gemma2": ("gemma2", dict(final_logit_softcapping=1.5, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(final_logit_softcapping=1.5, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),
    # Logit scales the model applies after its head.
    "cohere": ("cohere", dict(logit_scale=0.5, tie_word_embeddings=True)),
    "granite": ("granite", dict(logits_scaling=0.5, tie_word_embeddings=False)),
}


def tiny_model(family="llama", seed=0, **overrides):
    model_type, extra = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Logits of a few units, so the softcap and the loss's details matter.
        model.get_output_embeddings().weight.normal_(0.0, 0.4)
    return model


def batch(batch_size=2, seq=12, seed=1, pad=3):
    """Token ids, an attention mask with right padding, and labels -100 on padding and prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, seq - pad:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[1, :pad] = -100
    return ids, mask, labels
