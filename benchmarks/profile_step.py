"""A fixed number of warm-up and profiled steps of flce at a realistic shape, for profilers.

    python benchmarks/run.py profile --n 8192 --v 128256 --d 4096 --dtype bf16     # timing only
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx \
        -o flce python benchmarks/profile_step.py ...                                   # profiled steps
    ncu --profile-from-start off --clock-control none --kernel-name-base demangled \
        -k regex:flce:: --launch-count 1 python benchmarks/profile_step.py --steps 1 ...  # one kernel
    python benchmarks/profile_step.py --device cpu --n 512 --v 4096 --d 256 --torch-profiler out.json

The profiled steps run between torch.cuda.profiler.start() and stop() (cudaProfilerStart/Stop),
so nsys with --capture-range=cudaProfilerApi and ncu with --profile-from-start off see exactly
them and none of the warm-up. Each step is inside NVTX ranges "profile::step", with
"profile::forward" and "profile::backward" nested; flce's CUDA launches add "flce::forward" /
"flce::backward" ranges from C++ (FLCE_NVTX=0 disables them; docs/profiling.md). The speed of light printed is the GEMM work alone: 2 N V D flops
per GEMM, 4 GEMMs for a recomputing backward (forward logits, recomputed logits, dE, dC), 3 when
the forward keeps its exponentials.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peers import DTYPES  # noqa: E402  (and the checkout's flce where none is installed)

import flce  # noqa: E402
from flce.check import Peak  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="tokens (batch x sequence)")
    ap.add_argument("--v", type=int, default=128256, help="vocabulary size")
    ap.add_argument("--d", type=int, default=4096, help="hidden size")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--impl", choices=("flce", "torch"), default="flce",
                    help="torch: F.linear + F.cross_entropy with materialized logits, a peer")
    ap.add_argument("--ignore-frac", type=float, default=0.0,
                    help="fraction of targets set to ignore_index")
    ap.add_argument("--torch-profiler", metavar="TRACE.json",
                    help="also record the profiled steps with torch.profiler, Chrome trace out")
    ap.add_argument("--memory-snapshot", metavar="SNAPSHOT.pickle",
                    help="CUDA: record the allocator's history over one more step and dump it "
                         "(torch.cuda.memory._dump_snapshot; open at pytorch.org/memory_viz)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak for --dtype (H100/H200 bf16: 989) for the "
                         "speed-of-light lines")
    args = ap.parse_args(argv)
    for name in ("n", "v", "d", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if not 0.0 <= args.ignore_frac < 1.0:
        ap.error("--ignore-frac must be in [0, 1)")
    return args


def make_inputs(args):
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(args.n, args.d, generator=g) / args.d ** 0.25).to(device, dtype)
    w = (torch.randn(args.v, args.d, generator=g) / args.d ** 0.25).to(device, dtype)
    t = torch.randint(0, args.v, (args.n,), generator=g)
    if args.ignore_frac:
        t[torch.rand(args.n, generator=g) < args.ignore_frac] = -100
    return x.requires_grad_(), w.requires_grad_(), t.to(device)


def loss_fn(impl):
    if impl == "flce":
        return flce.linear_cross_entropy
    def torch_ce(x, w, t):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), t)
    return torch_ce


@contextlib.contextmanager
def nvtx(name, on):
    if on:
        torch.cuda.nvtx.range_push(name)
    with torch.profiler.record_function(name):
        yield
    if on:
        torch.cuda.nvtx.range_pop()


class Timer:
    def __init__(self, cuda):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3

    def elapsed_ms(self):
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return self.ms


def step(fn, x, w, t, forward_only, cuda):
    x.grad = w.grad = None
    with nvtx("profile::step", cuda):
        with nvtx("profile::forward", cuda):
            loss = fn(x, w, t)
        if not forward_only:
            with nvtx("profile::backward", cuda):
                loss.backward()
    return loss


def run(args):
    cuda = torch.device(args.device).type == "cuda"
    x, w, t = make_inputs(args)
    fn = loss_fn(args.impl)
    for _ in range(args.warmup):
        step(fn, x, w, t, args.forward_only, cuda)

    prof = None
    if args.torch_profiler:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts, record_shapes=True)
    times = []
    with Peak("cuda" if cuda else "cpu") as mem, \
            prof if prof is not None else contextlib.nullcontext():
        if cuda:
            torch.cuda.profiler.start()
        for _ in range(args.steps):
            with Timer(cuda) as tm:
                loss = step(fn, x, w, t, args.forward_only, cuda)
            times.append(tm)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    ms = [tm.elapsed_ms() for tm in times]
    if prof is not None:
        prof.export_chrome_trace(args.torch_profiler)
        # Where the step's time goes, kernel by kernel (device time first where there is one).
        avg = prof.key_averages()
        for key in (("self_device_time_total", "self_cuda_time_total") if cuda
                    else ("self_cpu_time_total",)):
            try:
                print(avg.table(sort_by=key, row_limit=30, max_name_column_width=70))
                break
            except (AttributeError, KeyError, ValueError):
                continue

    med = statistics.median(ms)
    gemm = 2.0 * args.n * args.v * args.d
    n_gemm = 1 if args.forward_only else 4
    print(f"flce profile: impl={args.impl} N={args.n} V={args.v} D={args.d} dtype={args.dtype} "
          f"device={args.device} {'forward' if args.forward_only else 'forward+backward'}")
    print(f"  {args.steps} profiled steps after {args.warmup} warm-up: median {med:.3f} ms "
          f"(min {min(ms):.3f}, max {max(ms):.3f}); loss {loss.item():.6f}")
    print(f"  {n_gemm} GEMMs of 2NVD = {n_gemm * gemm / 1e12:.3f} TFLOP per step: "
          f"{n_gemm * gemm / (med * 1e-3) / 1e12:.3g} TFLOP/s achieved")
    if args.peak_tflops:
        for label, k in (("recompute (4 GEMMs)", 4), ("stored exp (3 GEMMs)", 3)):
            if args.forward_only:
                label, k = "forward (1 GEMM)", 1
            sol = k * gemm / (args.peak_tflops * 1e12) * 1e3
            print(f"  speed of light, {label}, at {args.peak_tflops:g} TFLOP/s: {sol:.3f} ms "
                  f"-> this step is at {sol / med:.1%} of it")
            if args.forward_only:
                break
    if cuda:
        print(f"  peak memory above inputs and grads: {mem.bytes / 2**20:.1f} MiB "
              f"(logits in fp32 would be {args.n * args.v * 4 / 2**20:.1f} MiB)")
    if args.torch_profiler:
        print(f"  torch.profiler Chrome trace: {args.torch_profiler}")
    if args.memory_snapshot and cuda:
        # One more step with the allocator's history on: every buffer of the step, where it was
        # allocated (Python and C++ frames) and how long it lived.
        x.grad = w.grad = None
        torch.cuda.memory._record_memory_history(max_entries=200000)
        step(fn, x, w, t, args.forward_only, cuda)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(args.memory_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"  memory snapshot of one step: {args.memory_snapshot}")
    return med


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
