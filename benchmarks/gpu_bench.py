"""Forward+backward benchmark of flce's CUDA paths against the 3 cuBLAS GEMMs and peers, one
record per shape appended the moment that shape is measured.

    python benchmarks/gpu_bench.py --shapes 4096,128256,4096 --record OUT.jsonl \\
        --partial OUT.partial [--methods gemm3,flce,...] [--repeats 10] [--table table.txt]

Methods, measured in the order given (--methods; unknown names are refused):
  gemm3           the step's 3 bf16 cuBLAS GEMMs alone (logits, dE, dW; torch.mm): the floor;
                  gemm4 (a recomputing backward's 4) is derived from the same GEMMs' times
  flce            flce.linear_cross_entropy, loss.backward(): the default CUDA path
  flce_recompute  the same with single_pass=False (forward + recomputing backward)
  eager           logits = x @ w.T; F.cross_entropy(logits.float(), t)
  liger, cce      Liger-Kernel's fused linear cross-entropy, Apple's Cut Cross Entropy, where
                  importable
  torch_native    torch's F.linear_cross_entropy (torch >= 2.13), quack: where importable
  compiled        torch.compile of eager (slow to compile: put it last)
  fwd_flce        the forward alone, no gradients (RL rollout scoring: reduction="none",
                  temperature 0.7, under torch.no_grad()): one logits GEMM per row chunk plus the
                  row kernels; its floor is gemm3's first part, the one logits GEMM ("gemm1_ms")
  fwd_eager       the same with eager torch: the logits, then log_softmax's gather in fp32

Each timing: --warmup steps, then --repeats steps timed with CUDA events; the record keeps the
median ("ms"), the fastest and slowest ("ms_range"), and the peak memory beyond the inputs and
the gradients ("peak_gib": the baseline is taken after the warm-up, whose gradients each timed
step replaces). Ceilings measured in the same process: a device-to-device copy (read + write)
and an 8192^3 bf16 matmul.

Agreement ("agree"), for every flce path measured: its loss, dE and dW against eager's on the
same inputs (relative norm of the difference), and against float64 (flce.reference, the
collapse-safe formula) on a slice of --slice-rows rows with the whole vocabulary, beside the
floor (the float64 gradients rounded to bf16) and eager's own errors on the slice.

After each method the shape's record so far is written to --partial (``"complete": false``);
when the shape is done the record is appended to --record (``"complete": true``) and the partial
file removed. gpu_check.sh appends a partial file left behind by a step it had to cut.
FLCE_GPU_DRY_RUN=1 replaces every measurement with a stand-in (no torch; the control flow for
tests/tools/test_gpu_check.py); FLCE_GPU_DRY_HANG=NxVxD:method then hangs at that measurement.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_record  # noqa: E402

SHAPES = [(4096, 128256, 4096), (16384, 128256, 4096), (4096, 256000, 4096),
          (16384, 256000, 4096)]
METHODS = ("gemm3", "flce", "flce_recompute", "fwd_flce", "fwd_eager", "eager",
           "liger", "cce", "torch_native", "quack", "compiled")
DEFAULT_METHODS = "gemm3,flce,flce_recompute,fwd_flce,fwd_eager,eager,liger,cce,compiled"
FORWARD_ONLY = ("fwd_flce", "fwd_eager")
FLCE_PATHS = ("flce", "flce_recompute")


# ---- the implementations ------------------------------------------------------------------

def _flce():
    try:
        import flce
    except ImportError:  # the checkout's in-place build (gpu_check.sh sets PYTHONPATH too)
        sys.path.insert(0, os.path.join(HERE, "..", "python"))
        import flce
    return flce


def eager_loss(x, w, t):
    import torch.nn.functional as F

    return F.cross_entropy((x @ w.T).float(), t)


def forward_fn(name):
    """The forward-only method ``name``: per-token log-probabilities at temperature 0.7 under
    no_grad (what an RL trainer's rollout scoring asks)."""
    import torch

    if name == "fwd_flce":
        def run(x, w, t):
            with torch.no_grad():
                return _flce().linear_cross_entropy(x, w, t, reduction="none", temperature=0.7)
        return run

    def eager(x, w, t):
        with torch.no_grad():
            logp = torch.log_softmax((x @ w.T).float() / 0.7, dim=-1)
            return -logp.gather(1, t[:, None])[:, 0]
    return eager


def loss_fn(name):
    """The loss function of method ``name``, or a string saying why it cannot run here."""
    import torch
    import torch.nn.functional as F

    if name == "flce":
        return lambda x, w, t: _flce().linear_cross_entropy(x, w, t)
    if name == "flce_recompute":
        return lambda x, w, t: _flce().linear_cross_entropy(x, w, t, single_pass=False)
    if name == "eager":
        return eager_loss
    if name == "compiled":
        return torch.compile(eager_loss, dynamic=False)
    try:
        if name == "torch_native":
            if not hasattr(F, "linear_cross_entropy"):
                return f"torch {torch.__version__} has no F.linear_cross_entropy"
            opts = torch.nn.LinearCrossEntropyOptions()
            return lambda x, w, t: F.linear_cross_entropy(x, w, t, options=opts)
        if name == "quack":
            from quack.linear_cross_entropy import chunked_linear_cross_entropy

            return lambda x, w, t: chunked_linear_cross_entropy(x, w, t)
        if name == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss()
            return lambda x, w, t: liger(w, x, t)
        if name == "cce":
            from cut_cross_entropy import linear_cross_entropy as cce

            return lambda x, w, t: cce(x, w, t)
    except Exception as e:  # noqa: BLE001  (a peer that does not import is skipped, and said so)
        return f"not importable: {type(e).__name__}: {e}"[:200]
    raise ValueError(name)


# ---- measurement ----------------------------------------------------------------------------

def timed(fn, warmup, repeats):
    """(median, fastest, slowest) milliseconds of fn() (CUDA events) and peak extra bytes."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return (times[len(times) // 2], times[0], times[-1],
            torch.cuda.max_memory_allocated() - base)


def make_inputs(n, v, d, seed=0):
    """bf16 inputs drawn on the GPU (logits ~ N(0, 1))."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x.requires_grad_(), w.requires_grad_(), t


def step_fn(fn, x, w, t):
    def run():
        x.grad = None
        w.grad = None
        fn(x, w, t).backward()
    return run


def grads(fn, x, w, t):
    """One step: loss (float), dE, dW."""
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(xg, wg, t)
    loss.backward()
    return float(loss.detach()), xg.grad, wg.grad


def rel(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Agreement:
    """flce's outputs against eager's on the shape, and against float64 on a row slice."""

    def __init__(self, x, w, t, rows):
        _flce()
        import flce.reference
        self.x, self.w, self.t = x, w, t
        self.eager = grads(eager_loss, x, w, t)
        self.xs, self.ts = x.detach()[:rows], t[:rows]
        xd, wd = self.xs.double().requires_grad_(), w.detach().double().requires_grad_()
        loss = flce.reference.linear_cross_entropy(xd, wd, self.ts)  # mean over the slice
        loss.backward()
        self.ref = (float(loss.detach()), xd.grad, wd.grad)
        self.rows = int(self.xs.shape[0])
        # the floor: the float64 gradients rounded to the gradients' dtype
        self.floor = {"dE": rel(xd.grad.to(x.dtype), xd.grad),
                      "dW": rel(wd.grad.to(w.dtype), wd.grad)}
        self.eager_slice = self.vs_ref(eager_loss)

    def vs_ref(self, fn):
        loss, de, dw = grads(fn, self.xs, self.w, self.ts)
        rl, rde, rdw = self.ref
        out = {"loss": abs(loss - rl) / abs(rl), "dE": rel(de, rde), "dW": rel(dw, rdw)}
        return {k: gpu_record.sig(v, 3) for k, v in out.items()}

    def of(self, fn):
        loss, de, dw = grads(fn, self.x, self.w, self.t)
        el, ede, edw = self.eager
        vs_eager = {"loss": abs(loss - el) / abs(el), "dE": rel(de, ede), "dW": rel(dw, edw)}
        return {"vs_eager": {k: gpu_record.sig(v, 3) for k, v in vs_eager.items()},
                "vs_fp64_slice": self.vs_ref(fn)}

    def header(self):
        return {"slice_rows": self.rows,
                "fp64_slice_floor": {k: gpu_record.sig(v, 3) for k, v in self.floor.items()},
                "eager_vs_fp64_slice": self.eager_slice}


def gemm3(x, w, warmup, repeats):
    """The 3 GEMMs' medians (ms): logits [N, V], dE [N, D], dW [V, D]; and their spreads."""
    import torch

    with torch.no_grad():
        xd, wd = x.detach(), w.detach()
        g = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype).normal_()
        parts = [timed(lambda: torch.mm(xd, wd.T), warmup, repeats),
                 timed(lambda: torch.mm(g, wd), warmup, repeats),
                 timed(lambda: torch.mm(g.T, xd), warmup, repeats)]
    return parts


def ceilings(warmup, repeats):
    import torch

    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    ms = timed(lambda: dst.copy_(buf), warmup, repeats)[0]
    copy = 2 * buf.numel() / ms / 1e6  # GB/s, read + write
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: torch.mm(a, b), warmup, repeats)[0]
    return {"copy_gb_s": round(copy), "mm_tflops": round(2 * 8192 ** 3 / ms / 1e9)}


