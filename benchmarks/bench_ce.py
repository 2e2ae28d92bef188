"""Cross-entropy on given logits (`python benchmarks/run.py ce`): flce.cross_entropy against its
peers, forward + backward time, peak memory beyond the inputs, the bytes' floor, and the loss at
a large margin.

    python benchmarks/run.py ce                            # CPU: [4096, 32768] fp32 and bf16
    python benchmarks/run.py ce --device cuda --shapes 16384x64128,16384x128256 --dtypes bf16 \\
        --record benchmarks/results/gpu.jsonl

A progress line is printed as each (configuration, implementation) starts and ends; with
--record, a configuration's record is appended as soon as it is done (and rewritten to
--partial after each implementation before that).

Each implementation runs in a fresh process, every repeat on the same logits; they, the floor
("bytes": the logits read twice and the gradient written once at the copy rate measured in the
same run) and the method are in docs/benchmarks.md. flce_inplace runs on logits that an op
produced, as a model's are (a clone of the leaf, made outside the timed region: flce refuses a
leaf). Memory: the peak above what was allocated before the step (the logits, targets and
nothing else), which includes the gradient.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402
import _records  # noqa: E402

IMPLS = ("flce", "flce_inplace", "eager", "compiled", "native", "composite", "liger")


def make_impl(name):
    import torch.nn.functional as F

    if name in ("flce", "flce_inplace"):
        import flce

        inplace = name == "flce_inplace"
        return lambda z, t: flce.cross_entropy(z, t, inplace_backward=inplace)
    if name == "eager":
        return lambda z, t: F.cross_entropy(z.float(), t)
    if name == "compiled":
        return torch.compile(lambda z, t: F.cross_entropy(z.float(), t))
    if name == "native":
        return lambda z, t: F.cross_entropy(z, t)
    if name == "composite":
        from flce import _common, _composite

        opts = _common.Options()

        def composite(z, t):
            loss = _composite.logits_per_token(z.float(), t, opts)[0]
            return loss.sum() / (t != -100).sum()
        return composite
    if name == "liger":
        from liger_kernel.transformers import LigerCrossEntropyLoss

        return LigerCrossEntropyLoss()
    raise ValueError(name)


def available(name, device):
    if name == "liger":
        if device != "cuda":
            return "Triton kernels: CUDA only"
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "not installed"
    return None


def inputs(n, v, dtype, device, seed=0):
    """Logits ~ N(0, 4) and targets with 5 % ignored, drawn where they are used (on a GPU: not
    billions of numbers drawn on the CPU and copied over, in every child process)."""
    g = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(n, v, generator=g, device=device, dtype=dtype).mul_(2)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    t[torch.rand(n, generator=g, device=device) < 0.05] = -100
    return z, t


def measure(spec):
    """One implementation at one shape, in this (child) process."""
    name, device = spec["impl"], spec["device"]
    dtype = _peers.DTYPES[spec["dtype"]]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    f = make_impl(name)
    z0, t = inputs(spec["n"], spec["v"], dtype, device)
    x = z0.requires_grad_()
    inplace = name == "flce_inplace"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def logits():
        """The step's logits: the leaf, or for the in-place path a non-leaf copy of it."""
        x.grad = None
        z = x.clone() if inplace else x
        sync()
        return z

    def step(z):
        start = time.perf_counter()
        loss = f(z, t)
        loss.backward()
        sync()
        return time.perf_counter() - start, loss

    for _ in range(spec["warmup"]):
        step(logits())
    times = [step(logits())[0] for _ in range(spec["repeats"])]
    z = logits()
    from flce.check import Peak  # (a peer's process loads flce only here, where it measures)

    with Peak(device) as mem:
        _, loss = step(z)
    del z
    out = {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
           "ms_max": 1e3 * max(times), "repeats": len(times), "peak_gib": mem.bytes / 2 ** 30,
           "loss": float(loss.detach())}
    # the loss at a large margin (40) against float64 on the same logits: 1.0 for a peer that
    # collapses to 0
    out["margin40_rel_err"] = margin_error(f, dtype, device)
    return out


