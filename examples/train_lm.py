"""Train a small Llama-style model on real text with the stock loss and with flce.patch.

The model is transformers' LlamaForCausalLM from a config (random init, nothing downloaded); the
text is the Python standard library's own ``.py`` sources on this machine (found through
``sysconfig``), tokenized by a byte-level BPE tokenizer trained on them in seconds with
``tokenizers``. Each run trains the same model from the same initialization on the same batches in
the same order, once with transformers' loss and once after ``flce.patch(model)``, in fp32 and
under bf16 autocast, and logs per step the loss, the step time and the step's peak memory. It
writes one JSON record per run (variant, dtype) and a PNG of the loss curves.

Under bf16 autocast (CPU or CUDA) the stock head's GEMM runs in bf16 and returns bf16 logits,
which transformers' loss upcasts to fp32; ``flce.patch`` casts the final hidden states to bf16
as autocast would and runs the fused op against the fp32 master weights, whose logits stay in
the GEMM's fp32 accumulators. The two bf16 curves therefore start apart by the rounding of the
stock loss's logits (2e-6 relative at the first step here), where the fp32 curves start equal.

    pip install -r requirements-examples.txt             # tokenizers, transformers, matplotlib
    python examples/train_lm.py --quick                  # about a minute on 2 CPU cores
    python examples/train_lm.py                          # 200 steps, fp32 and bf16
    python examples/train_lm.py --dtypes fp32 --control  # and the rounding yardstick (--control)

Outputs go to ``--out-dir`` (``train_lm_out/`` under the working directory): ``train_lm.jsonl``
(one record per run, appended) and ``train_lm.png``. ``--out`` and ``--png`` name other files;
refreshing the repository's record and the README's picture takes them explicitly
(docs/benchmarks.md).

Default model: 4 layers, hidden 256, 4 heads, MLP 1024, vocabulary 32000 (about 25M parameters,
16M of them in the embedding and the head), batch 4 x 128 tokens, AdamW at lr 1e-3. On the 2-core
AMD EPYC (Zen 4) of docs/benchmarks.md, shared with other jobs (load average 6-9), a step took
1.4-2.6 s on 1 thread, so one 200-step run takes 5-9 minutes there and the default's four runs
20-35 minutes (the estimate printed at start). Every run is a fresh process, so that a run's peak
memory is its own.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated()`` during the step minus the memory
allocated before it; on the CPU, the growth of the process's resident-set high-water mark during
the step (``/proc/self/clear_refs`` resets it, glibc's ``malloc_trim`` first hands freed pages
back). Either way it is what one training step (forward, backward, optimizer step, gradients set
to None between steps) allocates on top of the model, its optimizer state and the batch: the
activations, the gradients and, for the stock loss, the ``[tokens, vocab]`` logits, their fp32
copy and their gradient. The difference between the two variants is the loss head's.
"""
import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch

VARIANTS = ("transformers", "flce")
# The control: the stock loss again, from initial weights each moved by about one ulp (times
# 1 + 2^-23). Its distance from the unperturbed stock run is how far two runs that differ only by
# rounding drift apart, the yardstick for flce's distance from the stock run.
CONTROL = "transformers-nudged"
DTYPES = ("fp32", "bf16")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# --quick: a run of about a minute on 2 CPU cores (tokenizer, 2 runs of 40 steps), on 1 thread:
# a model this small gains nothing from a second thread, and on a shared machine two threads
# spin against each other (20x slower steps, measured at load average 8). Flags given
# explicitly override these.
QUICK = dict(steps=40, dtypes="fp32", vocab=4096, hidden=64, layers=2, seq=64, corpus_mb=1.0,
             threads=1)
