"""Shared machinery of bench.py, bench_ce.py, demo.py and run.py collapse: the implementations
compared, the inputs they get, their options' parsing, and the per-process measurement of time,
peak memory and large-margin accuracy.

Each measurement runs in a fresh child process (``python _peers.py '<json spec>'``; bench_ce.py
runs its own the same way) so that one implementation's allocator caches, compiled graphs and
thread pools cannot flatter or penalize the next one, and so that the child's peak resident set
size is that implementation's alone.
"""
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import _records  # noqa: F401  (puts the checkout's flce on the path where none is installed)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Liger runs through the Triton interpreter on CPU: about a million times slower than a kernel.
# Beyond this many multiply-adds (N * V * D) a CPU run is refused rather than left to hang.
LIGER_CPU_MAX_MACS = 2 ** 26

IMPLS = ("flce", "eager", "compile", "chunked", "liger", "cce", "flce-single", "flce-recompute",
         "flce-exact", "gemm3", "gemm3-flce", "flce-soft", "eager-soft")
# `run.py distill`'s implementations (benchmarks/bench.py --distill): a student's loss against a
# frozen teacher's logits, and its floor, the 5 GEMMs. "flce" there is linear_cross_entropy on
# the student alone, the memory reference.
DISTILL = ("flce-jsd", "flce-fkl", "eager-jsd", "eager-fkl", "liger-jsd", "gemm5", "gemm5-flce")
BETA = 0.5  # the distillation runs' JSD beta
# The floors: a step's GEMMs (3 for cross-entropy, 5 for distillation) on torch.mm and on flce's
# own CPU tile-GEMM engine; a run's floor is the faster of those it timed (benchmarks/bench.py),
# so that "x floor" >= 1 for any implementation that computes those GEMMs with either engine.
FLOORS = ("gemm3", "gemm3-flce", "gemm5", "gemm5-flce")
# flce's two training paths forced (single_pass=True / False), and its exact bf16 gradients
# (exact_bf16_grad=True: the CPU backend's split gradient tile on AMX), beside its defaults.
FLCE_PATHS = {"flce": {}, "flce-single": {"single_pass": True},
              "flce-recompute": {"single_pass": False}, "flce-exact": {"exact_bf16_grad": True}}


def soft_targets(t, v, _cache={}):
    """Probability targets of class ids t: 0.9 on the class, the rest spread evenly (a
    distillation-like distribution), fp32 [N, V]. Made once per batch (the warm-up step makes
    them), so that neither the timed steps nor the memory probe count them: they are an input."""
    key = (t.data_ptr(), t.numel(), v)
    if key not in _cache:
        _cache.clear()
        q = torch.full((t.numel(), v), 0.1 / max(v - 1, 1), device=t.device)
        q.scatter_(1, t[:, None], 0.9)
        _cache[key] = q
    return _cache[key]


class _Gemm3(torch.autograd.Function):
    """The three GEMMs of a training step that keeps its logits, torch.mm in the inputs' dtype:
    z = x w^T [N, V] forward, z w [N, D] and z^T x [V, D] backward. No loss math: the floor of
    any fused implementation's time (it holds [N, V] like eager; its memory is not a peer's)."""

    @staticmethod
    def forward(ctx, x, w):
        z = x @ w.T
        ctx.save_for_backward(x, w, z)
        return z.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w, z = ctx.saved_tensors
        return z @ w, z.T @ x


class _Gemm3Flce(torch.autograd.Function):
    """The same 3 GEMMs on flce's CPU tile-GEMM engine (torch.ops.flce.cpu_tile_gemm: oneDNN's
    micro-kernels or the BLAS, whichever flce's CPU ops use here, fp32 products). A 16-bit
    step's backward multiplies ``g``, the logits' shape in the inputs' dtype, made once outside
    the timed steps (the engine's products are fp32; torch.mm's come out in the inputs' dtype),
    so that no conversion is timed; fp32 multiplies the logits themselves."""

    @staticmethod
    def forward(ctx, x, w, g):
        z = torch.ops.flce.cpu_tile_gemm(x, w, trans_b=True)
        ctx.save_for_backward(x, w, z if x.dtype == torch.float32 else g)
        return z.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x, w, g = ctx.saved_tensors
        return (torch.ops.flce.cpu_tile_gemm(g, w),
                torch.ops.flce.cpu_tile_gemm(g, x, trans_a=True), None)


def _mm(a, b, trans_a=False, trans_b=False):
    return (a.T if trans_a else a) @ (b.T if trans_b else b)


