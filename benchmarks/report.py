"""docs/ from the committed records: docs/benchmarks.md's result tables (`python
benchmarks/run.py report`) and the README's pictures in docs/img (`python benchmarks/run.py
plots`).

    python benchmarks/run.py report            # rewrite the generated regions of the doc
    python benchmarks/run.py report --check    # exit 1 if they differ from the records' tables
    python benchmarks/run.py plots             # draw docs/img/*.png (--out DIR: somewhere else)

A generated region is the text between ``<!-- generated:NAME:begin -->`` and
``<!-- generated:NAME:end -->``; everything outside the markers is left as it is. Regions:

  results   per device, the latest record of each configuration (benchmarks/results/gpu.jsonl,
            cpu.jsonl): the linear step, cross-entropy on given logits, the loss collapse, the
            GPU test runs
  train_lm  examples/train_lm.py's latest runs (benchmarks/results/train_lm.jsonl)

Pictures: ``collapse.png`` (the loss's error against the target margin, the latest ``collapse``
record), ``distill_collapse.png`` (distillation's loss and student gradient likewise, the latest
``distill_collapse`` record), ``speed_memory.png`` (time over the 3-GEMM floor and peak memory per
implementation, one row per device, the ``linear_cross_entropy`` records) and ``train_lm.png`` (the
latest train_lm run's loss curves).

Every table and picture names the date, device and commit of its numbers.
tests/tools/test_report.py regenerates the regions from the committed records and compares them
with the committed doc, so the doc cannot drift from the records; tests/tools/test_plots.py
draws the pictures.
"""
import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _records  # noqa: E402

DOC = os.path.join(_records.REPO, "docs", "benchmarks.md")
IMG = os.path.join(_records.REPO, "docs", "img")
# The floors (rows of their own, last in a table) and what a time is divided by.
FLOORS = {"linear_cross_entropy": ("gemm3", "gemm3-flce", "gemm4"), "cross_entropy": ("bytes",),
          "linear_distillation": ("gemm5", "gemm5-flce")}
FLOOR_NAME = {"linear_cross_entropy": "gemm3", "cross_entropy": "bytes",
              "linear_distillation": "gemm5"}
TITLES = {"linear_cross_entropy": "Linear cross-entropy, forward + backward",
          "cross_entropy": "Cross-entropy on given logits, forward + backward",
          "linear_distillation": "Distillation (a frozen teacher), forward + backward"}
COLLAPSE_MARGINS = (0, 10, 15, 20, 40, 60, 80, 90, 100)  # the collapse table's rows
LOAD_NOTE = 1.0  # a load average above this marks a table's timings as contended


# ---- formatting ----------------------------------------------------------------------------

def fmt_time(ms):
    if ms >= 1e3:
        return f"{ms / 1e3:.3f} s"
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms"


def fmt_mem(gib):
    if gib is None:
        return ""
    return f"{gib * 1024:.0f} MB" if gib < 1 else f"{gib:.2f} GiB"


def fmt_err(e):
    if e is None:
        return ""
    return "1 (loss = 0)" if e == 1.0 else f"{e:.1e}"


def fmt_ratio(x):
    return f"{x:.2f}"


def table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _dtype(r):
    return r.get("dtype", "")


def _shape(r):
    return f"N = {r['n']}, V = {r['v']}" + (f", D = {r['d']}" if r.get("d") else "")


def _where(r):
    """Date, commit and the conditions of a measurement, for a table's caption."""
    bits = [str(r["date"]), f"commit {r.get('commit') or 'unknown'}"]
    if r.get("torch"):
        bits.append(f"torch {r['torch']}")
    if r.get("threads"):
        bits.append(f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}")
    if r.get("cpu_gemm"):
        bits.append(f"cpu_gemm={r['cpu_gemm']}")
    if r.get("repeats"):
        bits.append(f"median of {r['repeats']}"
                    + (f", {r['rounds']} rounds" if (r.get("rounds") or 1) > 1 else ""))
    loads = [x for x in (r.get("loadavg") or []) if x is not None]
    if loads:
        bits.append(f"load average {min(loads):.1f}-{max(loads):.1f}"
                    + (" (contended: the times are not a quiet machine's)"
                       if max(loads) > LOAD_NOTE else ""))
    if r.get("load"):
        bits.append(f"{r['load']} busy processes competing")
    if r.get("isa") not in (None, "native"):
        bits.append(f"isa {r['isa']}")
    return ", ".join(bits)


