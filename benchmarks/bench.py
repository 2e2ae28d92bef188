"""Benchmark flce's fused linear cross-entropy against its peers: forward + backward time, peak
memory and loss accuracy at a large target margin.

    python benchmarks/bench.py                       # N=4096 V=32768 D=512, fp32, default peers
    python benchmarks/bench.py --dtype bf16 --compile --csv out.csv
    python benchmarks/bench.py -N 256 -V 4096 -D 64 --peers eager,chunked,liger

Every (implementation, shape) runs in its own fresh process; see docs/benchmarks.md for the
method. Take numbers on a quiet machine: the timings are medians, but a busy CPU still moves them.
"""
import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402

DEFAULT_PEERS = ("eager", "chunked", "cce")
CSV_COLUMNS = ("impl", "device", "dtype", "N", "V", "D", "threads", "repeats", "status",
               "time_median_s", "time_min_s", "time_max_s", "peak_mem_mb", "peak_total_mb",
               "time_vs_flce", "mem_vs_flce", "loss", "acc_margin", "loss_rel_err")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=tuple(_peers.DTYPES))
    p.add_argument("-N", type=int, default=4096, help="tokens (rows)")
    p.add_argument("-V", type=int, default=32768, help="vocabulary size")
    p.add_argument("-D", type=int, default=512, help="hidden size")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (compiles, caches)")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"comma-separated peers of flce from {_peers.IMPLS[1:]}; 'cce' and "
                        "'liger' are skipped when not installed (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the eager code")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    p.add_argument("--margin", type=float, default=40.0,
                   help="target margin of the accuracy side batch (default: %(default)s)")
    p.add_argument("--acc-V", type=int, default=8192, help="vocabulary of the accuracy side batch")
    p.add_argument("--acc-D", type=int, default=64, help="hidden size of the accuracy side batch")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--csv", help="also write the results to this CSV file")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    for name in ("N", "V", "D", "repeats", "acc_V", "acc_D"):
        if getattr(args, name) < 1:
            p.error(f"-{name if len(name) == 1 else '-' + name.replace('_', '-')} must be >= 1")
    peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in peers if s not in _peers.IMPLS[1:]]
    if unknown:
        p.error(f"--peers: unknown {unknown}; choose from {_peers.IMPLS[1:]}")
    if args.compile and "compile" not in peers:
        peers.insert(peers.index("eager") + 1 if "eager" in peers else 0, "compile")
    args.impls = ["flce"] + [s for s in peers if s != "flce"]
    return args


def skip_reason(name, args):
    reason = _peers.available(name)
    if reason is not None:
        return reason
    if name == "liger" and args.device == "cpu":
        macs = args.N * args.V * args.D
        if macs > _peers.LIGER_CPU_MAX_MACS:
            return (f"Triton interpreter on CPU: N*V*D = {macs:.2g} > "
                    f"{_peers.LIGER_CPU_MAX_MACS:.2g}; use a smaller shape")
    return None


def run(args, log=print):
    """Measure every implementation of ``args``; returns one row dict per implementation."""
    rows = []
    for name in args.impls:
        row = {"impl": name, "device": args.device, "dtype": args.dtype, "N": args.N,
               "V": args.V, "D": args.D, "repeats": args.repeats}
        reason = skip_reason(name, args)
        if reason is not None:
            row["status"] = f"skipped: {reason}"
            rows.append(row)
            continue
        log(f"  {name:8s} ...", end="", flush=True)
        spec = {"impl": name, "device": args.device, "dtype": args.dtype, "N": args.N,
                "V": args.V, "D": args.D, "repeats": args.repeats, "warmup": args.warmup,
                "threads": args.threads, "margin": args.margin, "acc_V": args.acc_V,
                "acc_D": args.acc_D}
        result = _peers.run_child(spec, timeout=args.timeout)
        if "error" in result:
            row["status"] = f"failed: {result['error']}"
            log(f" {row['status']}")
        else:
            row.update(result)
            row["status"] = "ok"
            row["peak_mem_mb"] = result["peak_mem_bytes"] / 2 ** 20
            row["peak_total_mb"] = result["peak_total_bytes"] / 2 ** 20
            log(f" {row['time_median_s']:.3f} s, {row['peak_mem_mb']:.0f} MB")
        rows.append(row)
    base = rows[0] if rows[0]["status"] == "ok" else None
    for row in rows:
        if base is not None and row["status"] == "ok":
            row["time_vs_flce"] = row["time_median_s"] / base["time_median_s"]
            row["mem_vs_flce"] = row["peak_mem_mb"] / max(base["peak_mem_mb"], 1e-9)
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def format_table(rows, args):
    head = (f"{'impl':8s} {'time (s)':>9s} {'x flce':>7s} {'peak MB':>8s} {'x flce':>7s} "
            f"{'loss':>9s} {'rel.err @ m=' + format(args.margin, 'g'):>14s}")
    lines = [f"fwd+bwd, {args.device} {args.dtype}, N={args.N} V={args.V} D={args.D}, "
             f"median of {args.repeats} after {args.warmup} warm-up, threads="
             f"{rows[0].get('threads', args.threads or torch.get_num_threads())}",
             head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['impl']:8s} {r['status']}")
            continue
        lines.append(f"{r['impl']:8s} {r['time_median_s']:9.3f} "
                     f"{_fmt(r.get('time_vs_flce'), '7.2f')} {r['peak_mem_mb']:8.0f} "
                     f"{_fmt(r.get('mem_vs_flce'), '7.2f')} {r['loss']:9.5f} "
                     f"{_fmt(r.get('loss_rel_err'), '14.2e')}")
    lines.append("x flce: ratio to flce (> 1: flce is faster / smaller). peak MB: growth of peak "
                 "memory during one fwd+bwd above the inputs, gradients included.")
    lines.append(f"rel.err: |loss - float64 collapse-safe reference| / reference on a "
                 f"{args.acc_V}x{args.acc_D} side batch at target margin ~{args.margin:g} "
                 "(1.00 = the loss came out as exactly 0).")
    return "\n".join(lines)


def write_csv(rows, path):
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k, "") for k in CSV_COLUMNS})


def main(argv=None):
    args = parse_args(argv)
    print(f"flce benchmark: {', '.join(args.impls)}", flush=True)
    rows = run(args)
    print()
    print(format_table(rows, args))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
