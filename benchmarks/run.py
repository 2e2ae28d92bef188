"""flce's benchmarks, one entry point: python benchmarks/run.py SUBCOMMAND [options]

  linear     the linear step: flce.linear_cross_entropy forward + backward against its peers
             and the step's 3 GEMMs (time, peak memory, loss at a large margin)
  ce         cross-entropy on given logits: flce.cross_entropy against its peers and the
             bytes' floor
  accuracy   dW's accuracy when the CUDA single pass accumulates it over row groups (the same
             arithmetic on the CPU, against float64)
  parallel   the collectives of vocab-parallel cross-entropy: flce's against Megatron's (gloo)
  collapse   the loss's relative error against float64 at target margins 0-100 (the record
             behind docs/img/collapse.png)
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


def _collapse(argv):
    import argparse

    import _records

    p = argparse.ArgumentParser(prog="benchmarks/run.py collapse",
                                description="The mean loss's relative error against the float64 "
                                "collapse-safe reference at target margins 0, 5, ..., 100 (fp32), "
                                "per implementation.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("-V", type=int, default=8192)
    p.add_argument("-D", type=int, default=64)
    p.add_argument("-N", type=int, default=16, help="tokens per margin")
    p.add_argument("--margins", default=",".join(map(str, COLLAPSE_MARGINS)))
    p.add_argument("--record", help="append the record to this file "
                   "(benchmarks/results/cpu.jsonl for the README's picture)")
    args = p.parse_args(argv)
    margins = tuple(int(m) for m in args.margins.split(","))
    rec = collapse_record(args.device, args.V, args.D, args.N, margins,
                                progress=_records.Progress(len(margins)))
    if args.record:
        _records.append(args.record, rec)
    return 0


def _gpu_check(argv):
    return subprocess.call(["bash", os.path.join(HERE, "gpu", "check.sh"), *argv])


# The subcommands that are a module's main(argv) (or MODULE.FUNCTION(argv)); its exit status,
# where it returns one.
MODULES = {"linear": "bench", "ce": "bench_ce", "accuracy": "accumulation",
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