def _source(r):
    return r.get("source", "unknown")


# ---- the configurations --------------------------------------------------------------------

def step_table(r):
    """One configuration of the linear step or of cross-entropy on logits."""
    op = r["op"]
    # A record names its floor where it timed several (benchmarks/bench.py: the faster engine).
    floor_key = r.get("floor") or FLOOR_NAME[op]
    floor = r["ms"].get(floor_key)
    base_key = "flce-jsd" if op == "linear_distillation" else "flce"
    base = r["ms"].get(base_key)
    err_key = "loss_rel_err_m40" if op == "linear_cross_entropy" else "margin40_rel_err"
    errs = r.get(err_key) or {}
    impls = [i for i in r["ms"] if i not in FLOORS[op]] + [i for i in FLOORS[op] if i in r["ms"]]
    peaks = r.get("peak_gib") or {}
    # Distillation's memory reference: flce.linear_cross_entropy on the student alone.
    mem_base = peaks.get("flce") if op == "linear_distillation" else None
    head = ["implementation", "time", f"x {floor_key}" if floor else None, f"x {base_key}",
            "peak memory", "x `flce`'s" if mem_base else None,
            "loss rel. err @ m=40" if errs else None]
    keep = [k for k, h in enumerate(head) if h is not None]
    rows = []
    for i in impls:
        ms = r["ms"][i]
        row = [f"`{i}`", fmt_time(ms), fmt_ratio(ms / floor) if floor else None,
               fmt_ratio(ms / base) if base and i not in FLOORS[op] else "",
               fmt_mem(peaks.get(i)),
               fmt_ratio(peaks[i] / mem_base) if mem_base and i in peaks else "",
               fmt_err(errs.get(i))]
        rows.append([row[k] for k in keep])
    title = TITLES[op]
    extra = ""
    if op == "cross_entropy" and r.get("copy_gb_s"):
        extra = (f"; `bytes`: the logits read twice and the gradient written once at the copy "
                 f"rate of the same run, {r['copy_gb_s']:g} GB/s")
    if r.get("grad_gib"):
        extra = (f"; jsd at beta {r['beta']:g}; `flce`: linear_cross_entropy on the student "
                 f"alone; peak memory includes the student's gradients, "
                 f"{fmt_mem(r['grad_gib'])}")
    caption = f"**{title}, {_dtype(r)}, {_shape(r)}** ({_where(r)}{extra}). Source: {_source(r)}."
    not_run = r.get("skipped") or {}
    if not_run:
        caption += " Not run: " + "; ".join(f"`{k}` ({v})" for k, v in not_run.items()) + "."
    return caption + "\n\n" + table([head[k] for k in keep], rows)


def collapse_table(r):
    impls = list(r["rel_err"])
    margins = [m for m in COLLAPSE_MARGINS if m in r["margins"]]
    at = {m: k for k, m in enumerate(r["margins"])}
    rows = [[str(m)] + [fmt_err(r["rel_err"][i][at[m]]) for i in impls] for m in margins]
    caption = (f"**The loss at large target margins**: |mean loss - float64 reference| / "
               f"reference for {r['n']} tokens whose target logit exceeds every other by the "
               f"margin, {r['dtype']}, V = {r['v']}, D = {r['d']} ({_where(r)}). Source: "
               f"{_source(r)}.")
    return caption + "\n\n" + table(["margin"] + [f"`{i}`" for i in impls], rows)


def tests_line(r):
    counts = ", ".join(f"{r[k]} {k}" for k in ("passed", "failed", "skipped")
                       if r.get(k) is not None)
    return f"**Tests on the device** ({_where(r)}): {counts}. Source: {_source(r)}."


def accumulation_table(recs):
    """``run.py accuracy``'s records: one row per case."""
    r0 = recs[0]
    rows = [[r["dtype"], str(r["n"]), f"{r['groups']} of {r['group']}", r["across"],
             f"{r['rel_err']['accumulated (fp32, beta=1)']:.2e}", f"{r['rel_err']['ideal']:.2e}",
             f"{r['rel_err']['rounding floor']:.2e}",
             fmt_ratio(r["rel_err"]["accumulated (fp32, beta=1)"] / r["rel_err"]["ideal"]),
             f"{r['date']}, {r.get('commit')}"] for r in recs]
    caption = (f"**dW accumulated over row groups** (the CUDA single pass's arithmetic on the "
               f"CPU), relative error (norm) against float64, V = {r0['v']}, D = {r0['d']}. "
               f"Source: {_source(r0)}.")
    return caption + "\n\n" + table(["dtype", "N", "groups", "across groups", "accumulated",
                                     "ideal", "rounding floor", "x ideal", "date, commit"], rows)


