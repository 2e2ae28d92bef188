"""Distil a small Llama-style teacher into a smaller student, with the stock loss and with
flce.linear_distillation.

The data, tokenizer and models are examples/train_lm.py's (the standard library's ``.py``
sources, a byte-level BPE tokenizer trained on them, transformers' LlamaForCausalLM from a
config: nothing downloaded). The teacher is trained first for ``--teacher-steps`` with
transformers' own loss, then frozen. The student is then trained twice from the same seeded
initialization on the same batches in the same order, on the divergence between the two models'
next-token distributions alone: once with the stock recipe (both ``[tokens, vocab]`` logits
materialized, ``log_softmax`` of each, ``F.kl_div`` as TRL's ``generalized_jsd_loss`` computes
it), once with ``flce.linear_distillation`` on the two models' final hidden states and
classifiers (the logits never held whole, every log-probability taken from its row's largest
logit). The two curves differ by rounding alone; the step's peak memory and time are logged.

    pip install -r requirements-examples.txt             # tokenizers, transformers, matplotlib
    python examples/distill.py --quick                   # under a minute on 2 CPU cores
    python examples/distill.py                           # 200 + 200 steps, generalized JSD
    python examples/distill.py --divergence forward_kl

Outputs go to ``--out-dir`` (``distill_out/`` under the working directory): ``distill.jsonl``
(one record per student run, appended; the teacher's curve in each) and ``distill.png`` (the
teacher's curve, both students' and their relative difference).

Peak memory is train_lm.py's (``StepPeak``): what one student step allocates on top of the
models, the optimizer's state and the batch. The teacher's forward is part of the step (run
under ``torch.no_grad()``, as a frozen teacher's is).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_lm  # noqa: E402  (its corpus, tokenizer, model, memory probe and record fields)

VARIANTS = ("stock", "flce")
DIVERGENCES = ("jsd", "forward_kl")
# --quick: under a minute on 2 shared CPU cores (30 s of CPU time), 1 thread (train_lm.py's
# reason). Flags given explicitly override these.
QUICK = dict(teacher_steps=40, steps=20, vocab=2048, teacher_hidden=128, teacher_layers=2,
             hidden=64, layers=1, seq=64, corpus_mb=0.3, threads=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=train_lm._Help)
    p.add_argument("--quick", action="store_true",
                   help="a run of under a minute on 2 CPU cores: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"), help="cuda where available")
    p.add_argument("--teacher-steps", type=int, default=200,
                   help="the teacher's training steps (transformers' loss)")
    p.add_argument("--steps", type=int, default=200, help="distillation steps per student run")
    p.add_argument("--divergence", default="jsd", choices=DIVERGENCES,
                   help="jsd: the generalized Jensen-Shannon divergence at --beta (TRL's "
                        "generalized_jsd_loss); forward_kl: KL(teacher || student)")
    p.add_argument("--beta", type=float, default=0.5, help="jsd's beta")
    p.add_argument("--vocab", type=int, default=8192, help="the BPE tokenizer's vocabulary")
    p.add_argument("--teacher-hidden", type=int, default=256, help="the teacher's width")
    p.add_argument("--teacher-layers", type=int, default=4, help="the teacher's decoder layers")
    p.add_argument("--hidden", type=int, default=128, help="the student's width (64 per head)")
    p.add_argument("--layers", type=int, default=2, help="the student's decoder layers")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (both models)")
    p.add_argument("--seed", type=int, default=0, help="initializations and batch order")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    p.add_argument("--corpus-mb", type=float, default=4.0,
                   help="MB of standard-library source to train the tokenizer on and to tokenize")
    p.add_argument("--out-dir", default="distill_out",
                   help="where --out and --png go unless given (relative to the working "
                        "directory)")
    p.add_argument("--out", help="JSON-lines file the run records are appended to "
                                 "(default: OUT_DIR/distill.jsonl)")
    p.add_argument("--png", help="the curves, '' for none (default: OUT_DIR/distill.png)")
    args = p.parse_args(argv)
    if args.quick:
        # Reparsed with --quick's values as the defaults, so that explicit flags still win.
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(args.out_dir, "distill.jsonl")
    if args.png is None:
        args.png = os.path.join(args.out_dir, "distill.png")
    for name in ("teacher_steps", "steps", "vocab", "teacher_hidden", "teacher_layers",
                 "hidden", "layers", "batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("hidden", "teacher_hidden"):
        if getattr(args, name) % 64:
            p.error(f"--{name.replace('_', '-')} must be a multiple of 64 (the head size)")
    if not 0.0 <= args.beta <= 1.0:
        p.error("--beta must be in [0, 1]")
    return args


def stock_divergence(z_s, z_t, beta=0.5):
    """The usual recipe on logits ``[tokens, V]``, per token (TRL's ``generalized_jsd_loss``;
    Liger's chunked loss per chunk): fp32 ``log_softmax`` of both, forward KL
    ``KL(teacher || student)`` at beta 0, reverse at 1, otherwise the mixture ``M = beta T +
    (1 - beta) S`` by ``logsumexp`` and ``F.kl_div(log_target=True)`` against it.
    (benchmarks/run.py distill times it as its eager peer.)"""
    log_s = F.log_softmax(z_s.float(), dim=-1)
    log_t = F.log_softmax(z_t.float(), dim=-1)
    if beta == 0:
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta),
                                         log_t + math.log(beta)]), dim=0)
    return (beta * F.kl_div(log_m, log_t, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(log_m, log_s, reduction="none", log_target=True)).sum(-1)


def train_teacher(data, args, device, log=None):
    """The teacher trained with transformers' loss on ``data``; returns it (frozen, eval mode)
    and its per-step losses."""
    teacher = train_lm.build_model(args.vocab, args.teacher_hidden, args.teacher_layers,
                                   args.seq, args.seed + 1, device)
    opt = torch.optim.AdamW(teacher.parameters(), lr=args.lr, weight_decay=0.1)
    losses = []
    for k, ids in enumerate(data):
        ids = ids.to(device)
        loss = teacher(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log is not None:
            log(k, losses[-1])
    teacher.eval().requires_grad_(False)
    return teacher, losses


def distill(teacher, data, args, variant, device, log=None):
    """A student from a fresh seeded initialization trained on the divergence from
    ``teacher`` with ``variant``'s loss; per-step losses, times and peak memory."""
    import flce

    student = train_lm.build_model(args.vocab, args.hidden, args.layers, args.seq, args.seed,
                                   device)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.1)
    d_s, d_t = args.hidden, args.teacher_hidden
    losses, times, peaks = [], [], []
    for k, ids in enumerate(data):
        ids = ids.to(device)
        with train_lm.StepPeak(device) as mem:
            start = time.perf_counter()
            with torch.no_grad():
                h_t = teacher.model(input_ids=ids).last_hidden_state.reshape(-1, d_t)
            h_s = student.model(input_ids=ids).last_hidden_state.reshape(-1, d_s)
            if variant == "flce":
                loss = flce.linear_distillation(h_s, student.lm_head.weight, h_t,
                                                teacher.lm_head.weight,
                                                divergence=args.divergence, beta=args.beta)
            else:
                with torch.no_grad():
                    z_t = teacher.lm_head(h_t)
                beta = args.beta if args.divergence == "jsd" else 0.0
                loss = stock_divergence(student.lm_head(h_s), z_t, beta).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
            del loss
        peaks.append(mem.peak)
        if log is not None:
            log(k, losses[-1], times[-1], mem.peak)
    return {"losses": losses, "step_s": times, "peak_bytes": peaks}