def _tile_mm(a, b, trans_a=False, trans_b=False):
    return torch.ops.flce.cpu_tile_gemm(a, b, trans_a=trans_a, trans_b=trans_b)


class _Gemm5(torch.autograd.Function):
    """The 5 GEMMs of a distillation step with a frozen teacher (issue 55's count), no loss
    math: both logits forward; backward the student's logits again (a recomputing path's), then
    ``dz @ W_S`` and ``dz^T @ X_S``. ``mm``: torch.mm or flce's tile GEMM; ``g`` as in
    _Gemm3Flce (None: multiply the recomputed logits)."""

    @staticmethod
    def forward(ctx, x, w, x_t, w_t, g, mm):
        z = mm(x, w, trans_b=True)
        mm(x_t, w_t, trans_b=True)
        ctx.mm = mm
        ctx.save_for_backward(x, w, g)
        return z.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _):
        x, w, g = ctx.saved_tensors
        z = ctx.mm(x, w, trans_b=True)
        dz = z if g is None else g
        return ctx.mm(dz, w), ctx.mm(dz, x, trans_a=True), None, None, None, None


def teacher(x, w, _cache={}):
    """The frozen teacher of a distillation run: its hidden states and classifier in the
    student's shapes (random_batch, seed 1), made once per batch, as soft_targets is: an
    input."""
    key = (tuple(x.shape), tuple(w.shape), x.dtype, x.device)
    if key not in _cache:
        _cache.clear()
        _cache[key] = random_batch(x.shape[0], w.shape[0], x.shape[1], x.dtype, x.device,
                                   seed=1)[:2]
    return _cache[key]


def distill_impl(name, beta=BETA, compiled=True):
    """``f(x_s, w_s, x_t, w_t) -> mean loss`` for the distillation implementation ``name``
    (its divergence "jsd" at ``beta`` or "fkl", forward KL); "eager" is examples/distill.py's
    stock recipe (TRL's generalized_jsd_loss)."""
    kind, _, div = name.partition("-")
    beta = beta if div == "jsd" else 0.0
    if kind == "flce":
        import flce
        div = "jsd" if div == "jsd" else "forward_kl"
        return lambda x, w, xt, wt: flce.linear_distillation(x, w, xt, wt, divergence=div,
                                                             beta=beta)
    if kind == "eager":  # the teacher's logits without grad, as a frozen teacher's
        sys.path.insert(0, os.path.join(_records.REPO, "examples"))
        from distill import stock_divergence

        def f(x, w, xt, wt):
            with torch.no_grad():
                z_t = F.linear(xt, wt)
            return stock_divergence(F.linear(x, w), z_t, beta).mean()
        return f
    if kind == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta,
                                       compiled=compiled)
        return lambda x, w, xt, wt: loss(x, w, xt, wt, torch.zeros(x.shape[0], dtype=torch.long,
                                                                   device=x.device))
    raise ValueError(f"unknown implementation {name!r}; choose from {DISTILL}")


def _gemm_operand(n, v, dtype, _cache={}):
    """An [n, v] operand in ``dtype`` for _Gemm3Flce's backward, made once per shape."""
    key = (n, v, dtype)
    if key not in _cache:
        _cache.clear()
        _cache[key] = torch.randn(n, v).to(dtype)
    return _cache[key]


def names(parser, option, text, choices, empty=False):
    """The comma list ``text`` of ``option``, each one of ``choices`` (argparse's error if not:
    the option and what it takes named)."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in choices]
    if bad or not (out or empty):
        parser.error(f"{option}: unknown {bad}; choose from {tuple(choices)}")
    return out


def shapes(parser, option, text, dims):
    """``option``'s comma list of shapes, NxV or NxVxD (``dims`` numbers each, all >= 1)."""
    try:
        out = [tuple(int(a) for a in s.lower().split("x")) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != dims or min(s) < 1 for s in out):
        form = "x".join("NVD"[:dims])
        parser.error(f"{option}: {form},{form},... of integers >= 1, got {text!r}")
    return out


def available(name):
    """None when ``name`` can run here, else the reason it cannot (benchmarks/bench.py adds
    the device's reasons)."""
    if name in ("eager", "compile", "gemm3", "gemm3-flce") or name in FLCE_PATHS:
        return None
    if name in DISTILL:
        return None if name != "liger-jsd" else available("liger")
    if name == "chunked":
        if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn,
                                                                 "LinearCrossEntropyOptions"):
            return f"torch {torch.__version__} has no chunked F.linear_cross_entropy (>= 2.13)"
        return None
    module = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}[name]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None


