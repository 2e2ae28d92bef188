"""The linear step (`python benchmarks/run.py linear`): flce's fused linear cross-entropy against
its peers, forward + backward time, peak memory and loss accuracy at a large target margin;
distillation (`python benchmarks/run.py distill`): flce.linear_distillation against eager torch
and Liger on the same student and frozen teacher, beside flce.linear_cross_entropy on the
student alone (the memory reference) and the step's 5 GEMMs (the floor); and cross-entropy on
given logits (`python benchmarks/run.py ce`): flce.cross_entropy against its peers and the bytes'
floor (the logits read twice and the gradient written once at the copy rate of the same run).

A configuration is one (dtype, shape); every (implementation, configuration) runs in its own
fresh process, and a progress line is printed as each starts and ends. With --record, each
configuration's record (benchmarks/results/cpu.jsonl's format, benchmarks/_records.py) is
appended the moment the configuration is done. docs/benchmarks.md has examples and the method.
Take numbers on a quiet machine: the timings are medians, but a busy CPU still moves them (the
table and the record keep the load average before and after).
"""
import argparse
import copy
import csv
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
import _records  # noqa: E402

DEFAULT_PEERS = ("eager", "chunked", "cce", "gemm3")
DISTILL_PEERS = ("flce-fkl", "eager-jsd", "eager-fkl", "liger-jsd", "flce", "gemm5")
CSV_COLUMNS = ("impl", "device", "dtype", "N", "V", "D", "threads", "repeats", "status",
               "time_median_s", "time_min_s", "time_max_s", "peak_mem_mb", "peak_total_mb",
               "time_vs_flce", "mem_vs_flce", "loss", "acc_margin", "loss_rel_err",
               "time_first_s", "first_vs_median", "load", "loadavg_before", "loadavg_after",
               "isa", "cpu_gemm", "cpu", "rounds")


