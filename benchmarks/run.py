"""flce's benchmarks, one entry point: python benchmarks/run.py SUBCOMMAND [options]

  linear     the linear step: flce.linear_cross_entropy forward + backward against its peers
             and the step's 3 GEMMs (time, peak memory, loss at a large margin)
  ce         cross-entropy on given logits: flce.cross_entropy against its peers and the
             bytes' floor
  accuracy   dW's accuracy when the CUDA single pass accumulates it over row groups (the same
             arithmetic on the CPU, against float64; the probe tools/probes/accumulation.py)
  parallel   the collectives of vocab-parallel cross-entropy: flce's against Megatron's (gloo)
  collapse   the loss's relative error against float64 at target margins 0-100 (the record
             behind docs/img/collapse.png); --distill: distillation's loss and student
             gradient (docs/img/distill_collapse.png)
  distill    flce.linear_distillation against eager torch and Liger, beside the 5 GEMMs
             (time, peak memory)
  profile    warm-up and profiled steps for nsys / ncu / torch.profiler (docs/profiling.md)
  demo       the two-minute tour: collapse, gradient accuracy, one cost line
  gpu-check  benchmarks/gpu/check.sh on a GPU machine: headline | rest [--plan]
  plots      draw docs/img/*.png from the records in benchmarks/results/
  report     rewrite docs/benchmarks.md's result tables from the records (--check: compare only)

`python benchmarks/run.py SUBCOMMAND --help` lists a subcommand's options. The measuring
subcommands print a progress line as each configuration starts and ends (elapsed time, and the
time left once one is done), and with --record PATH append one JSON line per configuration as
soon as it is measured (benchmarks/_records.py; the committed ones are in benchmarks/results/).
Method and current results: docs/benchmarks.md.
"""
import importlib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the probes that have a subcommand (accuracy: tools/probes/accumulation.py)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tools", "probes"))

COLLAPSE_MARGINS = tuple(range(0, 105, 5))


def collapse_record(device="cpu", v=8192, d=64, n=16, margins=COLLAPSE_MARGINS, progress=None):
    """The mean loss's relative error against the float64 collapse-safe reference, fp32 inputs,
    per implementation and target margin (rows built by _peers.margin_batch, the reference
    computed from the same rounded tensors). ``progress``: a step per margin."""
    import torch

    import _peers
    import _records

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


