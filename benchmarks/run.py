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
  distill    flce.linear_distillation against eager torch and Liger, beside the 5 GEMMs;
             --collapse: its error against float64 at margins 0-100 (docs/img/distill_collapse.png)
  profile    warm-up and profiled steps for nsys / ncu / torch.profiler (docs/profiling.md)
  demo       the two-minute tour: collapse, gradient accuracy, one cost line
  gpu-check  benchmarks/gpu_check.sh on a GPU machine: headline | rest [--plan]
  plots      draw docs/img/*.png from the records in benchmarks/results/
  report     rewrite docs/benchmarks.md's result tables from the records (--check: compare only)

`python benchmarks/run.py SUBCOMMAND --help` lists a subcommand's options. The measuring
subcommands print a progress line as each configuration starts and ends (elapsed time, and the
time left once one is done), and with --record PATH append one JSON line per configuration as
soon as it is measured (benchmarks/_records.py; the committed ones are in benchmarks/results/).
Method and current results: docs/benchmarks.md.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _linear(argv):
    import bench

    bench.main(argv)
    return 0


def _ce(argv):
    import bench_ce

    return bench_ce.main(argv)


def _accuracy(argv):
    import accumulation

    accumulation.main(argv)
    return 0


def _parallel(argv):
    import bench_parallel

    return bench_parallel.main(argv)


def _collapse(argv):
    import argparse

    import _records
    import plots
    from _progress import Progress

    p = argparse.ArgumentParser(prog="benchmarks/run.py collapse",
                                description="The mean loss's relative error against the float64 "
                                "collapse-safe reference at target margins 0, 5, ..., 100 (fp32), "
                                "per implementation.")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("-V", type=int, default=8192)
    p.add_argument("-D", type=int, default=64)
    p.add_argument("-N", type=int, default=16, help="tokens per margin")
    p.add_argument("--margins", default=",".join(map(str, plots.COLLAPSE_MARGINS)))
    p.add_argument("--record", help="append the record to this file "
                   "(benchmarks/results/cpu.jsonl for the README's picture)")
    args = p.parse_args(argv)
    margins = tuple(int(m) for m in args.margins.split(","))
    rec = plots.collapse_record(args.device, args.V, args.D, args.N, margins,
                                progress=Progress(len(margins)))
    if args.record:
        _records.append(args.record, rec)
    return 0


def _distill(argv):
    import bench_distill

    return bench_distill.main(argv)


def _profile(argv):
    import profile_step

    profile_step.main(argv)
    return 0


def _demo(argv):
    import demo

    demo.main(argv)
    return 0


def _gpu_check(argv):
    return subprocess.call(["bash", os.path.join(HERE, "gpu_check.sh"), *argv])


def _plots(argv):
    import plots

    plots.main(argv)
    return 0


def _report(argv):
    import report

    return report.main(argv)


COMMANDS = {"linear": _linear, "ce": _ce, "accuracy": _accuracy, "parallel": _parallel,
            "collapse": _collapse, "distill": _distill, "profile": _profile, "demo": _demo,
            "gpu-check": _gpu_check, "plots": _plots, "report": _report}


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
