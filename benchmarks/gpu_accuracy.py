"""Long-sequence gradient accuracy of the CUDA single pass against float64 (N = 65536, V = 2048,
D = 64, the shape of tests/test_accuracy.py), for several accumulation settings of the fp32 path:
FLCE_CUDA_FP32_GROUP_ROWS (rows summed inside one cuBLAS GEMM of dW before the compensated add
across groups) and FLCE_CUDA_FP32_PIECE_COLS (vocabulary columns summed inside one GEMM of dE).
Prints flce / ideal for dE and dC (the test's bound is 1.5), the ideal's own error over the
rounding floor, and eager's ratio; "recompute" is the 4-GEMM path (single_pass=False).

    python benchmarks/gpu_accuracy.py [--settings 1024,8192 256,256 ...]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import flce  # noqa: E402
from helpers import ideal_grads, rand_inputs, rel_err, round_floor  # noqa: E402

N, V, D = 65536, 2048, 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="*", default=["1024,8192", "256,256", "recompute"])
    args = ap.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        x, w, t, _ = rand_inputs(N, V, D, dtype, "cuda", seed=11)
        ref = ideal_grads(x, w, t, out_dtype=dtype, scale=1.0 / N)
        ideal = {g: rel_err(ref["ideal_" + g], ref["ref_" + g]) for g in ("dE", "dC")}
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        F.cross_entropy(xe @ we.T, t).backward()
        eager = {"dE": rel_err(xe.grad, ref["ref_dE"]) / ideal["dE"],
                 "dC": rel_err(we.grad, ref["ref_dC"]) / ideal["dC"]}
        print(f"{str(dtype)[6:]}: ideal/floor dE {ideal['dE'] / round_floor(ref['ref_dE'], dtype):.3f}"
              f" dC {ideal['dC'] / round_floor(ref['ref_dC'], dtype):.3f}; eager/ideal dE "
              f"{eager['dE']:.3f} dC {eager['dC']:.3f}", flush=True)
        for setting in (args.settings if dtype == torch.float32 else ["default"]):
            if setting not in ("default", "recompute"):
                rows, cols = setting.split(",")
                os.environ["FLCE_CUDA_FP32_GROUP_ROWS"] = rows
                os.environ["FLCE_CUDA_FP32_PIECE_COLS"] = cols
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            flce.linear_cross_entropy(xg, wg, t,
                                      single_pass=False if setting == "recompute" else None
                                      ).backward()
            ev[1].record()
            torch.cuda.synchronize()
            print(f"  {setting:>10} (group rows, piece cols): flce/ideal dE "
                  f"{rel_err(xg.grad, ref['ref_dE']) / ideal['dE']:.3f} dC "
                  f"{rel_err(wg.grad, ref['ref_dC']) / ideal['dC']:.3f}  "
                  f"({ev[0].elapsed_time(ev[1]):.1f} ms incl. first-call costs)", flush=True)
        os.environ.pop("FLCE_CUDA_FP32_GROUP_ROWS", None)
        os.environ.pop("FLCE_CUDA_FP32_PIECE_COLS", None)


if __name__ == "__main__":
    main()
