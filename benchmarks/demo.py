"""flce in two minutes: what the usual cross-entropy loses at large margins, how accurate the
gradients are at long sequences, and what it costs, against PyTorch's own implementations.

    python benchmarks/demo.py            # the default device: cuda if available, else cpu
    python benchmarks/demo.py --quick    # tiny shapes (seconds), as the smoke test runs it
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers  # noqa: E402

import flce  # noqa: E402  (importable once _peers has put the source tree on the path)

MARGINS = (0, 10, 20, 30, 50, 100)
COLLAPSE_IMPLS = ("flce", "eager", "chunked")
LABELS = {"ref": "float64 ref", "flce": "flce", "eager": "F.cross_entropy",
          "chunked": "F.linear_cross_entropy"}
FP32_TINY = torch.finfo(torch.float32).tiny


def collapse_table(device, v, d):
    """Loss and target-logit gradient of one token at each margin, per implementation.

    The target gradient is read from the bias gradient: for one token, dL/db_t = dL/dz_t.
    Returns {margin: {impl: (loss, grad_t)}} with impl "ref" the float64 collapse-safe oracle.
    """
    impls = [n for n in COLLAPSE_IMPLS if _peers.available(n) is None]
    fns = {n: _peers.make_impl(n, device) for n in impls}
    table = {}
    for m in MARGINS:
        x, w, t, _ = _peers.margin_batch(1, v, d, float(m), torch.float32, seed=m)
        bias = torch.randn(v, generator=torch.Generator().manual_seed(m)) * 1e-3
        row = {}
        b64 = bias.double().requires_grad_(True)
        loss = flce.reference.linear_cross_entropy(x.double(), w.double(), t, bias=b64)
        loss.backward()
        row["ref"] = (float(loss.detach()), float(b64.grad[t[0]]))
        for n in impls:
            b = bias.to(device, copy=True).requires_grad_(True)
            loss = fns[n](x.to(device), w.to(device), t.to(device), bias=b)
            loss.backward()
            row[n] = (float(loss.detach()), float(b.grad[t[0]]))
        table[m] = row
    return table


def format_collapse(table, v, d):
    impls = [n for n in ("ref",) + COLLAPSE_IMPLS if n in table[MARGINS[0]]]
    width = max(len(LABELS[n]) for n in impls) + 1
    lines = [f"(i) Collapse: one token, V={v}, D={d}, fp32 inputs; margin m = z_t - max_(j!=t) z_j"]
    for k, title in ((0, "loss"), (1, "target gradient dL/dz_t")):
        lines.append(f"  {title}")
        lines.append("  " + f"{'m':>4s}" + "".join(f"{LABELS[n]:>{width}s}" for n in impls))
        for m in MARGINS:
            lines.append("  " + f"{m:4d}" + "".join(f"{table[m][n][k]:{width}.3e}" for n in impls))
    lines.append("  " + collapse_verdict(table))
    lines.append(f"  (below {FP32_TINY:.1e} an fp32 result is subnormal: at m=100 it keeps only "
                 "a few significant digits.)")
    return "\n".join(lines)


def collapse_verdict(table):
    parts = []
    for n in COLLAPSE_IMPLS:
        if n not in table[MARGINS[0]]:
            continue
        zero = [m for m in MARGINS if table[m][n][0] == 0.0 or table[m][n][1] == 0.0]
        rel = max(abs(table[m][n][0] - table[m]["ref"][0]) / table[m]["ref"][0]
                  for m in MARGINS if table[m]["ref"][0] > 1e6 * FP32_TINY)
        if zero:
            parts.append(f"{LABELS[n]}: exactly 0 from m={zero[0]}")
        else:
            parts.append(f"{LABELS[n]}: loss rel. err. <= {rel:.1e} (m <= 50)")
    return "; ".join(parts)


def grad_accuracy(device, n, v, d):
    """dC (weight) and dE (input) error vs float64, in units of the fp32 rounding floor."""
    x, w, t = _peers.random_batch(n, v, d, torch.float32, "cpu", seed=7)
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    flce.reference.linear_cross_entropy(x64, w64, t).backward()
    ref = {"dC": w64.grad, "dE": x64.grad}
    floor = {k: _rel(g.float().double(), g) for k, g in ref.items()}
    out = {}
    for name in COLLAPSE_IMPLS:
        if _peers.available(name) is not None:
            continue
        xd = x.to(device, copy=True).requires_grad_(True)
        wd = w.to(device, copy=True).requires_grad_(True)
        _peers.make_impl(name, device)(xd, wd, t.to(device)).backward()
        got = {"dC": wd.grad.cpu().double(), "dE": xd.grad.cpu().double()}
        out[name] = {k: _rel(got[k], ref[k]) / floor[k] for k in ref}
    return out


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def format_grad(res, n, v, d):
    lines = [f"(ii) Gradient accuracy: N={n}, V={v}, D={d}, fp32; error vs float64 / error of "
             "rounding float64 to fp32 (1 = ideal)"]
    for name, r in res.items():
        lines.append(f"  {LABELS[name]:>24s}: dC {r['dC']:6.2f}x   dE {r['dE']:6.2f}x")
    return "\n".join(lines)


def speed(device, n, v, d, repeats):
    rows = {}
    for name in COLLAPSE_IMPLS:
        if _peers.available(name) is not None:
            continue
        spec = {"impl": name, "device": device, "dtype": "fp32", "N": n, "V": v, "D": d,
                "repeats": repeats, "warmup": 1, "accuracy": False,
                "threads": torch.get_num_threads()}
        rows[name] = _peers.run_child(spec, timeout=600)
    return rows


def format_speed(rows, n, v, d, repeats):
    lines = [f"(iii) Cost: fwd+bwd, N={n}, V={v}, D={d}, fp32, median of {repeats}, one fresh "
             "process each"]
    base = rows.get("flce", {})
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"  {LABELS[name]:>24s}: failed ({r['error']})")
            continue
        ratio = ""
        if "time_median_s" in base and name != "flce":
            ratio = (f"  ({r['time_median_s'] / base['time_median_s']:.2f}x flce's time, "
                     f"{r['peak_mem_bytes'] / max(base['peak_mem_bytes'], 1):.2f}x its memory)")
        lines.append(f"  {LABELS[name]:>24s}: {r['time_median_s']:7.3f} s  "
                     f"{r['peak_mem_bytes'] / 2 ** 20:7.0f} MB peak{ratio}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke test")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        cv, cd, gn, gv, gd, sn, sv, sd, reps = 1024, 32, 512, 256, 16, 64, 512, 32, 1
    else:
        cv, cd, gn, gv, gd, sn, sv, sd, reps = 32768, 64, 16384, 2048, 64, 2048, 32768, 256, 3
    print(f"flce demo on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} "
          "threads)\n", flush=True)
    start = time.perf_counter()
    collapse = collapse_table(args.device, cv, cd)
    print(format_collapse(collapse, cv, cd) + "\n", flush=True)
    grads = grad_accuracy(args.device, gn, gv, gd)
    print(format_grad(grads, gn, gv, gd) + "\n", flush=True)
    cost = speed(args.device, sn, sv, sd, reps)
    print(format_speed(cost, sn, sv, sd, reps), flush=True)
    print(f"\n(demo took {time.perf_counter() - start:.0f} s)")
    return {"collapse": collapse, "grad": grads, "speed": cost}


if __name__ == "__main__":
    main()