class Shape:
    """One shape's measurements, against torch and a GPU."""

    def __init__(self, n, v, d, args):
        import torch

        self.args = args
        self.x, self.w, self.t = make_inputs(n, v, d)
        self.agreement = None
        self.torch = torch

    def measure(self, name):
        """(result dict, agreement dict or None) or a string: why it was skipped."""
        a = self.args
        if name == "gemm3":
            parts = gemm3(self.x, self.w, a.warmup, a.repeats)
            ms = sum(p[0] for p in parts)
            return {"ms": ms, "range": [sum(p[1] for p in parts), sum(p[2] for p in parts)],
                    "gemm4_ms": ms + parts[0][0], "gemm1_ms": parts[0][0],
                    "parts_ms": [p[0] for p in parts]}, None
        if name in FORWARD_ONLY:
            fn = forward_fn(name)
            x, w, t = self.x.detach(), self.w.detach(), self.t
            ms, lo, hi, peak = timed(lambda: fn(x, w, t), a.warmup, a.repeats)
            return {"ms": ms, "range": [lo, hi], "peak_gib": peak / 2 ** 30}, None
        fn = loss_fn(name)
        if isinstance(fn, str):
            return fn
        ms, lo, hi, peak = timed(step_fn(fn, self.x, self.w, self.t), a.warmup, a.repeats)
        out = {"ms": ms, "range": [lo, hi], "peak_gib": peak / 2 ** 30}
        agree = None
        if name in FLCE_PATHS:
            if self.agreement is None:
                self.agreement = Agreement(self.x, self.w, self.t, a.slice_rows)
            agree = self.agreement.of(fn)
        self.torch.cuda.empty_cache()
        return out, agree

    def header(self):
        return self.agreement.header() if self.agreement else {}

    def close(self):
        del self.x, self.w, self.t, self.agreement
        self.torch.cuda.empty_cache()