# The estimate printed at start: a step costs about 6 x tokens x (the non-embedding parameters
# plus the head's V x D) flops, at the range of rates the default config reached on 1 thread of
# the 2-core EPYC of docs/benchmarks.md while shared with other jobs (1.4-2.6 s a step).
CPU_FLOPS_PER_S = (14e9, 27e9)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except a switch's False and a None whose help says what it means."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_Help)
    p.add_argument("--quick", action="store_true",
                   help="a run of about a minute on 2 CPU cores: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"), help="cuda where available")
    p.add_argument("--steps", type=int, default=200, help="training steps per run")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="comma list of fp32 (fp32 throughout) and bf16 (bf16 autocast, fp32 "
                        "master weights)")
    p.add_argument("--vocab", type=int, default=32000, help="the BPE tokenizer's vocabulary")
    p.add_argument("--hidden", type=int, default=256, help="model width (64 per head)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    p.add_argument("--corpus-mb", type=float, default=8.0,
                   help="MB of standard-library source to train the tokenizer on and to tokenize")
    p.add_argument("--out-dir", default="train_lm_out",
                   help="where --out and --png go unless given (relative to the working "
                        "directory)")
    p.add_argument("--out", help="JSON-lines file the run records are appended to "
                                 "(default: OUT_DIR/train_lm.jsonl)")
    p.add_argument("--png", help="the loss curves, '' for none (default: OUT_DIR/train_lm.png)")
    p.add_argument("--control", action="store_true",
                   help=f"also run the control ({CONTROL}): the stock loss from initial weights "
                        "moved by one ulp, to show how far rounding alone moves the curve")
    p.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        # Reparsed with --quick's values as the defaults, so that explicit flags still win.
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(args.out_dir, "train_lm.jsonl")
    if args.png is None:
        args.png = os.path.join(args.out_dir, "train_lm.png")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.control:
        args.variants.append(CONTROL)
    bad = [v for v in args.variants if v not in VARIANTS + (CONTROL,)]
    if bad:
        p.error(f"--variants: unknown {bad}")
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: unknown {bad}; choose from {DTYPES}")
    for name in ("steps", "vocab", "hidden", "layers", "batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.hidden % 64 and args.hidden >= 64:
        p.error("--hidden must be a multiple of 64 (the head size)")
    return args


# ---- data ----------------------------------------------------------------------------------

def stdlib_text(max_bytes):
    """The standard library's ``.py`` sources (no site-packages), in sorted order, up to
    ``max_bytes`` characters: real text that every Python installation has."""
    root = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError):
                continue
            parts.append(text)
            size += len(text)
            if size >= max_bytes:
                return "\n".join(parts)
    if not parts:
        raise RuntimeError(f"no .py sources found under the standard library at {root}")
    return "\n".join(parts)


