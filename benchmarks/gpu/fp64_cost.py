"""The cost of fp32 training's gradient GEMMs in float64 (FLCE_CUDA_OPT_IN=fp64_grad) on a GPU,
against the SGEMM path and against the GEMMs alone; one record per shape, appended as measured.

    python benchmarks/gpu/fp64_cost.py --record OUT.jsonl [--shapes 16384,32768,1024;...]

Per shape (fp32 inputs, TF32 off), medians of --repeats steps after --warmup (CUDA events):
  flce_fp32     flce.linear_cross_entropy forward + backward, FLCE_CUDA_OPT_IN unset (SGEMMs)
  flce_fp64     the same with FLCE_CUDA_OPT_IN=fp64_grad (dE and dW GEMMs in DGEMM)
  sgemm3        the step's 3 GEMMs in fp32 alone (logits, dE, dW)
  sgemm_dgemm2  the logits SGEMM and the dE, dW GEMMs in fp64 alone (operands already fp64)
Record: {"op": "fp32_grad_cost", "n", "v", "d", "dtype": "float32", "ms": {...},
"ms_range": {...}, "fp64_over_fp32": flce_fp64 / flce_fp32, plus _records.environment()}.
Hopper's FP64 tensor cores run DGEMM at about SGEMM's rate: fp64_over_fp32 is the figure that
decides whether fp64 becomes fp32 training's default on sm_90 (within 1.2x).
"""
import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: the record writer
import _records  # noqa: E402

SHAPES = "16384,32768,1024;4096,128256,4096"


def measure(n, v, d, warmup, repeats):
    import torch

    import flce
    from flce.check import measure

    timed = functools.partial(measure, "cuda")

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, d, device="cuda", generator=g) / d ** 0.25).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.25).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    out = {}

    def step():
        x.grad = w.grad = None
        flce.linear_cross_entropy(x, w, t).backward()

    old = os.environ.get("FLCE_CUDA_OPT_IN")
    try:
        for mode, opt_in in (("fp32", ""), ("fp64", "fp64_grad")):
            os.environ["FLCE_CUDA_OPT_IN"] = opt_in
            out[f"flce_{mode}"] = timed(step, warmup, repeats)
    finally:
        if old is None:
            os.environ.pop("FLCE_CUDA_OPT_IN", None)
        else:
            os.environ["FLCE_CUDA_OPT_IN"] = old
    x.grad = w.grad = None
    with torch.no_grad():
        xd, wd = x.detach(), w.detach()
        z = torch.empty(n, v, device="cuda").normal_()
        logits = timed(lambda: torch.mm(xd, wd.T), warmup, repeats)
        s = [logits, timed(lambda: torch.mm(z, wd), warmup, repeats),
             timed(lambda: torch.mm(z.T, xd), warmup, repeats)]
        out["sgemm3"] = tuple(sum(p[i] for p in s) for i in range(3)) + (0,)
        z64, x64, w64 = z.double(), xd.double(), wd.double()
        dd = [logits, timed(lambda: torch.mm(z64, w64), warmup, repeats),
              timed(lambda: torch.mm(z64.T, x64), warmup, repeats)]
        out["sgemm_dgemm2"] = tuple(sum(p[i] for p in dd) for i in range(3)) + (0,)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help=f"N,V,D;... (default {SHAPES})")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", required=True)
    args = ap.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    env = _records.environment()
    for shape in args.shapes.split(";"):
        n, v, d = (int(a) for a in shape.split(","))
        res = measure(n, v, d, args.warmup, args.repeats)
        rec = dict(env)
        rec.update(op="fp32_grad_cost", n=n, v=v, d=d, dtype="float32", warmup=args.warmup,
                   repeats=args.repeats,
                   ms={k: _records.sig(r[0]) for k, r in res.items()},
                   ms_range={k: [_records.sig(r[1]), _records.sig(r[2])]
                             for k, r in res.items()},
                   fp64_over_fp32=_records.sig(res["flce_fp64"][0] / res["flce_fp32"][0], 4))
        _records.append(args.record, rec)
        ms = rec["ms"]
        print(f"fp32 N={n} V={v} D={d}: flce SGEMM grads {ms['flce_fp32']:.2f} ms, fp64 grads "
              f"{ms['flce_fp64']:.2f} ms ({rec['fp64_over_fp32']:.2f}x); GEMMs alone: 3 SGEMM "
              f"{ms['sgemm3']:.2f} ms, SGEMM + 2 DGEMM {ms['sgemm_dgemm2']:.2f} ms", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