class DryShape:
    """Stand-in measurements (FLCE_GPU_DRY_RUN=1): no torch, no GPU."""

    def __init__(self, n, v, d, args):
        self.key = f"{n}x{v}x{d}"
        self.flops = 6.0 * n * v * d

    def measure(self, name):
        if os.environ.get("FLCE_GPU_DRY_HANG") == f"{self.key}:{name}":
            print(f"dry run: hanging at {self.key}:{name}", flush=True)
            time.sleep(3600)
        if name in os.environ.get("FLCE_GPU_DRY_SKIP", "").split(","):  # a peer not importable
            return "not importable (dry run)"
        ms = self.flops / 7e11 * (1.0 + 0.1 * METHODS.index(name))
        out = {"ms": ms, "range": [ms * 0.99, ms * 1.02], "peak_gib": 1.0}
        if name == "gemm3":
            out.update(gemm4_ms=ms * 4 / 3, gemm1_ms=ms / 3, parts_ms=[ms / 3] * 3)
        agree = ({"vs_eager": {"loss": 1e-6, "dE": 1e-3, "dW": 1e-3},
                  "vs_fp64_slice": {"loss": 1e-6, "dE": 3e-3, "dW": 3e-3}}
                 if name in FLCE_PATHS else None)
        return out, agree

    def header(self):
        return {}

    def close(self):
        pass


# ---- records and the table -------------------------------------------------------------------

def new_record(env, ceil, n, v, d, args):
    rec = dict(env)
    rec.update(op="linear_cross_entropy", n=n, v=v, d=d, dtype="bfloat16", complete=False,
               warmup=args.warmup, repeats=args.repeats, ms={}, ms_range={}, peak_gib={},
               agree={}, skipped={}, errors={}, **ceil)
    return rec


def add(rec, name, result):
    """Put one method's result (or why it did not run) into the shape's record."""
    if isinstance(result, str):
        rec["skipped"][name] = result
        return
    out, agree = result
    if "error" in out:
        rec["errors"][name] = out["error"]
        return
    rec["ms"][name] = gpu_record.sig(out["ms"])
    rec["ms_range"][name] = [gpu_record.sig(m) for m in out["range"]]
    if "peak_gib" in out:
        rec["peak_gib"][name] = gpu_record.sig(out["peak_gib"], 4)
    if name == "gemm3":
        rec["ms"]["gemm4"] = gpu_record.sig(out["gemm4_ms"])
        rec["ms"]["gemm1"] = gpu_record.sig(out["gemm1_ms"])  # the forward's floor
        rec["gemm3_parts_ms"] = [gpu_record.sig(m) for m in out["parts_ms"]]
    if agree:
        rec["agree"][name] = agree


