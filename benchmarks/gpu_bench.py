"""Forward+backward benchmark of flce's two CUDA paths against cuBLAS speed-of-light and peers.

Run on one GPU (benchmarks/gpu_check.sh does): for each shape, bf16,
  flce            flce.linear_cross_entropy, loss.backward(): the single pass (3 GEMMs), the
                  training default on CUDA
  flce_recompute  the same with single_pass=False: forward + recomputing backward (4 GEMMs)
  eager           logits = x @ w.T; F.cross_entropy(logits.float(), t)
  compile         the same under torch.compile (--compile)
  torch_lce       torch.nn.functional.linear_cross_entropy (torch >= 2.13 only)
  quack           quack.linear_cross_entropy.chunked_linear_cross_entropy, where installed
  liger           Liger-Kernel's LigerFusedLinearCrossEntropyLoss, where installed
  cce             Apple's Cut Cross Entropy (cut_cross_entropy.linear_cross_entropy), where installed
  sol_4gemm       4 plain bf16 cuBLAS GEMMs of the shape (logits, recompute, dE, dW)
  sol_3gemm       3 plain bf16 GEMMs (no recompute): the single pass' speed of light
and the ceilings: a device-to-device copy and an 8192^3 bf16 matmul.
Prints time, TFLOP/s (6 N V D per fwd+bwd), peak memory beyond the inputs and the gradients
(the step's own memory: the baseline is taken after a warm-up step, whose gradients each timed
step frees and replaces), and ratios to flce; writes results.json and table.txt under --out.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import flce  # noqa: E402

SHAPES = [(4096, 128256, 4096), (16384, 128256, 4096), (4096, 256000, 4096),
          (16384, 256000, 4096)]


def timed(fn, warmup=2, iters=5):
    """Median milliseconds of fn() over iters runs (CUDA events), and peak extra bytes."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() - base


def make_inputs(n, v, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x.requires_grad_(), w.requires_grad_(), t


def fwd_bwd(loss_fn, x, w, t):
    def run():
        x.grad = None
        w.grad = None
        loss = loss_fn(x, w, t)
        loss.backward()
    return run


def eager_loss(x, w, t):
    return F.cross_entropy((x @ w.T).float(), t)


def peers(log):
    """(name, loss_fn) of the installed peers."""
    out = []
    if hasattr(F, "linear_cross_entropy"):
        out.append(("torch_lce", lambda x, w, t: F.linear_cross_entropy(
            x, w, t, options=torch.nn.LinearCrossEntropyOptions())))
    else:
        log(f"  torch_lce: skipped (torch {torch.__version__} has no F.linear_cross_entropy)")
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        out.append(("quack", lambda x, w, t: chunked_linear_cross_entropy(x, w, t)))
    except Exception as e:  # noqa: BLE001
        log(f"  quack: skipped ({type(e).__name__}: {e})"[:200])
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out.append(("liger", lambda x, w, t: liger(w, x, t)))
    except Exception as e:  # noqa: BLE001
        log(f"  liger: skipped ({type(e).__name__}: {e})"[:200])
    try:
        from cut_cross_entropy import linear_cross_entropy as cce_lce

        out.append(("cce", lambda x, w, t: cce_lce(x, w, t)))
    except Exception as e:  # noqa: BLE001
        log(f"  cce: skipped ({type(e).__name__}: {e})"[:200])
    return out


METHODS = ("flce", "flce_fused", "flce_recompute", "eager", "compile", "torch_lce", "quack", "liger", "cce",
           "sol_4gemm", "sol_3gemm")


def fused_loss(x, w, t):
    """The fused logits path (FLCE_CUDA_FUSED_LOGITS=1, opt-in): the single pass does all its
    work in the forward call, so the flag is needed there only."""
    old = os.environ.get("FLCE_CUDA_FUSED_LOGITS")
    os.environ["FLCE_CUDA_FUSED_LOGITS"] = "1"
    try:
        return flce.linear_cross_entropy(x, w, t)
    finally:
        if old is None:
            del os.environ["FLCE_CUDA_FUSED_LOGITS"]
        else:
            os.environ["FLCE_CUDA_FUSED_LOGITS"] = old


def bench_shape(n, v, d, results, log, compile_eager):
    flops = 6.0 * n * v * d
    x, w, t = make_inputs(n, v, d)
    grads_gib = (x.numel() * x.element_size() + w.numel() * w.element_size()) / 2**30
    methods = [("flce", lambda x, w, t: flce.linear_cross_entropy(x, w, t)),
               ("flce_recompute",
                lambda x, w, t: flce.linear_cross_entropy(x, w, t, single_pass=False)),
               ("eager", eager_loss)]
    # The fused logits path (opt-in) where asked: gpu_check.sh sets FLCE_BENCH_FUSED=1 once its
    # correctness check passed on this GPU.
    if os.environ.get("FLCE_BENCH_FUSED") == "1":
        methods.insert(1, ("flce_fused", fused_loss))
    if compile_eager:
        methods.append(("compile", torch.compile(eager_loss, dynamic=False)))
    methods += peers(log)
    row = {"shape": [n, v, d], "grads_gib": grads_gib}
    for name, fn in methods:
        try:
            t0 = time.time()
            ms, mem = timed(fwd_bwd(fn, x, w, t))
            row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "peak_gib": mem / 2**30}
            log(f"  {name:<14} {ms:9.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  "
                f"+{mem / 2**30:6.2f} GiB beyond inputs and gradients  "
                f"(wall {time.time() - t0:.0f}s incl. warmup)")
        except Exception as e:  # noqa: BLE001  (an OOM or a missing feature must not stop the run)
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"  {name:<10} FAILED {row[name]['error']}")
        torch.cuda.empty_cache()
    # Speed of light: the GEMMs any fused implementation has to run.
    with torch.no_grad():
        xd, wd = x.detach(), w.detach()
        g = torch.empty(n, v, device="cuda", dtype=torch.bfloat16).normal_()
        gemm_nv = lambda: torch.mm(xd, wd.T)  # noqa: E731  [N, V]
        gemm_nd = lambda: torch.mm(g, wd)  # noqa: E731     [N, D]
        gemm_vd = lambda: torch.mm(g.T, xd)  # noqa: E731   [V, D]
        ms_nv, _ = timed(gemm_nv)
        ms_nd, _ = timed(gemm_nd)
        ms_vd, _ = timed(gemm_vd)
        del g
    for name, ms in (("sol_4gemm", 2 * ms_nv + ms_nd + ms_vd), ("sol_3gemm", ms_nv + ms_nd + ms_vd)):
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "peak_gib": float("nan")}
        log(f"  {name:<10} {ms:9.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  (sum of GEMM medians)")
    results.append(row)
    del x, w, t
    torch.cuda.empty_cache()


