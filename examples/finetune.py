"""Fine-tuning steps of a small Llama-style model with and without flce.

Builds the model from a config (no downloads), runs a few AdamW steps on a synthetic corpus with
the stock transformers loss and with ``flce.patch(model)``, and prints the loss, the peak memory
of a step and its time. Each variant runs in its own process so the peak memory is its own.

    python examples/finetune.py                  # CPU unless CUDA is available, 1-2 min on 2 cores
    python examples/finetune.py --vocab 128000 --seq 1024 --autocast   # a larger, bf16 run
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda where available")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=128, help="model width (64 per head)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast, fp32 master weights")
    p.add_argument("--variant", choices=("transformers", "flce"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(args):
    import transformers

    import flce

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(device)
    if args.variant == "flce":
        flce.patch(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    corpus = torch.randint(0, args.vocab, (args.steps + 1, args.batch, args.seq), device=device)

    def step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.item()

    step(corpus[0])  # warm-up: optimizer state, allocator, kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    losses, times = [], []
    for ids in corpus[1:]:
        t0 = time.perf_counter()
        losses.append(step(ids))  # .item() synchronizes
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        # ru_maxrss (KiB on Linux) is the process's peak; the warm-up already reached the
        # steady state, so the excess over the resident set before the timed steps is theirs.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return dict(losses=losses, time=sorted(times)[len(times) // 2], peak=max(peak, 0))


def main():
    args = parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    n = args.batch * args.seq
    print(f"Llama-style model: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; "
          f"{n} tokens per step on {args.device}"
          f"{' (bf16 autocast)' if args.autocast else ''}; fp32 logits would take "
          f"{n * args.vocab * 4 / 2**20:.0f} MiB"
          f"{'; the defaults take 1-2 min on a 2-core CPU' if args.device == 'cpu' else ''}",
          flush=True)
    results = {}
    for variant in ("transformers", "flce"):
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--variant", variant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = r = json.loads(out.strip().splitlines()[-1])
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{variant:>12}: loss {losses} | step {r['time'] * 1e3:7.1f} ms (median) | "
              f"peak memory over steady state {r['peak'] / 2**20:7.1f} MiB")
    ref, got = results["transformers"], results["flce"]
    # The load average beside the time ratio: on a shared machine it says whether the ratio
    # measured the code or the neighbours.
    print(f"flce / transformers: time {got['time'] / ref['time']:.2f}x (load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores), peak memory "
          f"{got['peak'] / max(ref['peak'], 1):.2f}x; largest loss difference "
          f"{max(abs(a - b) for a, b in zip(got['losses'], ref['losses'])):.1e}")


if __name__ == "__main__":
    main()
