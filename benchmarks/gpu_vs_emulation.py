"""The CUDA backend on a GPU against the same backend on the host emulation, same inputs.

Both run the same binding and the same kernels (tests/cuda_emulation.py builds the emulated
one: the kernels as host C++ on the host SIMT runtime, at::mm for cuBLAS), so their results may
differ only by rounding: the order of the GPU's fp32 accumulations inside mma.sync and cuBLAS,
and libdevice's expf/logf against glibc's. Every difference beyond that is a bug in a kernel or
in the emulation. For each case, op and output this prints max |gpu - host| / max |host| and
fails when it passes the case's bound (a multiple of the dtype's rounding).

    python benchmarks/gpu_vs_emulation.py              # on a GPU machine (gpu_check.sh runs it)
    python benchmarks/gpu_vs_emulation.py --device cpu # dry run: the CPU backend against it
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import cuda_emulation  # noqa: E402
import flce  # noqa: E402

CASES = [  # (N, V, D, dtype, options)
    (37, 301, 72, torch.float32, {}),
    (130, 1000, 136, torch.bfloat16, dict(label_smoothing=0.1, z_loss=1e-3)),
    (257, 517, 24, torch.float16, dict(softcap=15.0)),
    (300, 2049, 64, torch.bfloat16, {}),
]
BOUND = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def inputs(n, v, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    return x, w, t, b


def run(ops, device, x, w, t, b, opts):
    x, w, t, b = (a.to(device) for a in (x, w, t, b))
    ls, zl, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap", 0.0)
    loss, lse, stats, ent = ops.forward(x, w, t, b, -100, ls, zl, cap)
    g = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(3)).to(device)
    gx, gw, gb = ops.backward(g, None, x, w, t, b, stats, 0, w.shape[0], -100, ls, zl, cap,
                              [True, True, True])
    out = {"loss": loss, "lse": lse, "entropy": ent, "stats": stats, "bwd dE": gx, "bwd dW": gw,
           "bwd db": gb}
    if x.dtype != torch.float16:
        s = ops.sum_and_grad(x, w, t, b, -100, ls, zl, cap, [True, True, True], True)
        # The gradients are deferred as [k, *shape] over a divisor (what the backward scales
        # by): CUDA k = 1, the value over 1 (the mean's 1 / count applied on the device); CPU
        # k = 2, an fp32 sum and its compensation, over the count. Compare what they stand for.
        out.update({"single loss": s[0]}, **{
            f"single {k}": p.double().sum(0) / s[1].double() for k, p in
            (("dE", s[2]), ("dW", s[3]), ("db", s[4]))})
    return {k: v.detach().cpu().double() for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    host = cuda_emulation.load()
    dev_ops = torch.ops.flce
    failed = 0
    for i, (n, v, d, dtype, opts) in enumerate(CASES):
        x, w, t, b = inputs(n, v, d, dtype, seed=i)
        a = run(dev_ops, args.device, x, w, t, b, opts)
        h = run(host, "cpu", x, w, t, b, opts)
        for k in h:
            ref = h[k]
            fin = torch.isfinite(ref)
            same_nonfinite = torch.equal(fin, torch.isfinite(a[k]))
            diff = ((a[k] - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()
            ok = same_nonfinite and diff <= BOUND[dtype]
            failed += not ok
            print(f"{n}x{v}x{d} {str(dtype)[6:]:<9} {k:<12} {diff:9.2e}  {'ok' if ok else 'FAIL'}")
    print(f"{failed} output(s) beyond rounding")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
