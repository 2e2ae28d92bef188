"""Distillation (`python benchmarks/run.py distill`): flce.linear_distillation against eager
torch and Liger's chunked loss, forward + backward time and peak memory, beside
flce.linear_cross_entropy at the same shape and the floor of 5 GEMMs; and, with --collapse, the
loss's and the student gradient's relative error against float64 at margins 0-100.

    python benchmarks/run.py distill                       # N=4096 V=32768 D=512, fp32
    python benchmarks/run.py distill --dtype fp32,bf16 --repeats 3 \\
        --record benchmarks/results/cpu.jsonl
    python benchmarks/run.py distill -N 256 -V 4096 -D 64 --impls flce-jsd,eager-jsd
    python benchmarks/run.py distill --collapse --record benchmarks/results/cpu.jsonl

Every (implementation, configuration) runs in a fresh process, timed and probed for memory by
benchmarks/_peers.py's ``measure`` (the first step apart, then the median of --repeats steps;
peak memory by flce.check.Peak, its growth during one forward + backward above the inputs, the
student's gradients included). The student's input and classifier require grad, the teacher's
do not (a frozen teacher). The same seeded batch in every process: student hidden states and
classifier as benchmarks/_peers.random_batch draws them, the teacher's likewise from its own
seed, so that every implementation sees the same inputs.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _peers  # noqa: E402
import _records  # noqa: E402
from _progress import Progress  # noqa: E402

BETA = 0.5
DESCRIPTIONS = {
    "flce-jsd": "flce.linear_distillation(divergence='jsd', beta=0.5)",
    "flce-fkl": "flce.linear_distillation(divergence='forward_kl')",
    "eager-jsd": "both logits materialized, log_softmax and TRL's generalized_jsd_loss "
                 "(beta=0.5), autograd",
    "eager-fkl": "both logits materialized, F.kl_div(log_softmax(student), "
                 "log_softmax(teacher), log_target=True), autograd",
    "liger-jsd": "Liger-Kernel chunked_loss.LigerFusedLinearJSDLoss(beta=0.5, "
                 "weight_hard_loss=0, weight_soft_loss=1), torch.compile'd chunks (its default)",
    "lce": "flce.linear_cross_entropy on the student alone (the memory reference)",
    "gemm5": "the 5 GEMMs alone on torch.mm (both logits; a logits GEMM again, dz @ W_S and "
             "dz^T @ X_S): a floor",
    "gemm5-flce": "the 5 GEMMs alone on flce's CPU tile-GEMM engine (fp32 products): a floor",
}
IMPLS = tuple(DESCRIPTIONS)
FLOORS = ("gemm5", "gemm5-flce")
DEFAULT_IMPLS = ("flce-jsd", "flce-fkl", "eager-jsd", "liger-jsd", "lce", "gemm5", "gemm5-flce")


# ---- the implementations (run in the child) ------------------------------------------------

def trl_divergence(z_s, z_t, beta):
    """Per-token divergence from logits as TRL's ``generalized_jsd_loss`` computes it (and
    Liger's chunked loss per chunk): fp32 log_softmax of both, forward KL at beta 0, reverse KL
    at 1, otherwise the mixture by logsumexp and F.kl_div(log_target=True) against it."""
    log_s = F.log_softmax(z_s, dim=-1)
    log_t = F.log_softmax(z_t, dim=-1)
    if beta == 0:
        return F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta),
                                         log_t + math.log(beta)]), dim=0)
    kl_t = F.kl_div(log_m, log_t, reduction="none", log_target=True)
    kl_s = F.kl_div(log_m, log_s, reduction="none", log_target=True)
    return (beta * kl_t + (1 - beta) * kl_s).sum(-1)


class _Gemm5(torch.autograd.Function):
    """The 5 GEMMs of a distillation step with a frozen teacher, no loss math: the student's and
    the teacher's logits forward; backward the student's logits once more (as a path that
    recomputes them), then ``dz @ W_S`` and ``dz^T @ X_S``. ``mm(a, b, trans_a, trans_b)`` is
    the engine; ``g`` an operand of the logits' shape in the inputs' dtype for a 16-bit step on
    an engine whose products are fp32 (benchmarks/_peers.py's _Gemm3Flce does the same)."""

    @staticmethod
    def forward(ctx, x_s, w_s, x_t, w_t, g, mm):
        z_s = mm(x_s, w_s, False, True)
        z_t = mm(x_t, w_t, False, True)
        ctx.mm = mm
        ctx.save_for_backward(x_s, w_s, g)
        return z_s.new_zeros((), dtype=torch.float32) + 0 * z_t.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x_s, w_s, g = ctx.saved_tensors
        z = ctx.mm(x_s, w_s, False, True)
        dz = z if g is None else g
        return ctx.mm(dz, w_s, False, False), ctx.mm(dz, x_s, True, False), None, None, None, None


def _torch_mm(a, b, trans_a, trans_b):
    return (a.T if trans_a else a) @ (b.T if trans_b else b)


def _flce_mm(a, b, trans_a, trans_b):
    return torch.ops.flce.cpu_tile_gemm(a, b, trans_a=trans_a, trans_b=trans_b)


def teacher_batch(n, v, d, dtype, device, seed=1):
    """The teacher's hidden states and classifier (``_peers.random_batch``, its own seed)."""
    x, w, _ = _peers.random_batch(n, v, d, dtype, device, seed=seed)
    return x, w


def make_impl(name, x_t, w_t):
    """``f(x_s, w_s, t) -> mean loss`` for implementation ``name`` with the teacher ``x_t``,
    ``w_t`` bound (the signature _peers.measure times)."""
    import flce  # (also registers torch.ops.flce.*, the floor's engine)

    if name in ("flce-jsd", "flce-fkl"):
        div = "jsd" if name == "flce-jsd" else "forward_kl"

        def f(x, w, t):
            return flce.linear_distillation(x, w, x_t, w_t, t, divergence=div, beta=BETA)
        return f
    if name in ("eager-jsd", "eager-fkl"):
        beta = BETA if name == "eager-jsd" else 0.0

        def f(x, w, t):
            # The usual recipe: logits in the input dtype, upcast; the teacher's without grad.
            with torch.no_grad():
                z_t = F.linear(x_t, w_t).float()
            return trl_divergence(F.linear(x, w).float(), z_t, beta).mean()
        return f
    if name == "liger-jsd":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA)

        def f(x, w, t):
            return loss(x, w, x_t, w_t, t)
        return f
    if name == "lce":
        def f(x, w, t):
            return flce.linear_cross_entropy(x, w, t)
        return f
    if name in FLOORS:
        mm = _torch_mm if name == "gemm5" else _flce_mm

        def f(x, w, t):
            g = None
            if name == "gemm5-flce" and x.dtype != torch.float32:
                g = _peers._gemm_operand(x.shape[0], w.shape[0], x.dtype)
            return _Gemm5.apply(x, w, x_t, w_t, g, mm)
        return f
    raise ValueError(f"unknown implementation {name!r}; choose from {IMPLS}")


