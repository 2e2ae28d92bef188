"""Shared machinery of bench.py (`run.py linear`, `distill`, `ce`), demo.py and run.py
collapse: the implementations compared, the inputs they get, their options' parsing, and the
per-process measurement of time, peak memory and large-margin accuracy.

Each measurement runs in a fresh child process (``python _peers.py '<json spec>'``) so that one
implementation's allocator caches, compiled graphs and thread pools cannot flatter or penalize
the next one, and so that the child's peak resident set size is that implementation's alone.
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


class _Floor(torch.autograd.Function):
    """A floor's GEMMs alone, no loss math (the floor of any fused implementation's time; it
    holds [N, V] like eager: its memory is not a peer's). ``gemms(x, w)`` runs them all in the
    forward (flce.check.gemm3_candidates' engines, the floor `python -m flce.check` times) and
    returns dE and dW, which the backward hands on as the gradients."""

    @staticmethod
    def forward(ctx, gemms, x, w):
        ctx.save_for_backward(*gemms(x, w))
        return x.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _):
        return None, *ctx.saved_tensors


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
    if name in FLOORS:
        from flce.check import gemm3_candidates, logits_gemm  # (torch.ops.flce.* registered)

        tile = name.endswith("-flce")
        gemm3 = gemm3_candidates(device)["flce tile GEMM" if tile else "torch.mm"]
        if name.startswith("gemm3"):
            return lambda x, w, t, bias=None: _Floor.apply(gemm3, x, w)
        logits = (lambda a, b: torch.ops.flce.cpu_tile_gemm(a, b, trans_b=True)) if tile \
            else logits_gemm

        def gemm5(x, w):
            """Distillation's 5 GEMMs (issue 55's count, a frozen teacher): both logits, then
            the step's 3 (a recomputing backward's student logits, dE and dW)."""
            logits(*teacher(x, w))
            logits(x, w)
            return gemm3(x, w)
        return lambda x, w, t, bias=None: _Floor.apply(gemm5, x, w)
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


# ---- cross-entropy on given logits (`run.py ce`) -----------------------------------------------

CE_IMPLS = ("flce", "flce_inplace", "eager", "compiled", "native", "composite", "liger")


def make_ce_impl(name):
    """``f(z, t) -> mean loss`` on given logits for implementation ``name`` of CE_IMPLS."""
    if name in ("flce", "flce_inplace"):
        import flce

        inplace = name == "flce_inplace"
        return lambda z, t: flce.cross_entropy(z, t, inplace_backward=inplace)
    if name == "eager":
        return lambda z, t: F.cross_entropy(z.float(), t)
    if name == "compiled":
        return torch.compile(lambda z, t: F.cross_entropy(z.float(), t))
    if name == "native":
        return lambda z, t: F.cross_entropy(z, t)
    if name == "composite":
        from flce import _common, _composite

        opts = _common.Options()

        def composite(z, t):
            loss = _composite.logits_per_token(z.float(), t, opts)[0]
            return loss.sum() / (t != -100).sum()
        return composite
    if name == "liger":
        from liger_kernel.transformers import LigerCrossEntropyLoss

        return LigerCrossEntropyLoss()
    raise ValueError(f"unknown implementation {name!r}; choose from {CE_IMPLS}")


def ce_available(name, device):
    """None when ``name`` of CE_IMPLS can run on ``device``, else the reason it cannot."""
    if name == "liger":
        return "Triton kernels: CUDA only" if device != "cuda" else available("liger")
    return None


def logits_batch(n, v, dtype, device, seed=0):
    """Logits ~ N(0, 4) and targets with 5 % ignored, drawn where they are used (on a GPU: not
    billions of numbers drawn on the CPU and copied over, in every child process)."""
    g = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn(n, v, generator=g, device=device, dtype=dtype).mul_(2)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    t[torch.rand(n, generator=g, device=device) < 0.05] = -100
    return z, t


def logits_margin_error(f, dtype, device, v=4096, margin=40.0, n=8):
    """Relative error of ``f``'s mean loss vs float64 on logits whose every target exceeds the
    row's other logits by ``margin`` (built on the logits themselves: rounding logits made from
    hidden states to a 16-bit dtype would move the margins by more than the loss)."""
    import flce

    g = torch.Generator(device="cpu").manual_seed(1)
    z = torch.randn(n, v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    others = z.scatter(1, t[:, None], -math.inf).amax(1)
    z.scatter_(1, t[:, None], (others + margin)[:, None])
    z = z.to(dtype)
    ref = flce.reference.logits_cross_entropy(z.double(), t).item()
    # (a non-leaf, as the timed steps' in-place logits)
    got = f(z.to(device).requires_grad_().clone(), t.to(device)).item()
    return abs(got - ref) / ref


def measure_ce(spec):
    """One implementation of CE_IMPLS at one shape, every repeat on the same logits;
    flce_inplace's on a clone of the leaf made outside the timed region (flce refuses a leaf),
    as a model's logits are an op's output. Memory: the peak above the logits and targets, the
    gradient included."""
    name, device = spec["impl"], spec["device"]
    dtype = DTYPES[spec["dtype"]]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    f = make_ce_impl(name)
    x, t = logits_batch(spec["n"], spec["v"], dtype, device)
    x.requires_grad_()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def logits():
        """The step's logits: the leaf, or for the in-place path a non-leaf copy of it."""
        x.grad = None
        z = x.clone() if name == "flce_inplace" else x
        sync()
        return z

    def step(z):
        start = time.perf_counter()
        loss = f(z, t)
        loss.backward()
        sync()
        return time.perf_counter() - start, loss

    for _ in range(spec["warmup"]):
        step(logits())
    times = [step(logits())[0] for _ in range(spec["repeats"])]
    z = logits()
    from flce.check import Peak  # (a peer's process loads flce only here, where it measures)

    with Peak(device) as mem:
        _, loss = step(z)
    del z
    return {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
            "ms_max": 1e3 * max(times), "repeats": len(times), "peak_gib": mem.bytes / 2 ** 30,
            "loss": float(loss.detach()),
            # 1.0 for a peer that collapses to 0
            "margin40_rel_err": logits_margin_error(f, dtype, device)}


# ---- one measurement (runs in the child) ---------------------------------------------------------

def measure(spec):
    """Time, peak memory and accuracy of one implementation at one shape; returns a dict
    (``spec["op"] == "cross_entropy"``: measure_ce's)."""
    if spec.get("op") == "cross_entropy":
        return measure_ce(spec)
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


def run_child(spec, timeout=None):
    """Run this file's :func:`measure` for ``spec`` in a fresh interpreter; returns its dict, or
    one with an ``error`` key when the child fails. ``spec["isa"] == "avx2"`` emulates an
    AVX2-only CPU in the child (EMULATE_AVX2)."""
    cmd = [sys.executable, os.path.abspath(__file__), json.dumps(spec)]
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
