"""Collective cost per step of vocab-parallel cross-entropy: flce vs Megatron's scheme (gloo, CPU).

flce's forward exchanges the row statistics with ONE all-gather of an [N, 4] fp32 tensor per
rank; Megatron-Core's vocab-parallel cross-entropy issues three all-reduces of [N] fp32 (row max,
predicted logit, sum-exp). Both then all-reduce dE [N, D] in backward (the same for both; shown
for scale). Each rank runs the collectives alone (no compute), median of repeats, in one process
group per world size.

    python benchmarks/run.py parallel [--world 2 4] [--tokens 4096 32768] [--dim 1024] \\
        [--record benchmarks/results/cpu.jsonl]

A progress line per world size; with --record, one record per world size (op:
vocab_parallel_collectives) is appended as soon as that world size is done.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)


def _median_ms(fn, repeats):
    fn()  # warm-up (connection setup, allocations)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def worker(tokens, dim, repeats):
    import torch
    import torch.distributed as dist
    from dist_launch import init_worker

    rank, world = init_worker()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    for n in tokens:
        partials = torch.randn(n, 4)
        out = torch.empty(world * n, 4)
        stats = [torch.randn(n) for _ in range(3)]
        de = torch.randn(n, dim)

        def flce_fwd():
            gather(out, partials)

        def megatron_fwd():
            dist.all_reduce(stats[0], op=dist.ReduceOp.MAX)
            dist.all_reduce(stats[1])
            dist.all_reduce(stats[2])

        def de_reduce():
            dist.all_reduce(de)

        # Alternate the peers so that drift on the shared machine hits both.
        t_f = [_median_ms(flce_fwd, repeats)]
        t_m = [_median_ms(megatron_fwd, repeats)]
        t_f.append(_median_ms(flce_fwd, repeats))
        t_m.append(_median_ms(megatron_fwd, repeats))
        t_e = _median_ms(de_reduce, max(3, repeats // 4))
        rows.append((n, min(t_f), min(t_m), t_e))
    dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps({"world": world, "d": dim, "repeats": repeats, "rows": [
            {"n": n, "flce_fwd_ms": tf, "megatron_fwd_ms": tm, "de_allreduce_ms": te}
            for n, tf, tm, te in rows]}))
        # Payload bytes per rank and step: what each rank contributes to the collectives.
        print(f"world={world}  D={dim}  (gloo, CPU, 127.0.0.1; median of {repeats})")
        print("| N | flce fwd: 1 all-gather [N,4] fp32 | Megatron fwd: 3 all-reduce [N] fp32 |"
              " flce ms | Megatron ms | Megatron/flce | bwd dE all-reduce [N,D] (both) |")
        print("|---|---|---|---|---|---|---|")
        for n, tf, tm, te in rows:
            print(f"| {n} | {16 * n:,} B in, {16 * n * world:,} B out | {12 * n:,} B |"
                  f" {tf:.3f} | {tm:.3f} | {tm / tf:.2f}x | {4 * n * dim:,} B, {te:.2f} ms |")
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py parallel",
                                description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--record", help="append one record per world size to this JSON-lines file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.tokens, args.dim, args.repeats)
        return 0
    import _records
    from dist_launch import launch

    progress = _records.Progress(len(args.world))
    failed = 0
    for world in args.world:
        progress.start(f"vocab-parallel collectives, world {world}, N in {args.tokens}")
        argv = ["--worker", "--tokens", *map(str, args.tokens), "--dim", str(args.dim),
                "--repeats", str(args.repeats)]
        results = launch(os.path.abspath(__file__), world, args=argv, timeout=300)
        result = None
        for rank, (rc, out) in enumerate(results):
            lines = out.strip().splitlines()
            if rank == 0:
                result = next((json.loads(ln[len("RESULT "):]) for ln in lines
                               if ln.startswith("RESULT ")), None)
                lines = [ln for ln in lines if not ln.startswith("RESULT ")]
            if rank == 0 or rc != 0:
                print("\n".join(lines))
        ok = result is not None and all(rc == 0 for rc, _ in results)
        failed += not ok
        progress.done("ok" if ok else "failed")
        if ok and args.record:
            rec = _records.base("cpu", "vocab_parallel_collectives")
            rec.update(result, backend="gloo", threads=1,
                       source="benchmarks/run.py parallel: median ms per step of each rank's "
                              "collectives alone")
            _records.append(args.record, rec)
        print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