def parallel_table(recs):
    rows = [[str(r["world"]), str(row["n"]), f"{row['flce_fwd_ms']:.3f} ms",
             f"{row['megatron_fwd_ms']:.3f} ms",
             fmt_ratio(row["megatron_fwd_ms"] / row["flce_fwd_ms"]),
             f"{row['de_allreduce_ms']:.2f} ms", f"{r['date']}, {r.get('commit')}"]
            for r in recs for row in r["rows"]]
    caption = (f"**Vocab-parallel collectives per step** ({recs[0].get('backend')}, each rank's "
               f"collectives alone, median of {recs[0].get('repeats')}, D = {recs[0]['d']}). "
               f"Source: {_source(recs[0])}.")
    head = ["ranks", "N", "flce: 1 all-gather", "Megatron: 3 all-reduces", "Megatron / flce",
            "dE all-reduce (both)", "date, commit"]
    return caption + "\n\n" + table(head, rows)


GROUPED = {"dw_accumulation": accumulation_table, "vocab_parallel_collectives": parallel_table}


def other_line(r):
    return (f"**`{r['op']}`** ({_where(r)}): see the record in `benchmarks/results/` "
            f"(source: {_source(r)}).")


def results_region(records):
    recs = _records.latest(records)
    devices = list(dict.fromkeys(r["device"] for r in recs))
    order = {"linear_cross_entropy": 0, "cross_entropy": 1, "linear_distillation": 2,
             "collapse": 3, "gpu_tests": 4}
    parts = []
    for dev in devices:
        parts.append(f"### {dev}")
        mine = sorted((r for r in recs if r["device"] == dev),
                      key=lambda r: order.get(r["op"], len(order)))
        done = set()
        for r in mine:
            if r["op"] in GROUPED:  # one table for all of the op's records
                if r["op"] not in done:
                    done.add(r["op"])
                    parts.append(GROUPED[r["op"]]([q for q in mine if q["op"] == r["op"]]))
            elif r["op"] in FLOOR_NAME and r.get("ms"):
                parts.append(step_table(r))
            elif r["op"] == "collapse":
                parts.append(collapse_table(r))
            elif r["op"] == "gpu_tests":
                parts.append(tests_line(r))
            else:
                parts.append(other_line(r))
    return "\n\n".join(parts)


# ---- examples/train_lm.py ------------------------------------------------------------------

TRAIN_COLUMNS = (("fp32", "transformers", "fp32: stock"),
                 ("fp32", "transformers-nudged", "fp32: stock, weights nudged (control)"),
                 ("fp32", "flce", "fp32: flce"),
                 ("bf16", "transformers", "bf16 autocast: stock"),
                 ("bf16", "transformers-nudged", "bf16 autocast: stock, nudged (control)"),
                 ("bf16", "flce", "bf16 autocast: flce"))


def train_lm_region(records):
    recs = [r for r in records if r.get("op") == "train_lm"]
    if not recs:
        return "(no train_lm records)"
    config = recs[-1]["config"]
    runs = {}
    for r in recs:
        if r["config"] == config:
            runs[(r["dtype"], r["variant"])] = r
    cols = [(d, v, name) for d, v, name in TRAIN_COLUMNS if (d, v) in runs]

    def rel_max(dtype, variant):
        stock = runs.get((dtype, "transformers"))
        if stock is None or variant == "transformers":
            return ""
        a, b = stock["losses"], runs[(dtype, variant)]["losses"]
        return f"{max(abs(x - y) / abs(x) for x, y in zip(a, b)):.1e}"

    steps = config.get("steps")
    rows = [
        [f"loss at step 1 / {steps}"] + [f"{runs[(d, v)]['losses'][0]:.4f} / "
                                         f"{runs[(d, v)]['losses'][-1]:.4f}" for d, v, _ in cols],
        ["largest relative difference from the stock run's loss"] + [rel_max(d, v)
                                                                     for d, v, _ in cols],
        ["step peak memory"] + [f"{runs[(d, v)]['peak_mb']:.0f} MB" for d, v, _ in cols],
        ["tokens/s (contended, see below)"] + [f"{runs[(d, v)]['tokens_per_s']:.0f}"
                                               for d, v, _ in cols],
        ["load average before the run"] + [f"{runs[(d, v)]['loadavg']:.1f}" for d, v, _ in cols],
        ["date, commit"] + [f"{runs[(d, v)]['date']}, {runs[(d, v)]['commit']}"
                            for d, v, _ in cols],
    ]
    first = runs[(cols[0][0], cols[0][1])]
    caption = (f"Device: {first['device']}; torch {first['torch']}, transformers "
               f"{first.get('transformers')}; model {config['layers']} layers, hidden "
               f"{config['hidden']}, vocabulary {config['vocab']}, {steps} steps of "
               f"{config['batch']} x {config['seq']} tokens, lr {config['lr']:g}, seed "
               f"{config['seed']}.")
    return caption + "\n\n" + table([""] + [name for _, _, name in cols], rows)


