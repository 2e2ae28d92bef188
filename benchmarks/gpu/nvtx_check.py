"""NVTX ranges of flce on a GPU, checked with ncu (nsys is not on the lent machine).

Workload (default): one step of each flce path at a small shape (the single pass, the
recompute path with lse and entropy, cross-entropy on given logits, in place too), each op's
CUDA launches inside its flce:: range. benchmarks/gpu/check.sh profiles it three times:

    ncu --csv --metrics gpu__time_duration.sum python benchmarks/gpu/nvtx_check.py > all.csv
    ncu --csv --nvtx --nvtx-include "regex:flce::.*/" ... > in_ranges.csv
    FLCE_NVTX=0 ncu --csv --nvtx --nvtx-include "regex:flce::.*/" ... > off.csv
    python benchmarks/gpu/nvtx_check.py --compare all.csv in_ranges.csv off.csv

--compare checks that every flce kernel (the names of csrc/cuda/*.cu's kernels) of the first
run is in the second, and that FLCE_NVTX=0 leaves none in the third.
"""
import csv
import sys

FLCE_KERNELS = ("combine_kernel", "row_coef_kernel",
                "target_fix_kernel", "kahan_accumulate_kernel",
                "scale_store_kernel", "column_sum_kernel", "row_stats_kernel",
                "row_grad_kernel", "target_rows_kernel", "scale_grad_kernel")


def workload():
    import torch

    import flce

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(5000, 128, generator=g) / 12).to("cuda", torch.bfloat16).requires_grad_()
    t = torch.randint(0, 5000, (256,), generator=g).cuda()
    flce.linear_cross_entropy(x, w, t).backward()                      # flce::sum_and_grad
    loss, lse, ent = flce.linear_cross_entropy(x, w, t, reduction="none", return_lse=True,
                                               return_entropy=True)   # flce::forward
    (loss.sum() + lse.sum() + ent.sum()).backward()                   # flce::backward
    z = (torch.randn(256, 5000, generator=g) * 3).to("cuda", torch.bfloat16).requires_grad_()
    flce.cross_entropy(z, t, label_smoothing=0.1).backward()           # flce::logits_*
    flce.cross_entropy(z * 1, t, inplace_backward=True).backward()
    torch.cuda.synchronize()


def kernels(path):
    """Kernel names of an ncu --csv report (its "Kernel Name" column), with repeats."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own log lines are unquoted
    names = [row["Kernel Name"] for row in csv.DictReader(lines)
             if row.get("Metric Name") == "gpu__time_duration.sum"]
    return names


def compare(all_csv, in_csv, off_csv):
    def ours(names):
        return sorted(n for n in names if any(k in n for k in FLCE_KERNELS))

    every, inside, off = kernels(all_csv), kernels(in_csv), kernels(off_csv)
    mine = ours(every)
    print(f"flce kernels launched: {len(mine)} ({len(set(mine))} distinct); inside flce:: "
          f"ranges: {len(ours(inside))} (all kernels inside: {len(inside)}); with FLCE_NVTX=0: "
          f"{len(off)}")
    missing = sorted(set(mine) - set(ours(inside)))
    ok = bool(mine) and ours(inside) == mine and not off
    if missing:
        print("outside every flce range:", *missing, sep="\n  ")
    print("NVTX ranges: ok" if ok else "NVTX ranges: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--compare":
        sys.exit(compare(*sys.argv[2:]))
    workload()