# An AVX2-only x86-64 CPU, emulated on a newer one for one process: torch's own kernels
# (ATEN_CPU_CAPABILITY), oneDNN's JIT kernels (which then refuse torch's brgemm micro-kernels, so
# flce takes its BLAS path, as on a real AVX2 machine) and MKL's code paths all stop at AVX2. The
# core stays what it is (caches, clocks, the width of its datapaths).
EMULATE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def child_env(name, device, isa=None):
    env = dict(os.environ)
    if name == "liger" and device == "cpu":  # (its distillation loss is torch.compile'd)
        env["TRITON_INTERPRET"] = "1"
    if isa == "avx2":
        env.update(EMULATE_AVX2)
    return env


# A competing process for `--load`: pure CPU (an interpreter loop; no I/O, no network) that ends
# by itself at its deadline even if nobody stops it.
_SPIN = ("import sys, time\n"
         "end = time.monotonic() + float(sys.argv[1])\n"
         "while time.monotonic() < end:\n"
         "    pass\n")


class BusyLoad:
    """``n`` processes spinning on the CPU for at most ``seconds``, killed on exit."""

    def __init__(self, n, seconds):
        self.n, self.seconds, self.procs = n, seconds, []

    def __enter__(self):
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", _SPIN, str(self.seconds)], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if self.n:
            time.sleep(0.2)  # let them start spinning before anything is timed
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []
        return False


def make_impl(name, device):
    """``f(x, w, t, bias=None) -> mean loss`` for implementation ``name``."""
    if name in FLCE_PATHS:
        import flce
        kwargs = FLCE_PATHS[name]

        def f(x, w, t, bias=None):
            return flce.linear_cross_entropy(x, w, t, bias=bias, **kwargs)
        return f
    if name == "flce-soft":
        import flce

        def f(x, w, t, bias=None):
            return flce.linear_cross_entropy(x, w, soft_targets(t, w.shape[0]), bias=bias)
        return f
    if name == "eager-soft":
        def f(x, w, t, bias=None):
            return F.cross_entropy(F.linear(x, w, bias).float(), soft_targets(t, w.shape[0]))
        return f
    if name in ("eager", "compile"):
        # The usual LM recipe (e.g. Hugging Face): logits in the input dtype, upcast, then CE.
        def f(x, w, t, bias=None):
            return F.cross_entropy(F.linear(x, w, bias).float(), t)
        return torch.compile(f) if name == "compile" else f
    if name == "chunked":
        options = torch.nn.LinearCrossEntropyOptions()

        def f(x, w, t, bias=None):
            return F.linear_cross_entropy(x, w, t, linear_bias=bias, options=options)
        return f
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def f(x, w, t, bias=None):
            return liger_fused_linear_cross_entropy(x, w, t, bias)
        return f
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy as cce
        impl = "cce" if device == "cuda" else "torch_compile"

        def f(x, w, t, bias=None):
            if bias is not None:
                raise ValueError("cut_cross_entropy takes no bias")
            return cce(x, w, t, impl=impl)
        return f
    if name == "gemm3":
        def f(x, w, t, bias=None):
            return _Gemm3.apply(x, w.to(x.dtype))
        return f
    if name == "gemm3-flce":
        import flce  # noqa: F401  (registers torch.ops.flce.*)

        def f(x, w, t, bias=None):
            g = None if x.dtype == torch.float32 else _gemm_operand(x.shape[0], w.shape[0],
                                                                     x.dtype)
            return _Gemm3Flce.apply(x, w.to(x.dtype), g)
        return f
    if name in ("gemm5", "gemm5-flce"):
        import flce  # noqa: F401  (registers torch.ops.flce.*)

        def f(x, w, t, bias=None):
            g = None
            if name == "gemm5-flce" and x.dtype != torch.float32:
                g = _gemm_operand(x.shape[0], w.shape[0], x.dtype)
            mm = _tile_mm if name == "gemm5-flce" else _mm
            return _Gemm5.apply(x, w, *teacher(x, w), g, mm)
        return f
    if name in DISTILL:
        loss = distill_impl(name)
        return lambda x, w, t, bias=None: loss(x, w, *teacher(x, w))
    raise ValueError(f"unknown implementation {name!r}; choose from {IMPLS + DISTILL}")


