"""A GRPO/PPO-style policy loss with flce's per-token log-probabilities and entropy.

A tiny policy (an embedding, one MLP block and an lm_head) scores groups of sampled completions:
the per-token log-probability of each sampled token at temperature T is ``-loss`` of
``flce.linear_cross_entropy(..., reduction="none", temperature=T)`` and the entropy bonus comes
from ``return_entropy=True``, with the [tokens, V] logits never materialized. The same loss is
computed by the usual logits-materializing code (``log_softmax(logits / T)``, ``-sum p log p``)
and the two are compared: loss and every parameter gradient.

    python examples/grpo.py              # CPU, a few seconds
    python examples/grpo.py --vocab 65536 --device cuda
"""
import argparse
import sys

import torch

import flce


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda where available")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=64, help="policy width")
    p.add_argument("--groups", type=int, default=4, help="prompts")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--length", type=int, default=32, help="tokens per completion")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus weight")
    p.add_argument("--seed", type=int, default=0, help="inputs, rewards and initialization")
    return p.parse_args(argv)


class Policy(torch.nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def hidden(self, tokens):
        h = self.embed(tokens)
        return h + self.mlp(h)


def token_stats_flce(policy, inputs, actions, mask, temperature):
    """Per-token log pi(a | s) and entropy from flce (fused, no [tokens, V] logits)."""
    h = policy.hidden(inputs)
    target = torch.where(mask, actions, torch.full_like(actions, -100))
    nll, entropy = flce.linear_cross_entropy(h, policy.lm_head.weight, target, reduction="none",
                                             temperature=temperature, return_entropy=True)
    return -nll, entropy


def token_stats_logits(policy, inputs, actions, mask, temperature):
    """The same from materialized logits, as RL trainers usually compute them."""
    logits = policy.lm_head(policy.hidden(inputs)).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(-1, actions[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(logprob)
    return torch.where(mask, logprob, zero), torch.where(mask, entropy, zero)


def grpo_loss(logprob, old_logprob, entropy, rewards, mask, clip, entropy_coef):
    """Clipped policy-gradient loss with group-normalized advantages and an entropy bonus."""
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1, 1)  # [groups * samples, 1], broadcast over tokens
    ratio = torch.exp(logprob - old_logprob)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    m = mask.to(pg.dtype)
    return ((pg - entropy_coef * entropy) * m).sum() / m.sum()


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    policy = Policy(args.vocab, args.hidden).to(dev)
    rows = args.groups * args.samples
    inputs = torch.randint(0, args.vocab, (rows, args.length), device=dev)
    actions = torch.roll(inputs, -1, dims=1)
    mask = torch.ones(rows, args.length, dtype=torch.bool, device=dev)
    mask[:, -1] = False  # no action after the last token
    mask[::3, args.length // 2:] = False  # shorter completions
    rewards = torch.randn(args.groups, args.samples, device=dev)
    with torch.no_grad():  # rollout scoring of the behaviour policy: no tensors saved
        old_logprob, _ = token_stats_flce(policy, inputs, actions, mask, args.temperature)
        old_logprob = old_logprob + 0.05 * torch.randn_like(old_logprob) * mask

    results = {}
    for name, stats in (("flce", token_stats_flce), ("logits", token_stats_logits)):
        policy.zero_grad(set_to_none=True)
        logprob, entropy = stats(policy, inputs, actions, mask, args.temperature)
        loss = grpo_loss(logprob, old_logprob, entropy, rewards, mask, args.clip,
                         args.entropy_coef)
        loss.backward()
        results[name] = (loss.detach(), logprob.detach(), entropy.detach(),
                         {k: p.grad.detach().clone() for k, p in policy.named_parameters()})
    (lf, pf, ef, gf), (ll, pl, el, gl) = results["flce"], results["logits"]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    print(f"GRPO loss: flce {lf.item():.8f}, logits {ll.item():.8f} (rel diff {rel(lf, ll):.2e})")
    print(f"per-token log-prob rel diff {rel(pf, pl):.2e}, entropy rel diff {rel(ef, el):.2e}")
    worst = max(rel(gf[k], gl[k]) for k in gf)
    for k in gf:
        print(f"  grad {k:<16} rel diff {rel(gf[k], gl[k]):.2e}")
    ok = rel(lf, ll) < 1e-5 and rel(pf, pl) < 1e-5 and rel(ef, el) < 1e-4 and worst < 1e-4
    print("agree" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