def parse_args(argv=None, distill=False):
    """``distill``: `run.py distill`'s implementations (base flce-jsd, floor gemm5)."""
    base, peers, choices = "flce", DEFAULT_PEERS, _peers.IMPLS[1:]
    if distill:
        base, peers, choices = "flce-jsd", DISTILL_PEERS, _peers.DISTILL[1:] + ("flce",)
    p = argparse.ArgumentParser(prog=f"benchmarks/run.py {'distill' if distill else 'linear'}",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--dtype", "--dtypes", dest="dtypes", default="fp32",
                   help=f"comma list from {tuple(_peers.DTYPES)} (default: %(default)s)")
    p.add_argument("-N", type=int, default=4096, help="tokens (rows)")
    p.add_argument("-V", type=int, default=32768, help="vocabulary size")
    p.add_argument("-D", type=int, default=512, help="hidden size")
    p.add_argument("--shapes", help="comma list of NxVxD, in place of -N -V -D")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (compiles, caches)")
    p.add_argument("--peers", default=",".join(peers),
                   help=f"comma-separated peers of {base} from {choices}; 'cce' and "
                        "'liger*' are skipped when not installed; 'gemm3' ('gemm5') is the floor, "
                        "the step's 3 (distillation's 5) GEMMs alone, on the CPU timed on "
                        "torch.mm and on flce's tile GEMMs ('-flce'), the faster kept "
                        "(default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the eager code")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    p.add_argument("--margin", type=float, default=40.0,
                   help="target margin of the accuracy side batch (default: %(default)s)")
    p.add_argument("--acc-V", type=int, default=8192, help="vocabulary of the accuracy side batch")
    p.add_argument("--acc-D", type=int, default=64, help="hidden size of the accuracy side batch")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--load", type=int, default=0,
                   help="competing busy processes (pure CPU spinning) running for the whole "
                        "measurement, at most --timeout seconds per child, killed at the end")
    p.add_argument("--isa", default="native", choices=("native", "avx2"),
                   help="avx2: emulate an AVX2-only CPU in the children (torch, oneDNN and MKL "
                        "stop at AVX2; docs/benchmarks.md)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the implementations' children this many times, interleaved, and "
                        "report the median of their medians (steadier on a shared machine)")
    p.add_argument("--csv", help="also write the results to this CSV file (every configuration)")
    p.add_argument("--record", help="append each configuration's record to this JSON-lines file "
                   "as it finishes (e.g. benchmarks/results/cpu.jsonl)")
    args = p.parse_args(argv)
    args.distill = distill
    args.dtype_list = _peers.names(p, "--dtype", args.dtypes, _peers.DTYPES)
    if args.shapes:
        args.shape_list = _peers.shapes(p, "--shapes", args.shapes, 3)
        args.N, args.V, args.D = args.shape_list[0]
    else:
        args.shape_list = [(args.N, args.V, args.D)]
    args.dtype = args.dtype_list[0]
    if args.load < 0:
        p.error("--load must be >= 0")
    if args.isa != "native" and args.device != "cpu":
        p.error("--isa applies to --device cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    for name in ("N", "V", "D", "repeats", "acc_V", "acc_D", "warmup", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"-{name if len(name) == 1 else '-' + name.replace('_', '-')} must be >= 1")
    peers = _peers.names(p, "--peers", args.peers, choices, empty=True)
    if args.compile and "compile" not in peers:
        peers.insert(peers.index("eager") + 1 if "eager" in peers else 0, "compile")
    for floor in ("gemm3", "gemm5"):
        if args.device == "cpu" and floor in peers and f"{floor}-flce" not in peers:
            peers.insert(peers.index(floor) + 1, f"{floor}-flce")
    args.impls = [base] + [s for s in peers if s != base]
    return args


def configurations(args):
    """One namespace per (dtype, shape) of ``args``, dtypes outermost."""
    out = []
    for dtype in args.dtype_list:
        for n, v, d in args.shape_list:
            cfg = copy.copy(args)
            cfg.dtype, cfg.N, cfg.V, cfg.D = dtype, n, v, d
            out.append(cfg)
    return out


def describe(args):
    return f"{args.device} {args.dtype} N={args.N} V={args.V} D={args.D}"


def skip_reason(name, args):
    reason = _peers.available(name)
    if reason is not None:
        return reason
    if name in ("gemm3-flce", "gemm5-flce") and args.device != "cpu":
        return "flce's tile-GEMM engine is the CPU backend's"
    if name == "liger" and args.device == "cpu":
        macs = args.N * args.V * args.D
        if macs > _peers.LIGER_CPU_MAX_MACS:
            return (f"Triton interpreter on CPU: N*V*D = {macs:.2g} > "
                    f"{_peers.LIGER_CPU_MAX_MACS:.2g}; use a smaller shape")
    return None


def _spec(name, args):
    return {"impl": name, "device": args.device, "dtype": args.dtype, "N": args.N, "V": args.V,
            "D": args.D, "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
            "margin": args.margin, "acc_V": args.acc_V, "acc_D": args.acc_D, "isa": args.isa,
            "accuracy": not args.distill}


def _merge(results):
    """One row from the rounds of one implementation: medians of the per-round values, the
    extremes of the extremes; memory and accuracy from the first round (they do not vary)."""
    row = dict(results[0])
    for key in ("time_median_s", "time_first_s"):
        row[key] = statistics.median(r[key] for r in results)
    row["time_min_s"] = min(r["time_min_s"] for r in results)
    row["time_max_s"] = max(r["time_max_s"] for r in results)
    return row


def run(args, progress):
    """Measure every implementation of ``args`` (one configuration); returns one row dict per
    implementation. ``progress`` (a _records.Progress) gets a step per child process."""
    rows = {}
    results = {name: [] for name in args.impls}
    for name in args.impls:
        row = {"impl": name, "device": args.device, "dtype": args.dtype, "N": args.N,
               "V": args.V, "D": args.D, "repeats": args.repeats, "load": args.load,
               "rounds": args.rounds}
        reason = skip_reason(name, args)
        if reason is not None:
            row["status"] = f"skipped: {reason}"
        rows[name] = row
    runnable = [n for n in args.impls if "status" not in rows[n]]
    before = os.getloadavg()[0]
    # The busy processes outlive every child by at most one child's timeout.
    budget = args.timeout * (len(runnable) * args.rounds + 1)
    with _peers.BusyLoad(args.load, budget):
        for rnd in range(args.rounds):
            for name in runnable:
                if rows[name].get("status", "").startswith("failed"):
                    continue
                tag = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
                progress.start(f"{describe(args)}: {name}{tag}")
                result = _peers.run_child(_spec(name, args), timeout=args.timeout)
                if "error" in result:
                    rows[name]["status"] = f"failed: {result['error']}"
                    msg = rows[name]["status"]
                else:
                    results[name].append(result)
                    msg = (f"{result['time_median_s']:.3f} s (first {result['time_first_s']:.3f}"
                           f" s), {result['peak_mem_bytes'] / 2 ** 20:.0f} MB")
                progress.done(msg)
    after = os.getloadavg()[0]
    from flce.check import device_name

    cpu = device_name("cpu") if args.device == "cpu" else ""
    for name in runnable:
        row = rows[name]
        row.update(loadavg_before=before, loadavg_after=after, cpu=cpu)
        if row.get("status", "").startswith("failed"):
            continue
        row.update(_merge(results[name]))
        row["status"] = "ok"
        row["peak_mem_mb"] = row["peak_mem_bytes"] / 2 ** 20
        row["peak_total_mb"] = row["peak_total_bytes"] / 2 ** 20
        row["first_vs_median"] = row["time_first_s"] / row["time_median_s"]
    rows = [rows[n] for n in args.impls]
    base = rows[0] if rows[0]["status"] == "ok" else None
    for row in rows:
        if base is not None and row["status"] == "ok":
            row["time_vs_flce"] = row["time_median_s"] / base["time_median_s"]
            row["mem_vs_flce"] = row["peak_mem_mb"] / max(base["peak_mem_mb"], 1e-9)
    return rows


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def floor_row(rows):
    """The floor of a run: the fastest of the floors it timed (_peers.FLOORS: the step's 3 GEMMs
    on torch.mm, and on flce's own tile-GEMM engine), or None."""
    ok = [r for r in rows if r["impl"] in _peers.FLOORS and r["status"] == "ok"]
    return min(ok, key=lambda r: r["time_median_s"]) if ok else None


def format_table(rows, args):
    wid = max([8] + [len(r["impl"]) for r in rows])  # the impl column
    fr = floor_row(rows)
    floor = fr and fr["time_median_s"]
    head = (f"{'impl':{wid}s} {'time (s)':>9s} {'x flce':>7s} {'x floor':>7s} {'first (s)':>9s} "
            f"{'/time':>6s} "
            f"{'peak MB':>8s} {'x flce':>7s} {'loss':>9s}"
            + ("" if args.distill else f" {'rel.err @ m=' + format(args.margin, 'g'):>14s}"))
    ok = [r for r in rows if r["status"] == "ok"]
    env = ""
    if ok:
        r0 = ok[0]
        gemm = next((r["cpu_gemm"] + (" (bf16 on AMX)" if r.get("cpu_amx") else "")
                     for r in ok if r.get("cpu_gemm")), None)
        env = (f"\n{r0.get('cpu') or args.device}, isa={r0.get('isa')}"
               f"{' (emulated: --isa avx2)' if args.isa == 'avx2' else ''}"
               f"{', cpu_gemm=' + gemm if gemm else ''}, load: {args.load} busy processes, "
               f"load average {r0['loadavg_before']:.2f} before, {r0['loadavg_after']:.2f} after")
    lines = [f"fwd+bwd, {args.device} {args.dtype}, N={args.N} V={args.V} D={args.D}, "
             f"median of {args.repeats} after {args.warmup} warm-up"
             f"{f' (median over {args.rounds} rounds)' if args.rounds > 1 else ''}, threads="
             f"{rows[0].get('threads', args.threads or torch.get_num_threads())}{env}",
             head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['impl']:{wid}s} {r['status']}")
            continue
        lines.append(f"{r['impl']:{wid}s} {r['time_median_s']:9.3f} "
                     f"{_fmt(r.get('time_vs_flce'), '7.2f')} "
                     f"{_fmt(floor and r['time_median_s'] / floor, '7.2f')} "
                     f"{r['time_first_s']:9.3f} "
                     f"{r['first_vs_median']:6.2f} {r['peak_mem_mb']:8.0f} "
                     f"{_fmt(r.get('mem_vs_flce'), '7.2f')} {r['loss']:9.5f}"
                     + ("" if args.distill else f" {_fmt(r.get('loss_rel_err'), '14.2e')}"))
    gemms = "gemm5" if args.distill else "gemm3"
    lines.append(f"x floor: time over the step's {gemms[-1]} GEMMs alone (the same shapes and "
                 f"dtype), the faster of torch.mm ({gemms}) and flce's tile GEMMs "
                 f"({gemms}-flce)" + (f": here {fr['impl']}." if fr else "."))
    lines.append(f"x flce: ratio to {args.impls[0]} (> 1: it is faster / smaller). first: the "
                 "process's first fwd+bwd, /time: its ratio to the median. peak MB: growth of "
                 "peak memory during one fwd+bwd above the inputs, gradients included.")
    if not args.distill:
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


def record(rows, args, argv=None):
    """The configuration's ``op: "linear_cross_entropy"`` record: median forward + backward time
    (``ms``) and peak memory growth (``peak_gib``, gradients included; not for the floor
    ``gemm3``) per implementation that ran, the loss's relative error at the side batch's margin,
    the floor (``floor``: the faster of the floors that ran, whose ratio docs/benchmarks.md
    reports) and how it was measured. Distillation's, ``op: "linear_distillation"``: no
    accuracy; ``beta`` (its JSD's) and ``grad_gib`` (the student's gradients, in every peak)."""
    ok = [r for r in rows if r["status"] == "ok"]
    fr = floor_row(rows)
    rec = _records.base(args.device, "linear_distillation" if args.distill
                        else "linear_cross_entropy")
    rec.update(dtype=_records.DTYPE_NAMES[args.dtype], n=args.N, v=args.V, d=args.D,
               repeats=args.repeats, rounds=args.rounds, load=args.load, isa=args.isa,
               cpu_gemm=next((r.get("cpu_gemm") for r in ok if r.get("cpu_gemm")), None),
               loadavg=[rows[0].get("loadavg_before"), rows[0].get("loadavg_after")],
               ms={r["impl"]: round(r["time_median_s"] * 1e3, 3) for r in ok},
               ms_range={r["impl"]: [round(r["time_min_s"] * 1e3, 3),
                                     round(r["time_max_s"] * 1e3, 3)] for r in ok},
               peak_gib={r["impl"]: round(r["peak_mem_mb"] / 1024, 5) for r in ok
                         if r["impl"] not in _peers.FLOORS},
               floor=fr and fr["impl"],
               loss_rel_err_m40={r["impl"]: r["loss_rel_err"] for r in ok
                                 if r.get("loss_rel_err") is not None},
               source=f"benchmarks/run.py {'distill' if args.distill else 'linear'}"
               + (f" {' '.join(argv)}" if argv else ""))
    if args.distill:  # the teacher is frozen: the student's gradients are in every peak
        del rec["loss_rel_err_m40"]
        rec.update(beta=_peers.BETA, grad_gib=round((args.N + args.V) * args.D * torch.finfo(
            _peers.DTYPES[args.dtype]).bits / 8 / 2 ** 30, 5))
    # (the name flce.check's records and `run.py ce`'s give the same fact)
    skipped = {r["impl"]: r["status"] for r in rows if r["status"] != "ok"}
    if skipped:
        rec["skipped"] = skipped
    if args.device == "cpu":  # as the children ran
        rec["threads"] = next((r["threads"] for r in ok if r.get("threads")), rec["threads"])
    if args.margin != 40.0:  # the key names margin 40; say so where it is another
        rec["loss_rel_err_margin"] = args.margin
    return rec


def main(argv=None, distill=False):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, distill)
    configs = configurations(args)
    runnable = sum(1 for cfg in configs for n in args.impls if skip_reason(n, cfg) is None)
    print(f"flce benchmark, {'distillation' if distill else 'the linear step'}: "
          f"{', '.join(args.impls)}; {len(configs)} "
          f"configuration(s), {runnable * args.rounds} child process(es)", flush=True)
    progress = _records.Progress(runnable * args.rounds)
    all_rows = []
    for cfg in configs:
        rows = run(cfg, progress)
        print()
        print(format_table(rows, cfg), flush=True)
        print()
        all_rows.extend(rows)
        if args.record:
            _records.append(args.record, record(rows, cfg, argv))
        if args.csv:  # rewritten after each configuration: what is done so far
            write_csv(all_rows, args.csv)
    if args.csv:
        print(f"wrote {args.csv}")
    return all_rows