def available(name, device):
    """None when ``name`` can run here, else why not."""
    if name == "liger-jsd":
        import importlib.util
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed"
    if name == "gemm5-flce" and device != "cpu":
        return "flce's tile-GEMM engine is the CPU backend's"
    return None


def measure(spec):
    """One implementation at one shape, in this process: _peers.measure's timing and memory
    probe, run on this file's implementation (it times what _peers.make_impl returns)."""
    dtype = _peers.DTYPES[spec["dtype"]]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    x_t, w_t = teacher_batch(spec["N"], spec["V"], spec["Dt"], dtype, spec["device"])
    _peers.make_impl = lambda name, device: make_impl(name, x_t, w_t)
    out = _peers.measure(dict(spec, accuracy=False))
    # The student's gradients (input and classifier, the inputs' dtype): the part of the peak
    # that every implementation must allocate.
    out["grad_bytes"] = (spec["N"] + spec["V"]) * spec["D"] * torch.finfo(dtype).bits // 8
    return out


def run_child(spec, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


# ---- the speed and memory run ----------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py distill",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--dtype", "--dtypes", dest="dtypes", default="fp32",
                   help=f"comma list from {tuple(_peers.DTYPES)} (default: %(default)s)")
    p.add_argument("-N", type=int, default=4096, help="tokens (rows)")
    p.add_argument("-V", type=int, default=32768, help="vocabulary size")
    p.add_argument("-D", type=int, default=512, help="the student's hidden size")
    p.add_argument("--Dt", type=int, default=0, help="the teacher's hidden size (default: D)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma list from {IMPLS} (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--load", type=int, default=0,
                   help="competing busy processes (benchmarks/_peers.BusyLoad) for the run")
    p.add_argument("--collapse", action="store_true",
                   help="instead: the collapse sweep (margins 0-100, fp32; -V, -D, -N per margin "
                        "default to 4096, 64, 8)")
    p.add_argument("--margins", default=",".join(map(str, range(0, 105, 5))),
                   help="--collapse's margins")
    p.add_argument("--record", help="append each configuration's record to this JSON-lines "
                   "file (e.g. benchmarks/results/cpu.jsonl)")
    args = p.parse_args(argv)
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtype_list or any(d not in _peers.DTYPES for d in args.dtype_list):
        p.error(f"--dtype: choose from {tuple(_peers.DTYPES)}")
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = [s for s in args.impl_list if s not in IMPLS]
    if unknown or not args.impl_list:
        p.error(f"--impls: unknown {unknown}; choose from {IMPLS}")
    if args.collapse:
        given = set(a.lstrip("-").split("=")[0] for a in (argv or sys.argv[1:]))
        for flag, value in (("N", 8), ("V", 4096), ("D", 64)):
            if flag not in given:
                setattr(args, flag, value)
    args.Dt = args.Dt or args.D
    for name in ("N", "V", "D", "Dt", "repeats", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"-{name} must be >= 1")
    if args.load < 0:
        p.error("--load must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def describe(args, dtype):
    return f"{args.device} {dtype} N={args.N} V={args.V} D={args.D} Dt={args.Dt}"


def run(args, dtype, progress=None):
    """Measure every implementation of ``args`` at ``dtype``; one row dict per implementation."""
    rows = []
    before = os.getloadavg()[0]
    runnable = [n for n in args.impl_list if available(n, args.device) is None]
    with _peers.BusyLoad(args.load, args.timeout * (len(runnable) + 1)):
        for name in args.impl_list:
            row = {"impl": name}
            reason = available(name, args.device)
            if reason is not None:
                row["status"] = f"skipped: {reason}"
                rows.append(row)
                continue
            spec = {"impl": name, "device": args.device, "dtype": dtype, "N": args.N,
                    "V": args.V, "D": args.D, "Dt": args.Dt, "repeats": args.repeats,
                    "warmup": args.warmup, "threads": args.threads}
            if progress is not None:
                progress.start(f"{describe(args, dtype)}: {name}")
            result = run_child(spec, args.timeout)
            if "error" in result:
                row["status"] = f"failed: {result['error']}"
                msg = row["status"]
            else:
                row.update(result, status="ok")
                msg = (f"{result['time_median_s']:.3f} s, "
                       f"{result['peak_mem_bytes'] / 2 ** 20:.0f} MB")
            if progress is not None:
                progress.done(msg)
            rows.append(row)
    after = os.getloadavg()[0]
    for row in rows:
        row["loadavg"] = [before, after]
    return rows


def floor_row(rows):
    ok = [r for r in rows if r["impl"] in FLOORS and r["status"] == "ok"]
    return min(ok, key=lambda r: r["time_median_s"]) if ok else None


def format_table(rows, args, dtype):
    fr = floor_row(rows)
    lce = next((r for r in rows if r["impl"] == "lce" and r["status"] == "ok"), None)
    head = (f"{'impl':10s} {'time (s)':>9s} {'x floor':>8s} {'first (s)':>9s} {'peak MB':>8s} "
            f"{'beyond grads':>12s} {'x lce':>6s} {'loss':>9s}")
    load = rows[0]["loadavg"]
    lines = [f"distillation fwd+bwd, {describe(args, dtype)}, median of {args.repeats} after "
             f"{args.warmup} warm-up; "
             f"{_peers.cpu_model() + ', ' if args.device == 'cpu' else ''}load average {load[0]:.2f} before, {load[1]:.2f} after", head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['impl']:10s} {r['status']}")
            continue
        beyond = max(r["peak_mem_bytes"] - r["grad_bytes"], 0) / 2 ** 20
        lce_beyond = lce and max(lce["peak_mem_bytes"] - lce["grad_bytes"], 0) / 2 ** 20
        ratio = (f"{beyond / lce_beyond:6.2f}" if lce_beyond and r["impl"] not in FLOORS
                 else f"{'-':>6s}")
        lines.append(f"{r['impl']:10s} {r['time_median_s']:9.3f} "
                     f"{(r['time_median_s'] / fr['time_median_s']) if fr else 0:8.2f} "
                     f"{r['time_first_s']:9.3f} {r['peak_mem_bytes'] / 2 ** 20:8.0f} "
                     f"{beyond:12.0f} {ratio} {r['loss']:9.5f}")
    lines.append("x floor: over the faster of the 5-GEMM floors"
                 + (f" (here {fr['impl']})" if fr else "") + ". peak MB: growth during one "
                 "fwd+bwd above the inputs, the student's gradients included; beyond grads: "
                 "less those gradients; x lce: that over flce.linear_cross_entropy's.")
    return "\n".join(lines)


def record(rows, args, dtype, argv=None):
    """The configuration's ``op: "linear_distillation"`` record: median fwd+bwd ``ms`` and its
    range, ``peak_gib`` (growth, the student's gradients included; not for the floors) and
    ``grad_gib`` (those gradients) per implementation, the floor, and the load average."""
    ok = [r for r in rows if r["status"] == "ok"]
    fr = floor_row(rows)
    rec = _records.base(args.device, "linear_distillation")
    rec.update(dtype=_records.DTYPE_NAMES[dtype], n=args.N, v=args.V, d=args.D, d_teacher=args.Dt,
               beta=BETA, repeats=args.repeats, load=args.load, loadavg=rows[0]["loadavg"],
               ms={r["impl"]: round(r["time_median_s"] * 1e3, 3) for r in ok},
               ms_range={r["impl"]: [round(r["time_min_s"] * 1e3, 3),
                                     round(r["time_max_s"] * 1e3, 3)] for r in ok},
               peak_gib={r["impl"]: round(r["peak_mem_bytes"] / 2 ** 30, 5) for r in ok
                         if r["impl"] not in FLOORS},
               grad_gib=round(ok[0]["grad_bytes"] / 2 ** 30, 5) if ok else None,
               floor=fr and fr["impl"], loss={r["impl"]: r["loss"] for r in ok},
               source="benchmarks/run.py distill" + (f" {' '.join(argv)}" if argv else ""))
    if args.device == "cpu":
        rec["threads"] = next((r["threads"] for r in ok if r.get("threads")), rec["threads"])
    not_run = {r["impl"]: r["status"] for r in rows if r["status"] != "ok"}
    if not_run:
        rec["not_run"] = not_run
    return rec


# ---- the collapse sweep ------------------------------------------------------------------------

def collapse_batch(n, v, d, margin, disagree, seed=0):
    """fp32 student and teacher hidden states and classifiers whose every row puts its top logit
    about ``margin`` above the next (_peers.margin_batch). Agreeing: the teacher is the student's
    batch moved to margin + 1 (the same classifier and dominant classes: the two distributions
    differ by ~e^-margin); disagreeing: a batch of its own seed, whose dominant classes differ
    from the student's. Returns x_s, w_s, x_t, w_t, the student's and the teacher's classes."""
    x_s, w_s, a_s, _ = _peers.margin_batch(n, v, d, margin, torch.float32, seed=seed)
    x_t, w_t, a_t, _ = _peers.margin_batch(n, v, d, margin + (0 if disagree else 1),
                                           torch.float32, seed=seed + (1 if disagree else 0))
    return x_s, w_s, x_t, w_t, a_s, a_t


COLLAPSE_DIVERGENCES = {"jsd": BETA, "forward_kl": 0.0}


def collapse_impls():
    """The implementations of the sweep: ``{name: f(x_s, w_s, x_t, w_t, divergence)}`` (mean
    loss; the student's tensors may require grad)."""
    import flce

    out = {"flce": lambda x, w, xt, wt, div: flce.linear_distillation(
               x, w, xt, wt, divergence=div, beta=COLLAPSE_DIVERGENCES[div]),
           "eager": lambda x, w, xt, wt, div: trl_divergence(
               x @ w.T, xt @ wt.T, COLLAPSE_DIVERGENCES[div]).mean()}
    if available("liger-jsd", "cpu") is None:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # Uncompiled: the same chunk math without a compilation per call.
        def liger(x, w, xt, wt, div):
            loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0,
                                           beta=COLLAPSE_DIVERGENCES[div], compiled=False)
            return loss(x, w, xt, wt, torch.zeros(x.shape[0], dtype=torch.long))
        out["liger"] = liger
    return out