def margin_error(f, dtype, device, v=4096, margin=40.0, n=8):
    import flce

    g = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(n, v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    others = z.scatter(1, t[:, None], -math.inf).amax(1)
    z.scatter_(1, t[:, None], (others + margin)[:, None])
    z = z.to(dtype)
    ref = flce.reference.logits_cross_entropy(z.double(), t).item()
    # (a non-leaf, as the timed steps' in-place logits)
    got = f(z.to(device).requires_grad_().clone(), t.to(device)).item()
    return abs(got - ref) / ref


def copy_rate(n, v, dtype, device, repeats=5):
    """Bytes per second of a clone of a [n, v] tensor (read + write)."""
    z = torch.empty(n, v, dtype=dtype, device=device).normal_()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        y = z.clone()
        sync()
        times.append(time.perf_counter() - start)
        del y
    return 2 * z.numel() * z.element_size() / statistics.median(times[1:])


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks/run.py ce",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--shapes", default="4096x32768", help="NxV,NxV,...")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--record", help="append one JSON record per (shape, dtype) to this file")
    p.add_argument("--partial", help="the (shape, dtype) in progress, rewritten after each "
                   "implementation (default: RECORD.partial; benchmarks/_records.py)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))), flush=True)
        return 0
    shapes = _peers.shapes(p, "--shapes", args.shapes, 2)
    dtypes = _peers.names(p, "--dtypes", args.dtypes, _peers.DTYPES)
    impls = _peers.names(p, "--impls", args.impls, IMPLS)
    partial = args.partial or f"{args.record}.partial"
    runnable = [i for i in impls if available(i, args.device) is None]
    progress = _records.Progress(len(shapes) * len(dtypes) * len(runnable))
    rows = []
    for n, v in shapes:
        for dt in dtypes:
            dtype = _peers.DTYPES[dt]
            rate = copy_rate(n, v, dtype, args.device)
            floor_ms = 1e3 * 3 * n * v * torch.finfo(dtype).bits / 8 / rate
            res = {}
            for name in impls:
                why = available(name, args.device)
                if why:
                    res[name] = {"skipped": why}
                    continue
                spec = dict(impl=name, device=args.device, dtype=dt, n=n, v=v,
                            repeats=args.repeats, warmup=args.warmup, threads=args.threads)
                progress.start(f"{args.device} [{n}, {v}] {dt}: {name}")
                res[name] = _peers.run_child(spec, args.timeout,
                                             script=(os.path.abspath(__file__), "--child"))
                r = res[name]
                progress.done(f"{r['ms']:.2f} ms, {r['peak_gib']:.3f} GiB" if "ms" in r
                              else f"failed: {r.get('error')}")
                if args.record:  # what is measured so far, should the run be cut
                    _records.write_partial(partial, make_record(n, v, dt, rate, floor_ms, res,
                                                                  args.device))
            rows.append((n, v, dt, rate, floor_ms, res))
            print_table(rows[-1:], args.device)
            if args.record:
                rec = make_record(n, v, dt, rate, floor_ms, res, args.device)
                rec["complete"] = True
                _records.finish(args.record, partial, rec)
    return 0


def print_table(rows, device):
    for n, v, dt, rate, floor_ms, res in rows:
        mb = n * v * torch.finfo(_peers.DTYPES[dt]).bits // 8 / 1e6
        print(f"\n{device} [{n}, {v}] {dt}: copy rate {rate / 1e9:.1f} GB/s, bytes' floor "
              f"{floor_ms:.2f} ms (3 x {mb:.0f} MB)")
        print(f"{'impl':14s} {'ms':>9s} {'x floor':>8s} {'x flce':>7s} {'peak GiB':>9s} "
              f"{'margin-40 err':>14s}")
        base = res.get("flce", {}).get("ms")
        for name, r in res.items():
            if "ms" not in r:
                print(f"{name:14s} {r.get('skipped') or r.get('error')}")
                continue
            rel = f"{r['ms'] / base:7.2f}" if base else "      -"
            print(f"{name:14s} {r['ms']:9.2f} {r['ms'] / floor_ms:8.2f} {rel} "
                  f"{r['peak_gib']:9.3f} {r['margin40_rel_err']:14.2e}")


def make_record(n, v, dt, rate, floor_ms, res, device="cuda"):
    """The (shape, dtype)'s record in gpu.jsonl's format ("complete": false until done)."""
    rec = _records.environment()
    if device == "cpu":  # the measured device, not the machine's GPU
        from flce.check import device_name

        rec.update(device=device_name("cpu"), threads=torch.get_num_threads())
    rec.update(op="cross_entropy", n=n, v=v, dtype=_records.DTYPE_NAMES[dt],
               ms={k: round(r["ms"], 4) for k, r in res.items() if "ms" in r},
               ms_range={k: [round(r["ms_min"], 4), round(r["ms_max"], 4)]
                         for k, r in res.items() if "ms" in r},
               peak_gib={k: round(r["peak_gib"], 4) for k, r in res.items() if "ms" in r},
               margin40_rel_err={k: _records.sig(r["margin40_rel_err"], 3)
                                 for k, r in res.items() if "ms" in r},
               skipped={k: r["skipped"] for k, r in res.items() if "skipped" in r},
               errors={k: str(r["error"])[:300] for k, r in res.items() if "error" in r},
               copy_gb_s=round(rate / 1e9, 1), repeats=res_repeats(res), complete=False)
    rec["ms"]["bytes"] = round(floor_ms, 4)
    return rec


def res_repeats(res):
    return next((r["repeats"] for r in res.values() if "repeats" in r), None)


if __name__ == "__main__":
    sys.exit(main())