def ceilings(log):
    out = {}
    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    ms, _ = timed(lambda: dst.copy_(buf))
    out["d2d_copy_GBps"] = 2 * buf.numel() / ms / 1e6  # read + write
    del buf, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = timed(lambda: torch.mm(a, b))
    out["mm8192_bf16_TFLOPs"] = 2 * 8192**3 / ms / 1e9
    log(f"ceilings: device copy {out['d2d_copy_GBps']:.0f} GB/s, "
        f"8192^3 bf16 matmul {out['mm8192_bf16_TFLOPs']:.0f} TFLOP/s")
    return out


# gpu.jsonl's names (docs: ../shared/GPU.md) for this script's methods.
RECORD_NAMES = {"flce": "flce", "flce_fused": "flce_fused", "flce_recompute": "flce_recompute", "sol_3gemm": "gemm3",
                "sol_4gemm": "gemm4", "eager": "eager", "compile": "compiled",
                "torch_lce": "torch_native", "quack": "quack", "liger": "liger", "cce": "cce"}


def records(results, ceil):
    """One record per shape in benchmarks/results/gpu.jsonl's format."""
    import datetime
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    for row in results:
        n, v, d = row["shape"]
        ok = {RECORD_NAMES[k]: r for k, r in row.items() if k in RECORD_NAMES and "ms" in r}
        yield {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "commit": commit, "op": "linear_cross_entropy",
               "n": n, "v": v, "d": d, "dtype": "bfloat16",
               "ms": {k: round(r["ms"], 3) for k, r in ok.items()},
               "peak_gib": {k: round(r["peak_gib"], 3) for k, r in ok.items()
                            if r["peak_gib"] == r["peak_gib"]},
               "copy_gb_s": round(ceil["d2d_copy_GBps"]),
               "mm_tflops": round(ceil["mm8192_bf16_TFLOPs"])}


def table(results, ceil):
    lines = [f"ceilings: copy {ceil['d2d_copy_GBps']:.0f} GB/s, mm8192 bf16 "
             f"{ceil['mm8192_bf16_TFLOPs']:.0f} TFLOP/s",
             f"{'shape (N,V,D)':<22}{'method':<15}{'ms':>9}{'TFLOP/s':>9}{'+mem GiB':>10}"
             f"{'x flce':>8}"]
    for row in results:
        base = row.get("flce", {}).get("ms")
        shape = "x".join(map(str, row["shape"]))
        for name in METHODS:
            r = row.get(name)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"{shape:<22}{name:<15}{'failed':>9}")
                continue
            ratio = f"{r['ms'] / base:8.2f}" if base else f"{'-':>8}"
            lines.append(f"{shape:<22}{name:<15}{r['ms']:9.2f}{r['tflops']:9.1f}"
                         f"{r['peak_gib']:10.2f}{ratio}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of eager")
    ap.add_argument("--record", default=None,
                    help="append one benchmarks/results/gpu.jsonl record per shape to this file")
    ap.add_argument("--shapes", default=None,
                    help="N,V,D;N,V,D... (default: N in 4096, 16384; V in 128256, 256000; D 4096)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(a) for a in s.split(","))
                                             for s in args.shapes.split(";")]
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "bench_detail.log"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    log(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cuda {torch.version.cuda}")
    ceil = ceilings(log)
    results = []
    for n, v, d in shapes:
        log(f"shape N={n} V={v} D={d} bf16")
        bench_shape(n, v, d, results, log, args.compile)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"ceilings": ceil, "results": results}, f, indent=1)
    if args.record:
        with open(args.record, "a") as f:
            for rec in records(results, ceil):
                f.write(json.dumps(rec) + "\n")
    text = table(results, ceil)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