# ---- the pictures --------------------------------------------------------------------------

# The implementations as the pictures name them, in drawing order.
LABELS = {"flce": "flce", "flce_recompute": "flce (recompute path)", "eager": "F.cross_entropy",
          "compile": "torch.compile(F.cross_entropy)",
          "chunked": "torch F.linear_cross_entropy", "liger": "Liger (Triton)",
          "cce": "Cut Cross Entropy", "gemm3": "3 GEMMs alone (floor)"}
COLORS = {"flce": "C3", "flce_recompute": "C1", "eager": "C0", "compile": "C2", "chunked": "C4",
          "liger": "C5", "cce": "C6", "gemm3": "0.6"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# The peers collapse together: distinct line styles keep each one visible.
STYLES = {"flce": dict(lw=2.5, marker="o", ms=4),
          "eager": dict(lw=4, alpha=0.45, marker="s", ms=6),
          "compile": dict(lw=1.5, ls="--", marker="^", ms=4),
          "chunked": dict(lw=1.2, ls=":", marker="v", ms=4)}


def _error_axes(ax, margins, lines, one):
    """Relative errors against the margin on a log axis, ``lines``: ``(label, errors, style)``
    (a NaN error is not drawn); a line at 1 (``one`` says what it means) and at fp32's unit
    roundoff."""
    floor = 2.0 ** -24
    for label, errs, style in lines:
        # Exactly equal to the reference would be -inf on a log axis: drawn at the floor / 10.
        ax.semilogy(margins, [e if math.isnan(e) else max(e, floor / 10) for e in errs],
                    label=label, **style)
    mid = margins[len(margins) // 3]
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.text(mid, 1.5, one, fontsize=8)
    ax.axhline(floor, color="0.5", lw=0.8, ls=":")
    ax.text(mid, floor * 1.5, "fp32 unit roundoff 2^-24", fontsize=8, color="0.4")
    ax.set_ylim(floor / 20, 30)
    ax.grid(alpha=0.3, which="both")


def _stamp(rec):
    return f"{rec['device']}, torch {rec['torch']}, {rec['date']}, commit {rec['commit']}"


def _last(records, op):
    recs = [r for r in records if r.get("op") == op]
    if not recs:
        raise ValueError(f"no {op} records")
    return recs[-1]


def plot_collapse(records, path):
    rec = _last(records, "collapse")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    _error_axes(ax, rec["margins"], [
        (LABELS[i], rec["rel_err"][i], dict(color=COLORS[i], **STYLES.get(i, dict(lw=1.2))))
        for i in LABELS if i in rec["rel_err"]],
        "relative error 1: the loss came out as exactly 0")
    ax.set_xlabel("target margin  z_t - max_{j != t} z_j")
    ax.set_ylabel("|loss - float64 reference| / reference")
    ax.set_title(f"Loss collapse at large margins: mean loss of {rec['n']} tokens, fp32, "
                 f"V = {rec['v']}, D = {rec['d']}\n{_stamp(rec)}", fontsize=9)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DISTILL_LABELS = {"flce": "flce.linear_distillation", "eager": "eager F.kl_div(log_softmax)",
                  "liger": "Liger LigerFusedLinearJSDLoss"}


def plot_distill_collapse(records, path):
    """The latest ``distill_collapse`` record: a column per case (the models agree, disagree),
    the mean loss's error above, the student gradient's below; jsd solid, forward KL dashed.
    Margins whose float64 reference is below fp32's normal range (2^-126: no fp32 result can
    hold it) are not drawn."""
    rec = _last(records, "distill_collapse")
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, case in enumerate(("agree", "disagree")):
        for row, what in enumerate(("loss", "grad")):
            ax = axes[row][col]
            lines = []
            for name, errs in rec["rel_err"][case].items():
                impl, div = name.split("-")
                style = dict(STYLES.get(impl, dict(lw=1.2)), color=COLORS[impl])
                if div == "fkl":
                    style.update(ls="--", marker=None)
                label = f"{DISTILL_LABELS[impl]}, {'jsd' if div == 'jsd' else 'forward KL'}"
                refs = rec["ref"][case][div][what]
                lines.append((label, [e if r >= 2.0 ** -126 else math.nan
                                      for e, r in zip(errs[what], refs)], style))
            _error_axes(ax, rec["margins"], lines,
                        "relative error 1: the result came out as 0 or as noise")
            ax.set_title(("both models confident on the same class" if case == "agree" else
                          "confident on different classes")
                         + (": mean loss" if what == "loss" else
                            ": student gradient dW_S at its class"), fontsize=9)
            ax.set_ylabel("|x - float64 reference| / |reference|", fontsize=8)
        axes[1][col].set_xlabel("margin  z_a - max_{j != a} z_j" + (
            " (the teacher's: margin + 1)" if case == "agree" else ""))
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"Distillation at large margins: {rec['n']} tokens, fp32, V = {rec['v']}, "
                 f"D = {rec['d']}, jsd beta = {rec['beta']}; not drawn: margins where the "
                 f"float64 value is below fp32's range (2^-126)\n{_stamp(rec)}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def config_label(r):
    """The configuration's extras beyond device, dtype and shape ("" for a quiet native run)."""
    extra = []
    if r.get("load"):
        extra.append(f"{r['load']} busy processes")
    if r.get("isa") not in (None, "native"):
        extra.append(f"isa {r['isa']}")
    return ", ".join(extra)


def _speed_sets(records):
    recs = [r for r in records if r.get("op") == "linear_cross_entropy" and r.get("ms")]
    recs = _records.latest(recs)
    devices = list(dict.fromkeys(r["device"] for r in recs))
    return [(dev, [r for r in recs if r["device"] == dev]) for dev in devices]


def _bar(ax, x, height, width, impl, label):
    """One implementation's bar, its value written above it."""
    ax.bar(x, height, width, color=COLORS[impl])
    ax.text(x, height, label, ha="center", va="bottom", fontsize=6.5, rotation=90)


def plot_speed_memory(records, path):
    sets = _speed_sets(records)
    if not sets:
        raise ValueError("no linear_cross_entropy records")
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(sets), 2, figsize=(13, 4.4 * len(sets)), squeeze=False)
    for row, (device, recs) in enumerate(sets):
        impls = [i for i in LABELS if any(i in r["ms"] for r in recs)]
        bars = [i for i in impls if i != "gemm3"]
        width = 0.8 / max(len(bars), 1)
        ax_t, ax_m = axes[row]
        groups = [f"{r['dtype']}\nN={r['n']} V={r['v']} D={r['d']}"
                  + (f"\n{config_label(r)}" if config_label(r) else "") for r in recs]
        for k, impl in enumerate(bars):
            xs = [g + (k - (len(bars) - 1) / 2) * width for g in range(len(recs))]
            for x, r in zip(xs, recs):
                floor = r["ms"].get(r.get("floor") or "gemm3")  # bench.py: the faster engine
                t = r["ms"].get(impl)
                if t is not None and floor:
                    _bar(ax_t, x, t / floor, width, impl, f"{t:.0f}" if t >= 100 else f"{t:.1f}")
                mem = r.get("peak_gib", {}).get(impl)
                if mem is not None:
                    _bar(ax_m, x, mem, width, impl,
                         f"{mem * 1024:.0f} MB" if mem < 1 else f"{mem:.2f} G")
        ax_t.axhline(1.0, color="k", lw=1, ls="--")
        handles = [Patch(color=COLORS[i], label=LABELS[i]) for i in bars]
        handles.append(Line2D([], [], color="k", lw=1, ls="--", label="3 GEMMs alone (floor) = 1"))
        ax_t.set_ylabel("fwd + bwd time / the 3 GEMMs' time\n(bar labels: ms)")
        ax_m.set_ylabel("peak memory beyond inputs (GiB)\n(bar labels: size)")
        for ax in (ax_t, ax_m):
            ax.set_xticks(range(len(recs)))
            ax.set_xticklabels(groups, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            ax.set_ylim(0, ax.get_ylim()[1] * 1.45)
        ax_t.legend(handles=handles, fontsize=7, loc="upper left", ncol=3)
        dates = sorted({r["date"] for r in recs})
        commits = sorted({r.get("commit", "") for r in recs})
        torches = sorted({r.get("torch", "") for r in recs})
        threads = {r.get("threads") for r in recs} - {None}
        where = device + (f", {threads.pop()} threads" if len(threads) == 1 else "")
        loads = [x for r in recs for x in (r.get("loadavg") or []) if x is not None]
        if loads:
            # A CPU shared with other work: its timings are contended ones (docs/benchmarks.md).
            where += f", load average {min(loads):.1f}-{max(loads):.1f}"
        ax_t.set_title(f"{where}: time (median), torch {', '.join(torches)}\n"
                       f"{', '.join(dates)}, commit {', '.join(commits)}", fontsize=9)
        ax_m.set_title(f"{where}: peak memory\n(forward + backward, gradients included)",
                       fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_train_lm(records, path):
    sys.path.insert(0, os.path.join(_records.REPO, "examples"))
    import train_lm

    recs = [r for r in records if r.get("op") == "train_lm"]
    if not recs:
        raise ValueError("no train_lm records")
    # The latest run of each (variant, dtype) at the latest record's configuration; the header
    # names the first one's date and commit (the stock run's).
    same = [r for r in recs if r["config"] == recs[-1]["config"]]
    train_lm.plot(_records.latest(same, lambda r: (r["variant"], r["dtype"])), path)


def draw(out=IMG, results=_records.RESULTS):
    """Draw every picture whose records exist; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    records = _records.read(os.path.join(results, "cpu.jsonl"), os.path.join(results, "gpu.jsonl"))
    written = []
    for name, fn, recs in (
            ("collapse.png", plot_collapse, records),
            ("distill_collapse.png", plot_distill_collapse, records),
            ("speed_memory.png", plot_speed_memory, records),
            ("train_lm.png", plot_train_lm,
             _records.read(os.path.join(results, "train_lm.jsonl")))):
        try:
            fn(recs, os.path.join(out, name))
        except ValueError as e:
            print(f"{name}: not drawn ({e})")
            continue
        written.append(os.path.join(out, name))
        print(f"wrote {written[-1]}")
    return written


# ---- the document --------------------------------------------------------------------------

def regions(results=_records.RESULTS):
    step = _records.read(os.path.join(results, "gpu.jsonl"), os.path.join(results, "cpu.jsonl"))
    train = _records.read(os.path.join(results, "train_lm.jsonl"))
    return {"results": results_region(step), "train_lm": train_lm_region(train)}


def marker(name, end=False):
    return f"<!-- generated:{name}:{'end' if end else 'begin'} -->"


def render(text, generated):
    """``text`` with each region's body replaced; every region must be in the text once."""
    for name, body in generated.items():
        begin, end = marker(name), marker(name, end=True)
        if text.count(begin) != 1 or text.count(end) != 1:
            raise ValueError(f"the doc needs exactly one {begin} and one {end}")
        a = text.index(begin) + len(begin)
        b = text.index(end)
        if b < a:
            raise ValueError(f"{end} before {begin}")
        text = text[:a] + "\n" + body.strip() + "\n" + text[b:]
    return text


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py report",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", default=DOC, help="the document (default: docs/benchmarks.md)")
    p.add_argument("--results", default=_records.RESULTS, help="folder of the records")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the doc's tables differ from the records'")
    args = p.parse_args(argv)
    with open(args.doc) as fh:
        old = fh.read()
    new = render(old, regions(args.results))
    if args.check:
        if new != old:
            print(f"{args.doc}: the generated tables differ from the records; run "
                  "`python benchmarks/run.py report`", file=sys.stderr)
            return 1
        print(f"{args.doc}: the generated tables match the records")
        return 0
    if new != old:
        with open(args.doc, "w") as fh:
            fh.write(new)
        print(f"rewrote the generated tables of {args.doc}")
    else:
        print(f"{args.doc}: already up to date")
    return 0


def plots_main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py plots",
                                description="Draw docs/img/*.png from the records.")
    p.add_argument("--out", default=IMG, help="folder of the pictures (default: docs/img)")
    p.add_argument("--results", default=_records.RESULTS, help="folder of the records")
    args = p.parse_args(argv)
    return draw(args.out, args.results)


if __name__ == "__main__":
    sys.exit(main())
