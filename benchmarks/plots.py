"""The README's pictures, drawn from the committed result records (`python benchmarks/run.py
plots`, or this file run alone).

    python benchmarks/plots.py                # draw docs/img/*.png from benchmarks/results/
    python benchmarks/plots.py --out /tmp/img # somewhere else

Records are JSON lines (benchmarks/_records.py). ``op: "linear_cross_entropy"`` records (GPU
ones in gpu.jsonl, CPU ones in cpu.jsonl; `run.py linear --record`) hold one configuration's
forward + backward median times in ``ms`` and peak memory in ``peak_gib`` per implementation,
``gemm3`` being the step's 3 GEMMs alone (the floor). ``op: "collapse"`` records (`run.py
collapse`) hold, per implementation, the mean loss's relative error against flce's float64
collapse-safe reference at each target margin. ``op: "train_lm"`` records are
examples/train_lm.py's runs. Every record names its date, device and commit.

Pictures: ``collapse.png`` (loss error against the margin), ``speed_memory.png`` (time over the
3-GEMM floor and peak memory per implementation, one row per device) and ``train_lm.png`` (the
latest train_lm run's loss curves).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
import _records  # noqa: E402

IMG = os.path.join(_records.REPO, "docs", "img")

# The implementations as the pictures name them, in drawing order.
LABELS = {"flce": "flce", "flce_recompute": "flce (recompute path)", "eager": "F.cross_entropy",
          "compile": "torch.compile(F.cross_entropy)",
          "chunked": "torch F.linear_cross_entropy", "liger": "Liger (Triton)",
          "cce": "Cut Cross Entropy", "gemm3": "3 GEMMs alone (floor)"}
COLORS = {"flce": "C3", "flce_recompute": "C1", "eager": "C0", "compile": "C2", "chunked": "C4",
          "liger": "C5", "cce": "C6", "gemm3": "0.6"}
COLLAPSE_MARGINS = tuple(range(0, 105, 5))


# ---- records -------------------------------------------------------------------------------

def collapse_record(device="cpu", v=8192, d=64, n=16, margins=COLLAPSE_MARGINS, progress=None):
    """The mean loss's relative error against the float64 collapse-safe reference, fp32 inputs,
    per implementation and target margin (rows built by _peers.margin_batch, the reference
    computed from the same rounded tensors). ``progress``: a step per margin."""
    impls = [i for i in ("flce", "eager", "compile", "chunked", "liger", "cce")
             if _peers.available(i) is None and not (i == "liger" and device == "cpu")]
    fns = {i: _peers.make_impl(i, device) for i in impls}
    rel = {i: [] for i in impls}
    got_margins = []
    for m in margins:
        if progress is not None:
            progress.start(f"collapse, margin {m}")
        for i in impls:
            err, mean_margin, _, _ = _peers.large_margin_error(fns[i], v, d, torch.float32,
                                                               device, float(m), n=n, seed=m)
            rel[i].append(err)
        got_margins.append(mean_margin)
        if progress is not None:
            progress.done(", ".join(f"{i} {rel[i][-1]:.1e}" for i in impls))
    rec = _records.base(device, "collapse")
    rec.update(dtype="float32", n=n, v=v, d=d, margins=list(margins),
               mean_margins=got_margins, rel_err=rel,
               source="benchmarks/run.py collapse: |mean loss - float64 reference| / reference")
    return rec


# ---- pictures ------------------------------------------------------------------------------

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _latest(records, key):
    """The last record for each ``key(record)``, in first-seen order of the keys."""
    out = {}
    for r in records:
        out.pop(key(r), None)
        out[key(r)] = r
    return list(out.values())


def plot_collapse(records, path):
    recs = [r for r in records if r.get("op") == "collapse"]
    if not recs:
        raise ValueError("no collapse records")
    rec = recs[-1]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    floor = 2.0 ** -24
    for impl in LABELS:
        if impl not in rec["rel_err"]:
            continue
        # Exactly equal to the reference would be -inf on a log axis: drawn at the floor / 10.
        ys = [max(e, floor / 10) for e in rec["rel_err"][impl]]
        # The peers collapse together: distinct line styles keep each one visible.
        style = {"flce": dict(lw=2.5, marker="o", ms=4),
                 "eager": dict(lw=4, alpha=0.45, marker="s", ms=6),
                 "compile": dict(lw=1.5, ls="--", marker="^", ms=4),
                 "chunked": dict(lw=1.2, ls=":", marker="v", ms=4)}.get(impl, dict(lw=1.2))
        ax.semilogy(rec["margins"], ys, color=COLORS[impl], label=LABELS[impl], **style)
    mid = rec["margins"][len(rec["margins"]) // 3]
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.text(mid, 1.5, "relative error 1: the loss came out as exactly 0", fontsize=8)
    ax.axhline(floor, color="0.5", lw=0.8, ls=":")
    ax.text(mid, floor * 1.5, "fp32 unit roundoff 2^-24", fontsize=8, color="0.4")
    ax.set_ylim(floor / 20, 30)
    ax.set_xlabel("target margin  z_t - max_{j != t} z_j")
    ax.set_ylabel("|loss - float64 reference| / reference")
    ax.set_title(f"Loss collapse at large margins: mean loss of {rec['n']} tokens, fp32, "
                 f"V = {rec['v']}, "
                 f"D = {rec['d']}\n{rec['device']}, torch {rec['torch']}, {rec['date']}, "
                 f"commit {rec['commit']}", fontsize=9)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    recs = _latest(recs, _records.config_key)
    devices = list(dict.fromkeys(r["device"] for r in recs))
    return [(dev, [r for r in recs if r["device"] == dev]) for dev in devices]


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
                    ax_t.bar(x, t / floor, width, color=COLORS[impl])
                    ax_t.text(x, t / floor, f"{t:.0f}" if t >= 100 else f"{t:.1f}",
                              ha="center", va="bottom", fontsize=6.5, rotation=90)
                mem = r.get("peak_gib", {}).get(impl)
                if mem is not None:
                    ax_m.bar(x, mem, width, color=COLORS[impl])
                    ax_m.text(x, mem, f"{mem * 1024:.0f} MB" if mem < 1 else f"{mem:.2f} G",
                              ha="center", va="bottom", fontsize=6.5, rotation=90)
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
    train_lm.plot(_latest(same, lambda r: (r["variant"], r["dtype"])), path)


def draw(out=IMG, results=_records.RESULTS):
    """Draw every picture whose records exist; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    records = _records.read(os.path.join(results, "cpu.jsonl"), os.path.join(results, "gpu.jsonl"))
    written = []
    for name, fn, recs in (
            ("collapse.png", plot_collapse, records),
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py plots",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=IMG, help="folder of the pictures (default: docs/img)")
    p.add_argument("--results", default=_records.RESULTS, help="folder of the records")
    args = p.parse_args(argv)
    return draw(args.out, args.results)


if __name__ == "__main__":
    main()
