"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer with flce (``flce.integrations.trl.patch()``).

Each trainer trains a tiny random Llama (tests/hf_models.py) for a few steps on the CPU twice,
from the same initialization and data: with TRL's own chunked log-probability kernel and with
flce in its place. The logged losses and metrics (SFT: entropy and mean token accuracy; DPO:
rewards, log-probabilities, mean logits, accuracy; GRPO: entropy, KL, reward) must agree to
fp32 rounding, and flce must have computed them (its calls are counted). In fp32
(``bf16=False``): TRL's configs default to bf16 autocast, under which TRL's kernel rounds its
logit tiles to bf16 where flce keeps fp32 accumulators (a difference of bf16 rounding, 1e-3 of
a log-probability here, not the subject of these tests).

Tolerance: both kernels compute the same fp32 log-probabilities from the same weights, by
different reductions (flce's collapse-safe ``softplus(lse_{j != t} - z_t)``, TRL's
``z_t - lse``), so each per-token value differs by a few units of fp32 roundoff of the logits
(|z| of a few units here: ~1e-6 absolute). A logged loss is a mean of such values; Adam turns
rounding-level gradient differences into weight differences of at most ~lr x 1e-6 relative per
step. So after 3 steps the logged values agree to ~1e-6 relative (measured: at most 1.2e-6,
DPO's loss at step 2; entropies 1.4e-7); the tests allow 1e-5 relative with a 1e-6 absolute
floor (metrics near 0, such as DPO's rewards and mean logits: 1.7e-8 apart measured). A loss
off by 0.01% breaks it.
"""
import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="TRL not installed (requirements-test.txt pins it)")
pytest.importorskip("datasets")

import datasets  # noqa: E402
import transformers  # noqa: E402
from hf_models import VOCAB, tiny_model  # noqa: E402

import flce  # noqa: E402
import flce.integrations.trl as flce_trl  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, ATOL = 1e-5, 1e-6


def _tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary: word ``w{i}`` is token ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    del vocab["w0"], vocab["w1"], vocab["w2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")


def _words(g, n):
    return " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())


def _common_args(tmp_path):
    return dict(output_dir=str(tmp_path), learning_rate=1e-3, logging_steps=1, use_cpu=True,
                report_to=[], save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
                bf16=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama saved, for the trainers that load a reference model from the policy's
    path (DPO, GRPO with a KL term)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(str(path))
    return str(path)


@pytest.fixture
def counted(monkeypatch):
    """flce's kernel installed in TRL for the test, its calls counted."""
    calls = []
    op = flce_trl.linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return op(*args, **kwargs)

    monkeypatch.setattr(flce_trl, "linear_cross_entropy", counting)
    yield calls
    flce_trl.unpatch()


def _logged(trainer, keys):
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h[k] for h in rows] for k in keys}


def _compare(train, counted, keys, steps):
    ref = _logged(train(), keys)
    assert not counted
    flce_trl.patch()
    got = _logged(train(), keys)
    assert counted, "flce was not called"
    off = {}
    for k in keys:
        assert len(ref[k]) == len(got[k]) == steps, (k, ref[k], got[k])
        r, x = (torch.tensor(v, dtype=torch.float64) for v in (ref[k], got[k]))
        if not bool(((x - r).abs() <= ATOL + RTOL * r.abs()).all()):
            d = (x - r).abs()
            off[k] = f"max |diff| {d.max():.2e}, relative {(d / r.abs()).max():.2e}"
    assert not off, off
    # The bound can fail: a loss 0.01% off breaks it.
    r = torch.tensor(ref["loss"], dtype=torch.float64)
    assert not bool(((r * 1e-4).abs() <= ATOL + RTOL * r.abs()).all())
    return ref, got


def _reference(h, w, b, t, temperature, softcap, scale):
    """float64 per-token statistics of TRL's kernel, from materialized logits."""
    z = (h.double() @ w.double().T + (0 if b is None else b.double())) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, -1)
    top1 = z.argmax(-1) == t
    return (logp.gather(-1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1),
            torch.logsumexp(2 * logp, -1), z.mean(-1), top1)


@pytest.mark.parametrize("softcap,scale,temperature,bias", [
    (None, 1.0, 1.0, False), (3.0, 0.5, 0.7, True)])
def test_fused_log_probs_against_float64(softcap, scale, temperature, bias):
    g = torch.Generator().manual_seed(3)
    n, d, v = 24, 16, 300
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (0.5 * torch.randn(v, d, generator=g)).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    got = flce_trl.fused_log_probs(h, w, b, t, temperature, 4096, softcap, scale, outputs)
    ref = _reference(h, w, b, t, temperature, softcap, scale)
    # Each statistic within a few fp32 roundings of the logits' size (|z| < 16 here).
    floor = 16 * 2.0 ** -24
    for name, x, r in zip(outputs[:4], got, ref):
        assert x.dtype == torch.float32
        err = (x.double() - r).abs().max().item()
        assert err <= 8 * floor, (name, err)
    assert got[4].dtype == torch.bool and torch.equal(got[4], ref[4])
    # Gradients of a loss that uses both differentiable outputs, as GRPO's entropy bonus does.
    params = [p for p in (h, w, b) if p is not None]
    mix = torch.randn(n, generator=g)
    grads = torch.autograd.grad((got[0] * mix).sum() + 0.3 * got[1].sum(), params)
    ref64 = [p.detach().double().requires_grad_() for p in params]
    r = _reference(*ref64[:2], ref64[2] if bias else None, t, temperature, softcap, scale)
    grads64 = torch.autograd.grad((r[0] * mix.double()).sum() + 0.3 * r[1].sum(), ref64)
    for x, r in zip(grads, grads64):
        assert ((x.double() - r).norm() / r.norm()).item() < 1e-5