def distill_collapse_record(v=4096, d=64, n=8, margins=COLLAPSE_MARGINS, progress=None):
    """Relative errors against float64 (flce.reference.distillation of the same rounded fp32
    tensors) of distillation's mean loss and of the student classifier's gradient rows at its
    dominant classes (norm-wise), per implementation and divergence (``IMPL-jsd``, beta
    _peers.BETA; ``IMPL-fkl``, forward KL), margin and case: "agree", the teacher confident on
    the student's class (the student's batch moved to margin + 1, so that the two distributions
    differ by ~e^-margin), "disagree", on another class (a batch of its own seed). ``ref``: the
    references' magnitudes, per case and divergence (below fp32's normal range, 2^-126, no fp32
    result can be accurate)."""
    import torch

    import _peers
    import _records
    import flce.reference

    impls = [i for i in ("flce", "eager", "liger") if i != "liger"
             or _peers.available("liger") is None]
    divs = {"jsd": _peers.BETA, "fkl": 0.0}
    rel = {c: {f"{i}-{k}": {"loss": [], "grad": []} for i in impls for k in divs}
           for c in ("agree", "disagree")}
    mag = {c: {k: {"loss": [], "grad": []} for k in divs} for c in rel}
    for m in margins:
        if progress is not None:
            progress.start(f"distillation collapse, margin {m}")
        for case, errs in rel.items():
            x, w, a, _ = _peers.margin_batch(n, v, d, m, torch.float32, seed=m)
            agree = case == "agree"
            x_t, w_t, _, _ = _peers.margin_batch(n, v, d, m + agree, torch.float32,
                                                 seed=m + (0 if agree else 1000))
            for div, beta in divs.items():
                w_ref = w.double().requires_grad_(True)
                ref = flce.reference.distillation(x.double() @ w_ref.T,
                                                  x_t.double() @ w_t.double().T,
                                                  divergence="jsd", beta=beta)
                ref.backward()
                ref, g_ref = float(ref.detach()), w_ref.grad[a]
                mag[case][div]["loss"].append(abs(ref))
                mag[case][div]["grad"].append(float(g_ref.norm()))
                for i in impls:
                    w_i = w.clone().requires_grad_(True)
                    loss = _peers.distill_impl(f"{i}-{div}", compiled=False)(x, w_i, x_t, w_t)
                    loss.backward()
                    e = errs[f"{i}-{div}"]
                    e["loss"].append(abs(float(loss.detach()) - ref) / abs(ref))
                    e["grad"].append(float((w_i.grad[a].double() - g_ref).norm() / g_ref.norm()))
        if progress is not None:
            progress.done(", ".join(f"{i} {e['grad'][-1]:.1e}" for i, e in rel["agree"].items())
                          + " (agreeing, gradient)")
    rec = _records.base("cpu", "distill_collapse")
    rec.update(dtype="float32", n=n, v=v, d=d, beta=_peers.BETA, margins=list(margins),
               rel_err=rel, ref=mag, source="benchmarks/run.py collapse --distill: |x - float64 "
               "reference| / |reference| of the mean loss and of the student classifier's "
               "gradient rows at its dominant classes")
    return rec


def _collapse(argv):
    import argparse

    import _records

    p = argparse.ArgumentParser(prog="benchmarks/run.py collapse",
                                description="The mean loss's relative error against the float64 "
                                "collapse-safe reference at target margins 0, 5, ..., 100 (fp32), "
                                "per implementation.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--distill", action="store_true",
                   help="distillation's loss and student gradient instead (the CPU; -V 4096 "
                        "-N 8 unless given)")
    p.add_argument("-V", type=int)
    p.add_argument("-D", type=int, default=64)
    p.add_argument("-N", type=int, help="tokens per margin")
    p.add_argument("--margins", default=",".join(map(str, COLLAPSE_MARGINS)))
    p.add_argument("--record", help="append the record to this file "
                   "(benchmarks/results/cpu.jsonl for the README's picture)")
    args = p.parse_args(argv)
    margins = tuple(int(m) for m in args.margins.split(","))
    progress = _records.Progress(len(margins))
    if args.distill:
        rec = distill_collapse_record(args.V or 4096, args.D, args.N or 8, margins, progress)
    else:
        rec = collapse_record(args.device, args.V or 8192, args.D, args.N or 16, margins,
                              progress=progress)
    if args.record:
        _records.append(args.record, rec)
    return 0


def _gpu_check(argv):
    return subprocess.call(["bash", os.path.join(HERE, "gpu", "check.sh"), *argv])


# The subcommands that are a module's main(argv) (or MODULE.FUNCTION(argv)); its exit status,
# where it returns one.
MODULES = {"linear": "bench", "ce": "bench.ce_main", "accuracy": "accumulation",
           "parallel": "bench_parallel", "profile": "profile_step", "demo": "demo",
           "distill": "bench.distill_main", "report": "report", "plots": "report.plots_main"}


def _module(name):
    def command(argv):
        module, _, function = name.partition(".")
        rc = getattr(importlib.import_module(module), function or "main")(argv)
        return rc if isinstance(rc, int) else 0
    return command


COMMANDS = {**{k: _module(m) for k, m in MODULES.items()}, "collapse": _collapse,
            "gpu-check": _gpu_check}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"benchmarks/run.py: unknown subcommand {name!r}; one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return COMMANDS[name](rest) or 0


if __name__ == "__main__":
    sys.exit(main())
