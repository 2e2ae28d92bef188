"""How much the CUDA single pass' dW accumulation across row groups costs in accuracy.

The single pass (flce::sum_and_grad on CUDA) computes dW = sum over groups of G rows of
dz_g^T E_g, each group's product a cuBLAS GEMM with fp32 accumulation that adds into the fp32
accumulator with beta = 1 (for 16-bit training: a Kahan pass over [V, D] per group would cost
more memory traffic than the group's bf16 GEMMs). This script measures that accumulation in
the same arithmetic on the CPU: each group's product an fp32 GEMM (MKL, beta = 1 into an fp32
accumulator), against the same products accumulated in float64, the float64 reference and the
ideal fp32 computation of tests/helpers.py (fp32 logits and probabilities, exact accumulation),
at N = 65536 and 1M tokens (16 and 256 groups of 4096 rows; fp32: also 1024-row groups with
Kahan compensation across them, which the single pass uses for fp32 because beta = 1 is not
enough there).

    python benchmarks/run.py accuracy            # prints a line per case as it finishes
    python tools/probes/accumulation.py          # the same
    python benchmarks/run.py accuracy --record benchmarks/results/cpu.jsonl   # and a record each

The gradient tile is fp32 (fp32 training) or bf16 with its target entries in fp32 (16-bit
training: target_rows adds them back; dW is rounded to bf16 at the end); cuBLAS's k order
inside one GEMM differs from MKL's, which a GPU run can confirm.
"""
import argparse
import math
import os
import sys

import torch

# benchmarks/: the record writer (and the checkout's flce where none is installed)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
import _records  # noqa: E402


def tile_grad(z, t, scale):
    """The mean's dloss/dz in fp32 with the collapse-safe target entry (as the row kernel)."""
    p = torch.softmax(z, dim=1)
    rows = torch.arange(z.shape[0])
    zt = z[rows, t]
    rest = z.clone()
    rest[rows, t] = -math.inf
    p[rows, t] = -torch.sigmoid(torch.logsumexp(rest, dim=1) - zt)
    return p * scale


def kahan_add(s, c, x):
    """math.h kahan_add, elementwise in fp32 (kahan_accumulate_kernel)."""
    t = s + x
    c += torch.where(s.abs() >= x.abs(), (s - t) + x, (x - t) + s)
    s.copy_(t)


def measure(n, v, d, group, dtype, seed=0, kahan=False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.25).to(dtype)
    w64, w32 = w.double(), w.float()
    acc32 = torch.zeros(v, d)                       # the single pass: fp32, beta = 1
    comp = torch.zeros(v, d)                        # or Kahan-compensated across the groups
    acc64 = torch.zeros(v, d, dtype=torch.float64)  # the same tiles, accumulated exactly
    gemms = torch.zeros(v, d, dtype=torch.float64)  # each group's fp32 GEMM, summed exactly
    ref = torch.zeros(v, d, dtype=torch.float64)    # float64 throughout
    ideal = torch.zeros(v, d, dtype=torch.float64)  # fp32 logits and probabilities, exact sums
    for g0 in range(0, n, group):
        rows = min(group, n - g0)
        x = (torch.randn(rows, d, generator=g, dtype=torch.float64) / d ** 0.25).to(dtype)
        t = torch.randint(0, v, (rows,), generator=g)
        x64, x32 = x.double(), x.float()
        ref += tile_grad(x64 @ w64.T, t, 1.0 / n).T @ x64
        dz32 = tile_grad(x32 @ w32.T, t, 1.0 / n)
        ideal += dz32.double().T @ x64
        tile = dz32
        if dtype != torch.float32:  # the 16-bit tile, its target entries kept in fp32
            tile = dz32.to(dtype).float()
            r = torch.arange(rows)
            tile[r, t] = dz32[r, t]
        prod = tile.T @ x32
        if kahan:
            kahan_add(acc32, comp, prod)
        else:
            acc32 += prod  # addmm with beta = 1: one fp32 rounding per group
        gemms += prod.double()
        acc64 += tile.double().T @ x64

    acc32 = acc32 + comp

    def err(a):
        return ((a.double() - ref).norm() / ref.norm()).item()

    out_dt = dtype
    return {"N": n, "V": v, "D": d, "group": group, "groups": math.ceil(n / group),
            "across": "kahan" if kahan else "beta=1",
            "dtype": str(dtype).replace("torch.", ""),
            "accumulated (fp32, beta=1)": err(acc32.to(out_dt)),
            "same tiles, exact sums": err(acc64.to(out_dt)),
            "ideal": err(ideal.to(out_dt)),
            "rounding floor": err(ref.to(out_dt)),
            "accumulation alone": ((acc32.double() - acc64).norm() / acc64.norm()).item(),
            "within the GEMMs": ((gemms - acc64).norm() / acc64.norm()).item(),
            "across the groups": ((acc32.double() - gemms).norm() / acc64.norm()).item()}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/run.py accuracy",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", help="append one record per case (op: dw_accumulation) to this "
                    "JSON-lines file as it finishes")
    ap.add_argument("-V", type=int, default=2048)
    ap.add_argument("-D", type=int, default=64)
    ap.add_argument("--group", type=int, default=4096)
    ap.add_argument("--tokens", default="65536,1048576")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    # (dtype, rows per group, across the groups): the 16-bit single pass (beta = 1), fp32 as
    # beta = 1 would give it, and fp32 as the single pass does it (1024-row groups, Kahan).
    variants = [(torch.bfloat16, args.group, False), (torch.float32, args.group, False),
                (torch.float32, 1024, True)]
    tokens = [int(s) for s in args.tokens.split(",")]
    progress = _records.Progress(len(variants) * len(tokens))
    for dtype, group, kahan in variants:
        for n in tokens:
            progress.start(f"dW accumulation, {str(dtype).replace('torch.', '')} N={n} "
                           f"groups of {group}{' (Kahan)' if kahan else ''}")
            r = measure(n, args.V, args.D, group, dtype, kahan=kahan)
            rows.append(r)
            progress.done(f"accumulated/ideal {r['accumulated (fp32, beta=1)'] / r['ideal']:.3f}")
            print(f"{r['dtype']:>9} N={n:>8} groups={r['groups']:>4} {r['across']:>6}: dW rel err "
                  f"accumulated {r['accumulated (fp32, beta=1)']:.3e} | exact sums of the same "
                  f"tiles {r['same tiles, exact sums']:.3e} | ideal {r['ideal']:.3e} | floor "
                  f"{r['rounding floor']:.3e} | accumulation alone "
                  f"{r['accumulation alone']:.3e} (within the GEMMs {r['within the GEMMs']:.3e}, "
                  f"across the groups {r['across the groups']:.3e}) | accumulated/ideal "
                  f"{r['accumulated (fp32, beta=1)'] / r['ideal']:.3f}", flush=True)
            if args.record:
                rec = _records.base("cpu", "dw_accumulation")
                rec.update(dtype=r["dtype"], n=r["N"], v=r["V"], d=r["D"], group=r["group"],
                           groups=r["groups"], across=r["across"],
                           rel_err={k: v for k, v in r.items() if k not in (
                               "N", "V", "D", "group", "groups", "across", "dtype")},
                           source="benchmarks/run.py accuracy: dW's relative error (norm) "
                                  "against float64")
                _records.append(args.record, rec)
    return rows


if __name__ == "__main__":
    main()
