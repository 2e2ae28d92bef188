"""The fused logits path on a GPU (FLCE_CUDA_FUSED_LOGITS=1; docs/cuda.md "Fused logits").

1. Which epilogue ran: the CUTLASS GEMM (sm_90a: a kernel named ...FusedLogitsEpilogue... in
   the profiler) or its SIMT stand-in (logits_epilogue_kernel). On an H100/H200 with a 9.0a
   build the CUTLASS kernel must run; a silent fallback is reported as a failure.
2. The CUTLASS kernel against the stand-in on the same inputs (FLCE_CUDA_FUSED_GEMM=0), shapes
   with tails in N, V and D: the loss within fp32 rounding of each other, the gradients within
   bf16's (the two differ only in the GEMM's fp32 summation order, and E's rounding where that
   moves it across a bf16 boundary).
3. The vocab-parallel path on a one-rank NCCL group with a small workspace: there the GEMM
   writes each sub-chunk at an offset inside the group buffer (one process uses whole groups),
   against one process's fused path.
4. --small: only small shapes (for compute-sanitizer memcheck / racecheck).
Exit status 1 on any failure.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import flce  # noqa: E402

SMALL = [(1, 8, 8), (37, 301, 72), (130, 1000, 136), (257, 4099, 64)]
LARGE = [(4096, 50021, 4096), (4000, 32768, 1024)]


def step(x, w, t, **env):
    for k, v in env.items():
        os.environ[k] = v
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = flce.linear_cross_entropy(xg, wg, t)
    loss.backward()
    return loss.detach(), xg.grad, wg.grad


def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


# The GPU's CUTLASS kernel: the build's SASS target and CUTLASS kernel for it.
KERNELS = {(9, 0): ("sm_90a", "sm90")}


def wants_cutlass():
    sass, _ = KERNELS.get(torch.cuda.get_device_capability(), (None, None))
    return sass is not None and sass in flce.build_info()["sass"]


def has_cutlass():
    _, kernel = KERNELS.get(torch.cuda.get_device_capability(), (None, None))
    return kernel in (flce.build_info().get("cutlass_kernels") or [])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    small = "--small" in sys.argv
    ok = True
    g = torch.Generator().manual_seed(0)
    for n, v, d in SMALL + ([] if small else LARGE):
        x = torch.randn(n, d, generator=g).to("cuda", torch.bfloat16)
        w = (torch.randn(v, d, generator=g) / d ** 0.5).to("cuda", torch.bfloat16)
        t = torch.randint(0, v, (n,), generator=g).to("cuda")
        t[1::7] = -100  # (not row 0: a 1-row shape would have no row left, and a NaN mean)
        names = kernels_of(lambda: step(x, w, t, FLCE_CUDA_FUSED_LOGITS="1",
                                        FLCE_CUDA_FUSED_GEMM="1"))
        cutlass = any("FusedLogitsEpilogue" in k for k in names)
        stand_in = any("logits_epilogue_kernel" in k for k in names)
        # An H100/H200 with a build for 9.0a must run the CUTLASS kernel: a
        # build that left it out (no CUTLASS headers where it was built) fails here too.
        want_cutlass = wants_cutlass() and d % 8 == 0
        if want_cutlass and not has_cutlass():
            print("FAIL: this build has no fused logits GEMM for this GPU (no CUTLASS headers at "
                  "build time: put the nvidia-cutlass wheel in .whl/, see gpu_check.sh)")
            return 1
        a = step(x, w, t, FLCE_CUDA_FUSED_LOGITS="1", FLCE_CUDA_FUSED_GEMM="1")
        b = step(x, w, t, FLCE_CUDA_FUSED_LOGITS="1", FLCE_CUDA_FUSED_GEMM="0")
        exact = step(x, w, t, FLCE_CUDA_FUSED_LOGITS="0")
        errs = [rel(p, q) for p, q in zip(a, b)]
        # (the two differ only in the GEMM's fp32 summation order: a few E values round the
        # other way, far below the gradients' own ~1.7e-3 error against float64)
        good = (cutlass == want_cutlass and (cutlass or stand_in) and errs[0] < 1e-5
                and errs[1] < 1e-3 and errs[2] < 1e-3
                and all(torch.isfinite(p).all().item() for p in a))
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} N={n} V={v} D={d}: epilogue "
              f"{'CUTLASS' if cutlass else 'stand-in' if stand_in else 'none?'}"
              f"{'' if cutlass == want_cutlass else ' (expected the other)'}; vs stand-in: loss "
              f"{errs[0]:.1e}, dE {errs[1]:.1e}, dW {errs[2]:.1e}; vs exact path: loss "
              f"{rel(a[0], exact[0]):.1e}, dE {rel(a[1], exact[1]):.1e}, dW {rel(a[2], exact[2]):.1e}")
        del x, w, t, a, b, exact
        torch.cuda.empty_cache()
    if not small:
        ok &= vocab_parallel_one_rank()
    print("fused check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def vocab_parallel_one_rank():
    import tempfile

    import torch.distributed as dist

    import flce.parallel as fp

    path = tempfile.mktemp()
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(1)
        n, v, d = 3000, 20000, 1024
        x = torch.randn(n, d, generator=g).to("cuda", torch.bfloat16)
        w = (torch.randn(v, d, generator=g) / d ** 0.5).to("cuda", torch.bfloat16)
        t = torch.randint(0, v, (n,), generator=g).to("cuda")
        # 200 MiB: one group of the 3000 rows, in vocab-parallel sub-chunks of 192 (16 GEMMs)
        os.environ.update(FLCE_CUDA_FUSED_LOGITS="1", FLCE_CUDA_FUSED_GEMM="1",
                          FLCE_CUDA_WORKSPACE_MB="200")
        names, out = set(), {}
        for mode in ("parallel", "single"):
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            def run():  # noqa: E306
                loss = (fp.vocab_parallel_linear_cross_entropy(xg, wg, t) if mode == "parallel"
                        else flce.linear_cross_entropy(xg, wg, t))
                loss.backward()
                return loss.detach()
            if mode == "parallel":
                names = kernels_of(run)
                xg.grad = wg.grad = None
            out[mode] = (run(), xg.grad, wg.grad)
        del os.environ["FLCE_CUDA_WORKSPACE_MB"]
        errs = [rel(p, q) for p, q in zip(out["parallel"], out["single"])]
        cutlass = any("FusedLogitsEpilogue" in k for k in names)
        good = cutlass == wants_cutlass() and errs[0] < 1e-5 and errs[1] < 1e-3 and errs[2] < 1e-3
        print(f"{'ok  ' if good else 'FAIL'} vocab-parallel, one rank, sub-chunks at offsets: "
              f"epilogue {'CUTLASS' if cutlass else 'not CUTLASS'}; vs one process: loss "
              f"{errs[0]:.1e}, dE {errs[1]:.1e}, dW {errs[2]:.1e}")
        return good
    except Exception as e:  # noqa: BLE001  (report, do not lose the rest of the script's output)
        print(f"FAIL vocab-parallel, one rank: {type(e).__name__}: {e}"[:400])
        return False
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