def plot(records, path):
    """The teacher's curve, the two students' and their relative difference, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["variant"]: r for r in records}
    r0 = records[0]
    fig, (ax_t, ax_s, ax_d) = plt.subplots(1, 3, figsize=(16, 4.8))
    ax_t.plot(range(1, len(r0["teacher_losses"]) + 1), r0["teacher_losses"], color="0.3")
    ax_t.set_title(f"the teacher ({r0['config']['teacher_layers']} layers, hidden "
                   f"{r0['config']['teacher_hidden']}), transformers' loss", fontsize=9)
    ax_t.set_ylabel("cross-entropy (nats/token)")
    for variant, style, name in (("stock", dict(color="C0", lw=2.5, alpha=0.6),
                                  "log_softmax + F.kl_div"),
                                 ("flce", dict(color="C3", lw=1, ls="--"),
                                  "flce.linear_distillation")):
        if variant in runs:
            r = runs[variant]
            ax_s.plot(range(1, len(r["losses"]) + 1), r["losses"], **style,
                      label=f"{name}: {r['step_s_median'] * 1e3:.0f} ms/step, step peak "
                            f"{r['peak_mb']:.0f} MB")
    c = r0["config"]
    ax_s.set_title(f"the student ({c['layers']} layers, hidden {c['hidden']}): "
                   f"{c['divergence']}" + (f", beta {c['beta']:g}" if c["divergence"] == "jsd"
                                           else ""), fontsize=9)
    ax_s.set_ylabel("divergence from the teacher (nats/token)")
    ax_s.legend(fontsize=8)
    if set(VARIANTS) <= set(runs):
        rel = [abs(a - b) / abs(a) for a, b in zip(runs["stock"]["losses"],
                                                      runs["flce"]["losses"])]
        steps = [k + 1 for k, x in enumerate(rel) if x > 0]
        ax_d.semilogy(steps, [x for x in rel if x > 0], ".", color="k", ms=3,
                      label="|flce - stock| / stock")
        ax_d.axhline(2.0 ** -24, color="0.5", lw=0.8, ls=":", label="fp32 unit roundoff 2^-24")
        ax_d.legend(fontsize=8)
        ax_d.set_title("the two students' relative difference (0: not drawn)", fontsize=9)
    for ax in (ax_t, ax_s, ax_d):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"Distillation on Python stdlib sources, vocabulary {c['vocab']}, "
                 f"{c['batch']}x{c['seq']} tokens/step, fp32\n{r0['device']}, {r0['date']}, "
                 f"commit {r0['commit']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ids, args.vocab, took = train_lm.prepare_tokens(args)
    print(f"corpus: {ids.numel()} tokens from {args.corpus_mb:g} MB of stdlib sources, BPE "
          f"vocabulary {args.vocab} ({took:.1f} s); {train_lm.load_note()}", flush=True)

    def log_teacher(k, loss):
        if k % 50 == 0 or k == args.teacher_steps - 1:
            print(f"  teacher step {k:4d}: loss {loss:.4f}", flush=True)

    teacher, teacher_losses = train_teacher(
        train_lm.batches(ids, args.teacher_steps, args.batch, args.seq, args.seed + 1), args,
        device, log_teacher)
    data = train_lm.batches(ids, args.steps, args.batch, args.seq, args.seed)
    env = train_lm.environment(device)
    config = {k: getattr(args, k) for k in (
        "teacher_steps", "steps", "divergence", "beta", "vocab", "teacher_hidden",
        "teacher_layers", "hidden", "layers", "batch", "seq", "lr", "seed")}
    records = []
    for variant in VARIANTS:
        def log(k, loss, dt, peak):
            if k % 50 == 0 or k == args.steps - 1:
                mem = "" if peak is None else f", step peak {peak / 2 ** 20:.0f} MB"
                print(f"  {variant} step {k:4d}: divergence {loss:.6f}, {dt * 1e3:.0f} ms{mem}",
                      flush=True)

        load = os.getloadavg()[0]
        run = distill(teacher, data, args, variant, device, log)
        later = run["step_s"][1:] or run["step_s"]
        peaks = [p for p in run["peak_bytes"][1:] if p is not None]
        records.append({"op": "distill", **env, "loadavg": load, "variant": variant,
                        "config": config, "teacher_losses": teacher_losses,
                        "step_s_median": statistics.median(later),
                        "peak_mb": max(peaks) / 2 ** 20 if peaks else None, **run})
    stock, got = records
    rel = [abs(a - b) / abs(a) for a, b in zip(stock["losses"], got["losses"])]
    mem = (f"flce's step peak {got['peak_mb'] / stock['peak_mb']:.2f}x, "
           if got["peak_mb"] and stock["peak_mb"] else "")
    print(f"|flce - stock| / stock: step 1 {rel[0]:.1e}, max {max(rel):.1e}; divergence "
          f"{stock['losses'][0]:.4f} -> {stock['losses'][-1]:.4f}; {mem}its step time "
          f"{got['step_s_median'] / stock['step_s_median']:.2f}x the stock loss's "
          f"({train_lm.load_note()})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        print(f"appended {len(records)} records to {args.out}")
    if args.png:
        plot(records, args.png)
        print(f"wrote {args.png}")
    return records


if __name__ == "__main__":
    main()