def test_log_probs_do_not_collapse():
    # A confident prediction (margin 30): log p_t = -log(1 + 3 exp(-30)) ~ -2.8e-13. TRL's
    # kernel, z_t - lse, rounds it to 0, as F.cross_entropy does; flce keeps it.
    from trl.kernels import ChunkedLogProbFunction

    w = torch.zeros(4, 2)
    w[0, 0] = 1.0
    h = torch.tensor([[30.0, 0.0]])
    t = torch.tensor([0])
    exact = -3 * torch.exp(torch.tensor(-30.0, dtype=torch.float64))
    got = flce_trl.fused_log_probs(h, w, None, t, 1.0, 4096)[0]
    assert abs(got.double().item() - exact.item()) <= 1e-6 * abs(exact.item())
    assert ChunkedLogProbFunction.apply(h, w, None, t, 1.0, 4096)[0].item() == 0.0


def test_patch_unpatch_and_a_kernel_it_does_not_know(monkeypatch):
    import trl.trainer.utils as utils

    own = utils._ChunkedLogProbFunction
    try:
        flce_trl.patch()
        flce_trl.patch()  # idempotent
        assert utils._ChunkedLogProbFunction is not own
        flce_trl.unpatch()
        assert utils._ChunkedLogProbFunction is own
        flce_trl.unpatch()  # and again: nothing to undo
        assert utils._ChunkedLogProbFunction is own

        class Other(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, targets):
                return hidden

        monkeypatch.setattr(utils, "_ChunkedLogProbFunction", Other)
        with pytest.raises(RuntimeError, match="kernel takes"):
            flce_trl.patch()
        assert utils._ChunkedLogProbFunction is Other
    finally:
        flce_trl.unpatch()
    with pytest.raises(ValueError, match="unknown outputs"):
        flce_trl.fused_log_probs(torch.randn(2, 4), torch.randn(3, 4), None,
                                 torch.tensor([0, 1]), 1.0, 64, outputs=("log_probs", "lse"))


def test_sft_trainer(tmp_path, counted):
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({
        "prompt": [_words(g, 3 + i % 4) for i in range(8)],
        "completion": [_words(g, 4 + i % 5) for i in range(8)]})

    def train(patch_model=False):
        args = trl.SFTConfig(**_common_args(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_length=32)
        model = tiny_model("llama")
        if patch_model:
            flce.patch(model)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data,
                                 processing_class=_tokenizer())
        trainer.train()
        return trainer

    keys = ["loss", "entropy", "mean_token_accuracy"]
    ref, _ = _compare(train, counted, keys, 3)
    assert all(0 < e for e in ref["entropy"]), ref
    # flce.patch(model) is bypassed by TRL's fused head (docs/integrations.md): with TRL's own
    # kernel, a patched model trains exactly as an unpatched one.
    flce_trl.unpatch()
    assert _logged(train(patch_model=True), keys) == ref


def test_dpo_trainer(tmp_path, counted, model_dir):
    g = torch.Generator().manual_seed(1)
    data = datasets.Dataset.from_dict({
        "prompt": [_words(g, 3 + i % 3) for i in range(8)],
        "chosen": [_words(g, 3 + i % 4) for i in range(8)],
        "rejected": [_words(g, 2 + i % 5) for i in range(8)]})

    def train():
        args = trl.DPOConfig(**_common_args(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_length=32, beta=0.5)
        trainer = trl.DPOTrainer(model=model_dir, args=args, train_dataset=data,
                                 processing_class=_tokenizer())
        trainer.train()
        return trainer

    keys = ["loss", "entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected",
            "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/margins"]
    ref, _ = _compare(train, counted, keys, 3)
    # It trains: the policy leaves the reference (rewards nonzero after the first step).
    assert ref["rewards/margins"][0] == 0 and ref["rewards/margins"][-1] != 0, ref


def test_grpo_trainer(tmp_path, counted, model_dir):
    g = torch.Generator().manual_seed(2)
    data = datasets.Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(8)]})

    def distinct_words(completions, **kwargs):
        return [float(len(set(c.split()))) for c in completions]

    def train():
        args = trl.GRPOConfig(**_common_args(tmp_path), max_steps=2, per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=8, beta=0.1,
                              temperature=0.9)
        trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=distinct_words,
                                  args=args, train_dataset=data, processing_class=_tokenizer())
        trainer.train()
        return trainer

    keys = ["loss", "entropy", "kl", "reward"]
    ref, _ = _compare(train, counted, keys, 2)
    assert all(0 < e for e in ref["entropy"]), ref