def random_batch(n, v, d, dtype, device, seed=0):
    """Hidden states ~ N(0, 1) and a classifier scaled so that logits are ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return x.to(device), w.to(device), t.to(device)


def margin_batch(n, v, d, margin, dtype, seed=0):
    """A batch whose every row has target margin ``z_t - max_{j != t} z_j`` close to ``margin``.

    Built in float64 by moving each hidden state along its target's classifier row (Newton steps
    on the piecewise-linear margin), then rounded to ``dtype``; the rounded tensors are the
    problem, so references must be computed from them. Returns x, w, t (CPU) and the margins of
    the rounded problem.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    w_t = w[t]
    step_dir = w_t / (w_t * w_t).sum(1, keepdim=True)
    for _ in range(20):
        cur, rival = _margins(x, w, t)
        slope = 1.0 - (w[rival] * step_dir).sum(1)
        x = x + ((margin - cur) / slope)[:, None] * step_dir
    x, w = x.to(dtype), w.to(dtype)
    return x, w, t, _margins(x.double(), w.double(), t)[0]


def _margins(x, w, t):
    z = x @ w.T
    z_t = z.gather(1, t[:, None])[:, 0]
    others = z.scatter(1, t[:, None], float("-inf"))
    best, rival = others.max(1)
    return z_t - best, rival


def reference_loss(x, w, t, bias=None):
    """float64 collapse-safe mean loss of the (already rounded) problem."""
    import flce.reference
    b = None if bias is None else bias.double()
    return flce.reference.linear_cross_entropy(x.double(), w.double(), t, bias=b)


def large_margin_error(f, v, d, dtype, device, margin, n=16, seed=1):
    """Relative error of ``f``'s mean loss vs float64 on a batch at target margin ``margin``."""
    x, w, t, margins = margin_batch(n, v, d, margin, dtype, seed)
    ref = float(reference_loss(x, w, t))
    with torch.no_grad():
        got = float(f(x.to(device), w.to(device), t.to(device)))
    return abs(got - ref) / abs(ref), float(margins.mean()), got, ref


# ---- one measurement (runs in the child) ---------------------------------------------------------

def measure(spec):
    """Time, peak memory and accuracy of one implementation at one shape; returns a dict."""
    name, device = spec["impl"], spec["device"]
    dtype = DTYPES[spec["dtype"]]
    n, v, d = spec["N"], spec["V"], spec["D"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    f = make_impl(name, device)
    x, w, t = random_batch(n, v, d, dtype, device, seed=spec.get("seed", 0))
    x.requires_grad_(True)
    w.requires_grad_(True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        x.grad = None
        w.grad = None
        loss = f(x, w, t)
        loss.backward()
        sync()
        return loss

    # The process's first step is timed on its own (lazy initialization, JIT, first-touch
    # page faults, thread-pool start: what a user's first training step pays).
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(spec.get("warmup", 1) - 1):
        step()
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    out = {"time_median_s": statistics.median(times), "time_min_s": min(times),
           "time_max_s": max(times), "time_first_s": first, "loss": float(loss.detach()),
           "threads": torch.get_num_threads(), "isa": isa_level(device)}
    if name in FLCE_PATHS and device == "cpu":
        import flce
        info = flce.build_info()
        out["cpu_gemm"] = info["cpu_gemm"]
        out["cpu_amx"] = info["cpu_amx"]
        if dtype == torch.bfloat16:  # how the gradient tiles were rounded (docs/numerics.md)
            out["cpu_bf16_grad"] = torch.ops.flce.cpu_bf16_grad(
                FLCE_PATHS[name].get("exact_bf16_grad"))
    x.grad = None
    w.grad = None
    del loss
    from flce.check import Peak  # (a peer's process loads flce only here, where it measures)

    with Peak(device) as mem:
        step()
    out["peak_mem_bytes"] = mem.bytes
    out["peak_total_bytes"] = mem.total
    if spec.get("accuracy", True) and name not in FLOORS + DISTILL:
        rel, mean_margin, _, _ = large_margin_error(
            f, spec["acc_V"], spec["acc_D"], dtype, device, spec["margin"])
        out["loss_rel_err"] = rel
        out["acc_margin"] = mean_margin
    return out


def isa_level(device):
    """torch's CPU kernel level ("AVX512", "AVX2", ...), or the GPU's name on CUDA."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return torch.backends.cpu.get_cpu_capability()


def run_child(spec, timeout=None, script=(os.path.abspath(__file__),)):
    """Run ``script`` (this file's :func:`measure`, or the command line of another script whose
    child prints its result as the last JSON line) for ``spec`` in a fresh interpreter; returns
    its dict, or one with an ``error`` key when the child fails. ``spec["isa"] == "avx2"``
    emulates an AVX2-only CPU in the child (EMULATE_AVX2)."""
    cmd = [sys.executable, *script, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=child_env(spec["impl"], spec["device"], spec.get("isa")))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