def train_tokenizer(text, vocab):
    """A byte-level BPE tokenizer with ``vocab`` entries trained on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = text.splitlines(keepends=True)
    tok.train_from_iterator((lines[i:i + 1000] for i in range(0, len(lines), 1000)),
                            trainer=trainer)
    return tok


def tokenize(text, tok):
    lines = text.splitlines(keepends=True)
    ids = []
    chunk = 2000
    for i in range(0, len(lines), chunk):
        ids.extend(tok.encode("".join(lines[i:i + chunk])).ids)
    return torch.tensor(ids, dtype=torch.int32)


def prepare_tokens(args):
    """(token ids of the corpus, the tokenizer's actual vocabulary size, seconds it took)."""
    start = time.perf_counter()
    text = stdlib_text(int(args.corpus_mb * 1e6))
    tok = train_tokenizer(text, args.vocab)
    ids = tokenize(text, tok)
    return ids, tok.get_vocab_size(), time.perf_counter() - start


def batches(ids, steps, batch, seq, seed):
    """``steps`` batches of ``batch`` windows of ``seq`` tokens: the corpus cut into windows,
    visited in a seeded random order (a fresh order each pass), so every run sees the same data
    in the same order."""
    n = ids.numel() // seq
    if n < batch:
        raise ValueError(f"the corpus has {ids.numel()} tokens: fewer than one batch of "
                         f"{batch} x {seq}; raise --corpus-mb")
    windows = ids[:n * seq].view(n, seq).long()
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    out = []
    for _ in range(steps):
        if order.numel() < batch:
            order = torch.cat([order, torch.randperm(n, generator=g)])
        out.append(windows[order[:batch]])
        order = order[batch:]
    return out


# ---- memory --------------------------------------------------------------------------------

def _proc_kb(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class StepPeak:
    """Peak bytes allocated during a ``with`` block above the state at its start."""

    def __init__(self, device):
        self.device = device
        self.cpu = device.type == "cpu" and os.path.exists("/proc/self/clear_refs")
        self.peak = None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.cpu:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # VmHWM := VmRSS
            self.base = _proc_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.cpu:
            self.peak = _proc_kb("VmHWM") * 1024 - self.base
        return False


# ---- training ------------------------------------------------------------------------------

def build_model(vocab, hidden, layers, seq, seed, device):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=seq,
        tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device)


def train(data, *, variant, dtype, vocab, hidden, layers, lr, seed, device="cpu",
          measure_memory=True, log=None):
    """Train from a fresh seeded initialization on ``data`` (a list of (batch, seq) id tensors);
    returns the per-step losses, step times and peak memory."""
    import flce

    if variant not in VARIANTS + (CONTROL,):
        raise ValueError(f"variant must be one of {VARIANTS + (CONTROL,)}, got {variant!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    device = torch.device(device)
    model = build_model(vocab, hidden, layers, data[0].shape[1], seed, device)
    if variant == "flce":
        flce.patch(model)
    if variant == CONTROL:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0 ** -23)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, times, peaks = [], [], []
    for k, ids in enumerate(data):
        ids = ids.to(device)
        with StepPeak(device) if measure_memory else _Null() as mem:
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = out.loss.item()  # synchronizes
            times.append(time.perf_counter() - start)
            del out
        losses.append(loss)
        peaks.append(mem.peak)
        if log is not None:
            log(k, loss, times[-1], mem.peak)
    return {"losses": losses, "step_s": times, "peak_bytes": peaks}


class _Null:
    peak = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def expected_seconds(args, runs):
    """(low, high) seconds for the whole run on a CPU, from the flop model above plus each run's
    process start (importing torch and transformers: 8 s on a quiet machine, 30 s on one loaded
    4x over) and per-step overhead, the tokenizer's training (about 3 s a MB) and the driver's
    own imports and picture (15 s)."""
    h = args.hidden
    flops = 6 * args.batch * args.seq * (args.layers * 12 * h * h + args.vocab * h)
    return tuple(3 * args.corpus_mb + 15 + runs * start
                 + runs * args.steps * (flops / rate + 0.02 * args.layers)
                 for rate, start in zip(reversed(CPU_FLOPS_PER_S), (8, 30)))


def _minutes(seconds):
    return f"{seconds / 60:.1f}" if seconds < 600 else f"{seconds / 60:.0f}"


def load_note():
    """The 1-minute load average, to print beside a speed ratio: on a shared machine it says
    whether the ratio measured the code or the neighbours."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def summarize(run, tokens_per_step):
    """Median step time (the first step excluded: lazy initialization), tokens/s, and the largest
    step peak after the first (the first also allocates the optimizer's state)."""
    later = run["step_s"][1:] or run["step_s"]
    step = statistics.median(later)
    peaks = [p for p in run["peak_bytes"][1:] if p is not None]
    return {"step_s_median": step, "tokens_per_s": tokens_per_step / step,
            "peak_mb": max(peaks) / 2 ** 20 if peaks else None}


# ---- records and the picture ----------------------------------------------------------------

def environment(device):
    import platform

    import flce
    import transformers

    commit = ""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        if dirty:
            commit += "+dirty"
    except (OSError, subprocess.CalledProcessError):
        pass
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as fh:
                name = next(ln.split(":", 1)[1].strip() for ln in fh
                            if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
        threads = torch.get_num_threads()
        name = f"{name}, {threads} thread{'s' if threads != 1 else ''}"
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "flce": flce.__version__ if hasattr(flce, "__version__") else
            flce.build_info()["version"]}


def agreement(ref, got):
    """Per step |loss_flce - loss_stock| / loss_stock."""
    return [abs(a - b) / abs(b) for a, b in zip(got, ref)]


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in records)]
    fig, axes = plt.subplots(2, len(dtypes), figsize=(max(6 * len(dtypes), 9), 7), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for col, dtype in enumerate(dtypes):
        runs = {r["variant"]: r for r in records if r["dtype"] == dtype}
        ax, ax2 = axes[0][col], axes[1][col]
        for variant, style in (("transformers", dict(color="C0", lw=2.5, alpha=0.6)),
                               ("flce", dict(color="C3", lw=1, ls="--"))):
            if variant in runs:
                r = runs[variant]
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], **style,
                        label=f"{'stock loss' if variant == 'transformers' else 'flce.patch'}: "
                              f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_mb']:.0f} MB")
        name = "fp32" if dtype == "fp32" else "bf16 autocast"
        ax.set_title(f"{name}")
        ax.set_ylabel("training loss (nats/token)")
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
        # The relative difference per step, on a log axis from a quarter of fp32's unit
        # roundoff; steps where the two losses are bitwise equal are marked on the bottom edge.
        bottom = 2.0 ** -26
        ref_line, ref_label = ((2.0 ** -24, "fp32 unit roundoff 2^-24") if dtype == "fp32" else
                               (2.0 ** -8, "bf16 rounding of a logit, 2^-8 of the loss"))
        ax2.axhline(ref_line, color="0.5", lw=0.8, ls=":", label=ref_label)
        if "transformers" in runs and "flce" in runs:
            rel = agreement(runs["transformers"]["losses"], runs["flce"]["losses"])
            steps = range(1, len(rel) + 1)
            ax2.semilogy([k for k, x in zip(steps, rel) if x > 0], [x for x in rel if x > 0],
                         ".", color="k", ms=3, label="|flce - stock| / stock")
            if CONTROL in runs:
                ctl = agreement(runs["transformers"]["losses"], runs[CONTROL]["losses"])
                ax2.semilogy([k for k, x in zip(steps, ctl) if x > 0], [x for x in ctl if x > 0],
                             "x", color="C1", ms=3, alpha=0.7,
                             label="control: stock from weights moved 1 ulp")
            equal = [k for k, x in zip(steps, rel) if x == 0]
            if equal:
                ax2.semilogy(equal, [bottom * 1.2] * len(equal), "|", color="C2", ms=6,
                             label=f"bitwise equal ({len(equal)} steps)")
        ax2.set_yscale("log")
        ax2.set_ylim(bottom, 10)  # room for the legend above the points
        ax2.set_ylabel("relative difference")
        ax2.set_xlabel("step")
        ax2.legend(loc="upper left", fontsize=7, ncol=2)
        ax2.grid(alpha=0.3, which="major")
    r0 = records[0]
    c = r0["config"]
    dates = sorted({r["date"][:10] for r in records})
    commits = sorted({r["commit"] for r in records})
    fig.suptitle(f"Llama-style model ({c['layers']} layers, hidden {c['hidden']}, vocab "
                 f"{c['vocab']}, {c['batch']}x{c['seq']} tokens/step) on Python stdlib sources\n"
                 f"{r0['device']}, {', '.join(dates)}, commit {', '.join(commits)}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- driver --------------------------------------------------------------------------------

def run_child(spec_path):
    with open(spec_path) as fh:
        spec = json.load(fh)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    ids = torch.load(spec["tokens"])
    data = batches(ids, spec["steps"], spec["batch"], spec["seq"], spec["seed"])

    def log(k, loss, dt, peak):
        if k % 25 == 0 or k == spec["steps"] - 1:
            mem = "" if peak is None else f", step peak {peak / 2 ** 20:.0f} MB"
            print(f"    step {k:4d}: loss {loss:.4f}, {dt * 1e3:.0f} ms{mem}", file=sys.stderr,
                  flush=True)

    run = train(data, variant=spec["variant"], dtype=spec["dtype"], vocab=spec["vocab"],
                hidden=spec["hidden"], layers=spec["layers"], lr=spec["lr"], seed=spec["seed"],
                device=spec["device"], log=log)
    print(json.dumps(run), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run_child(args.child)
        return None
    if args.threads:
        torch.set_num_threads(args.threads)
    ids, vocab, took = prepare_tokens(args)
    tokens_per_step = args.batch * args.seq
    print(f"corpus: {ids.numel()} tokens from {args.corpus_mb:g} MB of stdlib sources, BPE "
          f"vocabulary {vocab} (tokenizer trained and applied in {took:.1f} s); "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens "
          f"({args.steps * tokens_per_step / ids.numel():.2f} passes)", flush=True)
    runs = len(args.dtypes) * len(args.variants)
    if args.device == "cpu":
        low, high = expected_seconds(args, runs)
        print(f"{runs} training runs; expected {_minutes(low)}-{_minutes(high)} min on a 2-core "
              f"CPU at this size{'' if args.quick else ' (--quick: about a minute)'}; {load_note()}",
              flush=True)
    env = environment(torch.device(args.device))
    config = {"layers": args.layers, "hidden": args.hidden, "vocab": vocab, "batch": args.batch,
              "seq": args.seq, "lr": args.lr, "seed": args.seed, "steps": args.steps,
              "corpus_tokens": ids.numel()}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens.pt")
        torch.save(ids, tokens)
        for dtype in args.dtypes:
            for variant in args.variants:
                spec = dict(config, vocab=vocab, variant=variant, dtype=dtype, tokens=tokens,
                            device=args.device, threads=args.threads)
                spec_path = os.path.join(tmp, "spec.json")
                with open(spec_path, "w") as fh:
                    json.dump(spec, fh)
                print(f"  {variant} {dtype} ...", flush=True)
                load_before = os.getloadavg()[0]
                proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                                       "--child", spec_path], stdout=subprocess.PIPE, text=True,
                                      check=True)
                run = json.loads(proc.stdout.strip().splitlines()[-1])
                rec = {"op": "train_lm", **env, "loadavg": load_before,
                       "loadavg_after": os.getloadavg()[0],
                       "variant": variant, "dtype": dtype, "config": config,
                       **summarize(run, tokens_per_step), **run}
                records.append(rec)
                print(f"  {variant:>12} {dtype}: final loss {run['losses'][-1]:.4f}, "
                      f"{rec['step_s_median'] * 1e3:.0f} ms/step, {rec['tokens_per_s']:.0f} "
                      f"tokens/s, step peak {rec['peak_mb']:.0f} MB ({load_note()})", flush=True)
    for dtype in args.dtypes if set(VARIANTS) <= set(args.variants) else ():
        ref, got = (next(r for r in records if r["dtype"] == dtype and r["variant"] == v)
                    for v in VARIANTS)
        rel = agreement(ref["losses"], got["losses"])
        print(f"{dtype}: |flce - stock| / stock: step 1 {rel[0]:.1e}, max {max(rel):.1e} "
              f"(step {rel.index(max(rel)) + 1}), last {rel[-1]:.1e}; flce's step peak "
              f"{got['peak_mb'] / ref['peak_mb']:.2f}x, tokens/s "
              f"{got['tokens_per_s'] / ref['tokens_per_s']:.2f}x the stock loss's (load average "
              f"{ref['loadavg']:.1f} / {got['loadavg']:.1f} before the two runs, "
              f"{os.cpu_count()} cores)")
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