def _loss_and_grad(f, x_s, w_s, x_t, w_t, a_s, div):
    """The mean loss and the student classifier's gradient rows at its dominant classes."""
    w = w_s.detach().clone().requires_grad_(True)
    loss = f(x_s, w, x_t, w_t, div)
    loss.backward()
    return float(loss.detach()), w.grad[a_s].double()


def collapse_record(n=8, v=4096, d=64, margins=tuple(range(0, 105, 5)), progress=None):
    """Relative errors against float64 (flce.reference.distillation on the same rounded fp32
    tensors) of the mean loss and of the student classifier's gradient rows at the dominant
    classes (``|g - ref| / |ref|`` over those rows), per implementation, divergence, margin, for
    the agreeing and the disagreeing batch."""
    import flce.reference

    impls = collapse_impls()
    rel = {case: {div: {i: {"loss": [], "grad": []} for i in impls}
                  for div in COLLAPSE_DIVERGENCES} for case in ("agree", "disagree")}
    ref_loss = {case: {div: [] for div in COLLAPSE_DIVERGENCES} for case in rel}
    for m in margins:
        if progress is not None:
            progress.start(f"distillation collapse, margin {m}")
        for case in rel:
            x_s, w_s, x_t, w_t, a_s, _ = collapse_batch(n, v, d, float(m), case == "disagree",
                                                        seed=m)
            for div, beta in COLLAPSE_DIVERGENCES.items():
                w64 = w_s.double().requires_grad_(True)
                loss64 = flce.reference.distillation(x_s.double() @ w64.T,
                                                     x_t.double() @ w_t.double().T,
                                                     divergence=div, beta=beta)
                loss64.backward()
                ref, ref_g = float(loss64), w64.grad[a_s]
                ref_loss[case][div].append(ref)
                for name, f in impls.items():
                    got, g = _loss_and_grad(f, x_s, w_s, x_t, w_t, a_s, div)
                    rel[case][div][name]["loss"].append(abs(got - ref) / abs(ref))
                    rel[case][div][name]["grad"].append(
                        float((g - ref_g).norm() / ref_g.norm()))
        if progress is not None:
            progress.done(", ".join(f"{i} {rel['agree']['jsd'][i]['loss'][-1]:.1e}"
                                    for i in impls) + " (agreeing, jsd, loss)")
    rec = _records.base("cpu", "distill_collapse")
    rec.update(dtype="float32", n=n, v=v, d=d, beta=BETA, margins=list(margins),
               ref_loss=ref_loss, rel_err=rel,
               source="benchmarks/run.py distill --collapse: |x - float64 reference| / "
                      "|reference| of the mean loss and of the student classifier's gradient "
                      "rows at the dominant classes")
    return rec