def table(rec):
    """The shape's lines of the summary table: ms, TFLOP/s, memory, x the 3 GEMMs, agreement."""
    n, v, d = rec["n"], rec["v"], rec["d"]
    flops = 6.0 * n * v * d
    floor = rec["ms"].get("gemm3")
    lines = [f"{n}x{v}x{d} bf16 (copy {rec.get('copy_gb_s')} GB/s, mm {rec.get('mm_tflops')} "
             f"TFLOP/s, {rec['repeats']} repeats{'' if rec['complete'] else ', INCOMPLETE'})",
             f"  {'method':<15}{'ms':>9}{'min-max':>16}{'TFLOP/s':>9}{'+GiB':>7}{'x floor':>8}"
             f"  agreement (vs eager; vs fp64 slice: dE dW)"]
    for name, ms in rec["ms"].items():
        lo, hi = rec["ms_range"].get(name, [None, None])
        spread = f"{lo:.2f}-{hi:.2f}" if lo is not None else "-"
        peak = rec["peak_gib"].get(name)
        # forward-only methods against their floor, the one logits GEMM
        base = rec["ms"].get("gemm1") if name in FORWARD_ONLY else floor
        ratio = f"{ms / base:8.2f}" if base else f"{'-':>8}"
        agree = rec["agree"].get(name)
        note = ""
        if agree:
            e, r = agree["vs_eager"], agree["vs_fp64_slice"]
            note = (f"  loss {e['loss']:.1e} dE {e['dE']:.1e} dW {e['dW']:.1e}; "
                    f"{r['dE']:.1e} {r['dW']:.1e}")
        lines.append(f"  {name:<15}{ms:9.2f}{spread:>16}{flops / ms / 1e9:9.1f}"
                     f"{'' if peak is None else f'{peak:7.2f}':>7}{ratio}{note}")
    for name, why in rec["skipped"].items():
        lines.append(f"  {name:<15} skipped: {why}")
    for name, why in rec["errors"].items():
        lines.append(f"  {name:<15} FAILED: {why}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None,
                    help="N,V,D;N,V,D... (default: N in 4096, 16384; V in 128256, 256000; D 4096)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help=f"comma-separated, in order (default {DEFAULT_METHODS})")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--slice-rows", type=int, default=128,
                    help="rows of the float64 agreement check (the whole vocabulary)")
    ap.add_argument("--record", required=True, help="append one record per shape to this file")
    ap.add_argument("--partial", default=None,
                    help="the shape in progress (default: RECORD.partial)")
    ap.add_argument("--table", default=None, help="append each shape's table to this file")
    args = ap.parse_args(argv)
    shapes = SHAPES if not args.shapes else [tuple(int(a) for a in s.split(","))
                                             for s in args.shapes.split(";")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    partial = args.partial or args.record + ".partial"
    dry = gpu_record.dry_run()
    env = gpu_record.environment()
    if dry:
        ceil, shape_cls = {"copy_gb_s": None, "mm_tflops": None}, DryShape
    else:
        ceil, shape_cls = ceilings(args.warmup, args.repeats), Shape
    print(f"device {env['device']}  torch {env['torch']}  cuda {env['cuda']}  commit "
          f"{env['commit']}  build {env.get('build')}", flush=True)
    print(f"ceilings: copy {ceil['copy_gb_s']} GB/s, 8192^3 bf16 mm {ceil['mm_tflops']} TFLOP/s",
          flush=True)
    for n, v, d in shapes:
        rec = new_record(env, ceil, n, v, d, args)
        gpu_record.write_partial(partial, rec)
        shape = shape_cls(n, v, d, args)
        for name in methods:
            t0 = time.time()
            try:
                result = shape.measure(name)
            except Exception as e:  # noqa: BLE001  (an OOM or a missing feature: next method)
                result = ({"error": f"{type(e).__name__}: {e}"[:300]}, None)
            add(rec, name, result)
            rec.update(shape.header())
            gpu_record.write_partial(partial, rec)
            got = rec["ms"].get(name)
            print(f"  {n}x{v}x{d} {name:<15} "
                  + (f"{got:9.2f} ms" if got is not None else
                     rec["skipped"].get(name) or rec["errors"].get(name, "?"))
                  + f"  (wall {time.time() - t0:.0f} s)", flush=True)
        rec["complete"] = True
        gpu_record.finish(args.record, partial, rec)
        shape.close()
        text = table(rec)
        print(text, flush=True)
        if args.table:
            with open(args.table, "a") as fh:
                fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