def distill_main(argv=None):
    return main(argv, distill=True)


# ---- cross-entropy on given logits (`run.py ce`) -------------------------------------------------

def ce_main(argv=None):
    """`run.py ce`: one child per (shape, dtype, implementation); with --record each (shape,
    dtype)'s record appended when it is done, and rewritten to --partial after each
    implementation before that."""
    p = argparse.ArgumentParser(prog="benchmarks/run.py ce",
                                description="Cross-entropy on given logits: flce.cross_entropy "
                                "against its peers and the bytes' floor (docs/benchmarks.md).")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--shapes", default="4096x32768", help="NxV,NxV,...")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--impls", default=",".join(_peers.CE_IMPLS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--record", help="append one JSON record per (shape, dtype) to this file")
    p.add_argument("--partial", help="the (shape, dtype) in progress, rewritten after each "
                   "implementation (default: RECORD.partial; benchmarks/_records.py)")
    args = p.parse_args(argv)
    shapes = _peers.shapes(p, "--shapes", args.shapes, 2)
    dtypes = _peers.names(p, "--dtypes", args.dtypes, _peers.DTYPES)
    impls = _peers.names(p, "--impls", args.impls, _peers.CE_IMPLS)
    partial = args.partial or f"{args.record}.partial"
    runnable = [i for i in impls if _peers.ce_available(i, args.device) is None]
    progress = _records.Progress(len(shapes) * len(dtypes) * len(runnable))
    from flce.check import copy_rate

    for n, v in shapes:
        for dt in dtypes:
            nbytes = n * v * torch.finfo(_peers.DTYPES[dt]).bits // 8
            rate = copy_rate(args.device, nbytes)
            floor_ms = 1e3 * 3 * nbytes / rate
            res = {}
            for name in impls:
                why = _peers.ce_available(name, args.device)
                if why:
                    res[name] = {"skipped": why}
                    continue
                spec = dict(op="cross_entropy", impl=name, device=args.device, dtype=dt, n=n,
                            v=v, repeats=args.repeats, warmup=args.warmup, threads=args.threads)
                progress.start(f"{args.device} [{n}, {v}] {dt}: {name}")
                res[name] = r = _peers.run_child(spec, args.timeout)
                progress.done(f"{r['ms']:.2f} ms, {r['peak_gib']:.3f} GiB" if "ms" in r
                              else f"failed: {r.get('error')}")
                if args.record:  # what is measured so far, should the run be cut
                    _records.write_partial(partial, ce_record(n, v, dt, rate, floor_ms, res,
                                                                args.device, argv))
            print(ce_table(n, v, dt, rate, floor_ms, res, args.device), flush=True)
            if args.record:
                rec = ce_record(n, v, dt, rate, floor_ms, res, args.device, argv)
                rec["complete"] = True
                _records.finish(args.record, partial, rec)
    return 0


def ce_table(n, v, dt, rate, floor_ms, res, device):
    mb = n * v * torch.finfo(_peers.DTYPES[dt]).bits // 8 / 1e6
    lines = [f"\n{device} [{n}, {v}] {dt}: copy rate {rate / 1e9:.1f} GB/s, bytes' floor "
             f"{floor_ms:.2f} ms (3 x {mb:.0f} MB)",
             f"{'impl':14s} {'ms':>9s} {'x floor':>8s} {'x flce':>7s} {'peak GiB':>9s} "
             f"{'margin-40 err':>14s}"]
    base = res.get("flce", {}).get("ms")
    for name, r in res.items():
        if "ms" not in r:
            lines.append(f"{name:14s} {r.get('skipped') or r.get('error')}")
            continue
        rel = f"{r['ms'] / base:7.2f}" if base else "      -"
        lines.append(f"{name:14s} {r['ms']:9.2f} {r['ms'] / floor_ms:8.2f} {rel} "
                     f"{r['peak_gib']:9.3f} {r['margin40_rel_err']:14.2e}")
    return "\n".join(lines)


def ce_record(n, v, dt, rate, floor_ms, res, device="cuda", argv=None):
    """The (shape, dtype)'s ``op: "cross_entropy"`` record, in gpu.jsonl's format ("complete":
    false until done); ``source``: the command, as `run.py linear`'s records name theirs."""
    rec = _records.environment()
    if device == "cpu":  # the measured device, not the machine's GPU
        from flce.check import device_name

        rec.update(device=device_name("cpu"), threads=torch.get_num_threads())
    ok = {k: r for k, r in res.items() if "ms" in r}
    rec.update(op="cross_entropy", n=n, v=v, dtype=_records.DTYPE_NAMES[dt],
               ms={k: round(r["ms"], 4) for k, r in ok.items()},
               ms_range={k: [round(r["ms_min"], 4), round(r["ms_max"], 4)] for k, r in ok.items()},
               peak_gib={k: round(r["peak_gib"], 4) for k, r in ok.items()},
               margin40_rel_err={k: _records.sig(r["margin40_rel_err"], 3) for k, r in ok.items()},
               skipped={k: r["skipped"] for k, r in res.items() if "skipped" in r},
               errors={k: str(r["error"])[:300] for k, r in res.items() if "error" in r},
               copy_gb_s=round(rate / 1e9, 1),
               repeats=next((r["repeats"] for r in ok.values()), None), complete=False,
               source="benchmarks/run.py ce" + (f" {' '.join(argv)}" if argv else ""))
    rec["ms"]["bytes"] = round(floor_ms, 4)
    return rec


if __name__ == "__main__":
    main()