def plot_collapse(rec, path):
    """docs/img/distill_collapse.png from a ``distill_collapse`` record: a column per case
    (agreeing, disagreeing), the loss's error above, the gradient's below."""
    import plots

    plt = plots._pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    floor = 2.0 ** -24
    colors = {"flce": "C3", "eager": "C0", "liger": "C5"}
    labels = {"flce": "flce.linear_distillation", "eager": "eager F.kl_div(log_softmax) (TRL)",
              "liger": "Liger LigerFusedLinearJSDLoss"}
    styles = {"jsd": dict(ls="-", marker="o", ms=3), "forward_kl": dict(ls="--", marker="s",
                                                                        ms=3)}
    for col, case in enumerate(("agree", "disagree")):
        for row, what in enumerate(("loss", "grad")):
            ax = axes[row][col]
            for div, per_impl in rec["rel_err"][case].items():
                for impl, errs in per_impl.items():
                    ys = [max(e, floor / 10) for e in errs[what]]
                    width = {"flce": 2.2, "eager": 3.5}.get(impl, 1.3)
                    alpha = 0.5 if impl == "eager" else 1.0
                    ax.semilogy(rec["margins"], ys, color=colors.get(impl, "0.5"), lw=width,
                                alpha=alpha, label=f"{labels.get(impl, impl)}, {div}",
                                **styles.get(div, {}))
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.axhline(floor, color="0.5", lw=0.8, ls=":")
            ax.set_ylim(floor / 20, 30)
            ax.grid(alpha=0.3, which="both")
            ax.set_title(("both models confident on the same class" if case == "agree" else
                          "the teacher's class differs from the student's")
                         + (": mean loss" if what == "loss" else
                            ": dW_S at the student's class"), fontsize=9)
            if col == 0:
                ax.set_ylabel("|x - float64 reference| / |reference|")
            if row == 1:
                ax.set_xlabel("margin  z_a - max_{j != a} z_j  (the teacher's: margin + 1 "
                              "where they agree)", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="center right")
    fig.suptitle(f"Distillation at large margins, fp32: {rec['n']} tokens, V = {rec['v']}, "
                 f"D = {rec['d']}, jsd beta = {rec['beta']}; 1: the result came out as 0 or "
                 f"as noise; dotted grey: 2^-24\n{rec['device']}, torch {rec['torch']}, "
                 f"{rec['date']}, commit {rec['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the entry point ---------------------------------------------------------------------------

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(measure(json.loads(argv[1]))), flush=True)
        return 0
    args = parse_args(argv)
    if args.collapse:
        margins = tuple(int(m) for m in args.margins.split(","))
        rec = collapse_record(args.N, args.V, args.D, margins, progress=Progress(len(margins)))
        if args.record:
            _records.append(args.record, rec)
        return 0
    runnable = [n for n in args.impl_list if available(n, args.device) is None]
    print(f"flce benchmark, distillation: {', '.join(args.impl_list)}; "
          f"{len(args.dtype_list)} configuration(s)", flush=True)
    progress = Progress(len(runnable) * len(args.dtype_list))
    for dtype in args.dtype_list:
        rows = run(args, dtype, progress)
        print()
        print(format_table(rows, args, dtype), flush=True)
        print()
        if args.record:
            _records.append(args.record, record(rows, args, dtype, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
