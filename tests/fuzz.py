"""Differential fuzzer of flce against float64, with a first-order error bound per element.

Each case is drawn from a seed: the entry point (``linear_cross_entropy`` or ``cross_entropy``),
sizes with tails, dtype and master weights, bias, class weights (a tenth of the class-target
cases: with label smoothing in fp32 over a wide vocabulary, some of them with every present
target's weight 0, whose "mean" is NaN as torch's), ignored rows, reduction, label
smoothing, z-loss, softcap, temperature, lse / entropy outputs, single_pass, exact_bf16_grad,
confident rows (large target margins) and dominant non-target classes, leading dimensions,
strided and transposed views of every tensor, and the backend: "cpu", or "cuda-host" (the CUDA
backend's binding and kernels under the host emulation, tests/cuda_emulation.py; class weights
with label smoothing and probability targets there half the time on the opt-in soft ops,
FLCE_CUDA_OPT_IN=distributions). A case in ``SOFT_FRACTION`` has probability targets instead of
class ids (``soft``): dense (a softmax of random logits), sharp (an fp32 softmax at a large
inverse temperature: mostly exact zeros, some subnormals), one-hot or sparse (exact zeros), each
centred on the class the confident rows favour, in fp32, bf16 or fp16, a quarter of them
requiring grad (the composite path; their gradient is compared too); these draws come from
streams of their own, so that a seed's other draws stay as they were.
flce's loss, lse, entropy and every gradient are compared with ``flce.reference`` in float64
(``soft_cross_entropy`` for probability targets), each element held to ``FACTOR`` times a
first-order bound of an ideal implementation at the same precision (``bounds``):

- logits: an fp32 GEMM of the inputs as flce computes with them, pairwise-summed, exact
  products: ``|du_j| <= ceil(log2 2D) 2^-24 (sum_k |x_k w_jk| + |b_j|)``; the softcap and the
  temperature add a few ``2^-24 |z_j|`` (and ``2^-24 cap``: tanh's absolute error); the row's
  statistics (``lse_x = m + log s``) ``2^-24 (max_j |z_j| + log2 2V)``.
- loss, lse, entropy: ``sum_j |d out / d z_j| dz_j`` plus a few ulps of the terms each formula
  adds (a label-smoothed loss: of ``lse`` and ``mean_j z_j`` too; the entropy: of ``q = 1 - p_t``,
  the bound docs/numerics.md states for the fused kernels). Probability targets: the
  collapse-safe ``Y softplus(lse_x - z_a) + sum_c y_c (z_a - z_c)`` from the row's largest
  logit ``a`` (the pivot) is a sum of terms >= 0, held to ``(8 + log2 2V)`` ulps of itself, plus
  ``lse_x``'s rounding times ``Y q_a``; the lse and entropy are the class formulas' with target
  ``a``.
- gradient tile ``d loss / d u`` (after the softcap's and temperature's chain rule): its own
  first-order error through the softmax, ``(dz_j + mean_k dz_k) (|g_j| + c p_j)``, plus its
  rounding: to the compute dtype where the backend's GEMMs take it in 16 bits (the CUDA
  backend, and the CPU backend's bf16 tiles where it rounds them once; the target entry kept in
  fp32), else fp32; an fp16 tile's power-of-two scale comes
  from an a-priori bound of the rows' gradients, and what its subnormals cannot hold is lost.
  Target distributions (probability targets; class weights with label smoothing on the fused
  soft ops): the fused ops and the composite path form the pivot's entry as every column's
  ``A p_a - g y_a`` while ``p_a <= 1/2`` and in the collapse-safe form beyond, a few roundings
  of the smaller set of terms (and the weights' accumulation times ``p_a``); the CUDA soft ops
  keep the pivot's entry in fp32, not the class target's, and round the rest; the CPU's soft
  ops and the composite path (targets that require grad) keep fp32 tiles.
- d target (probability targets that require grad): ``|g| (1 - eps) w_c`` times the error of
  ``-log p_c = nll_a + (z_a - z_c)`` (``sum_{j != c} p_j dz_j + q_c dz_c``, ``lse_x``'s rounding
  times ``q_a``, a few ulps) and of the z-loss's ``lse^2``, then one rounding to the targets'
  dtype.
- dE, dW, d bias: the tile's errors times ``|W|``, ``|X|`` or 1, summed (every term's sign
  against us), a pairwise fp32 accumulation of ``|g| |W|`` (``|g| |X|``), and one rounding to
  the gradient's dtype.

A case in ``DISTILL_FRACTION`` (the "cpu" backend; a stream of its own) is
``flce.linear_distillation`` instead (``entry="distill"``): a divergence and beta, hard and soft
weights, temperature, a teacher of another hidden size, the teacher's gradients or none, and
with ``confident`` a class both models' biases raise (the same class or two different ones).
Its per-token losses and every gradient are compared with ``flce.reference.distillation`` in
float64, held to ``FACTOR`` times a first-order bound (``_distill_bounds``): the logits' GEMM
error as above (both models, divided by the temperature) through the float64 logit gradient,
plus 4 ulps of the terms the collapse-safe row math sums (``P_j`` times the magnitude of each
log-probability taken from its row's largest logit); the logit gradient's
own error is that of its probabilities at the same scale, carried by ``|W|`` and ``|X|`` into
dE, dW and the bias as above, then one rounding to the gradient's dtype.

A failing case shrinks itself (options off, sizes halved, layouts made plain, while it still
fails) and prints a repro. The suite runs a short seeded run (tests/api/test_fuzz.py); a long one:

    python tests/fuzz.py --minutes 15 --backend cpu          # or cuda-host; --seed to vary
    python tests/fuzz.py --minutes 5 --soft-fraction 1       # probability targets only

(run from the repository with flce installed; it exits 1 on a failure, after printing it).
"""
import argparse
import dataclasses
import math
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flce  # noqa: E402

FACTOR = 4.0
U32 = 2.0 ** -24
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Half the spacing of each dtype's subnormals: the absolute error of rounding a tiny value.
TINY = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
# fp32's smallest normal: exp() of an fp32 exponent underflows below it (to 0 past ~2^-149), so an
# fp32 implementation's per-logit quantities (p_j, the collapse-safe q) carry this much absolute
# error where float64 goes on.
FLT_MIN = 2.0 ** -126
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SOFT_KINDS = ["dense", "sharp", "onehot", "sparse"]
SOFT_FRACTION = 0.3  # of the cases: probability targets
PIVOT_FRACTION = 0.1  # of the others: class weights with label smoothing at the pivot (draw)
DISTILL_FRACTION = 0.15  # of the "cpu" cases: flce.linear_distillation (draw)
DIVERGENCES = [("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9), ("jsd", 0.0), ("jsd", 1.0),
               ("forward_kl", 0.5), ("reverse_kl", 0.5)]


@dataclasses.dataclass
class Case:
    seed: int
    backend: str = "cpu"          # "cpu" | "cuda-host"
    entry: str = "linear"         # "linear" (linear_cross_entropy) | "logits" (cross_entropy)
    lead: tuple = (8,)            # the target's shape
    v: int = 50
    d: int = 16                   # linear only
    dtype: str = "fp32"
    master: bool = False          # linear, 16-bit: fp32 weight (master weights)
    bias: bool = False            # linear
    class_weight: bool = False
    ignore: float = 0.0           # fraction of ignored rows
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0          # 0: none
    temperature: float = 1.0
    lse: bool = False
    entropy: bool = False
    single_pass: object = None    # linear: None | True | False
    exact_bf16_grad: object = None  # linear: None | True | False
    confident: float = 0.0        # a margin added to some classes' logits (0: none)
    scale: float = 1.0            # logit spread
    x_layout: str = "plain"       # plain | strided | transposed
    w_layout: str = "plain"       # plain | strided | transposed | rows
    t_layout: str = "plain"       # plain | strided
    class_dim: int = 0            # logits: extra spatial dims (N, C, d1, ...)
    cuda_distributions: bool = False  # cuda-host: FLCE_CUDA_OPT_IN=distributions (class weights with
                                      # label smoothing, probability targets: the CUDA soft ops,
                                      # not the composite)
    soft: str = ""                # probability targets: "" (class ids) | dense | sharp | onehot
                                  # | sparse
    soft_dtype: str = "fp32"      # the probability targets' dtype
    soft_grad: bool = False       # the probability targets require grad (the composite path)
    zero_weights: bool = False    # class targets: class weight 0 at every present target (the
                                  # weighted mean is 0/0 = NaN, its gradients too, as torch's)
    divergence: str = "jsd"       # distill: "jsd" | "forward_kl" | "reverse_kl"
    beta: float = 0.5             # distill, "jsd"
    hard_weight: float = 0.0      # distill
    soft_weight: float = 1.0      # distill
    d_teacher: int = 0            # distill: the teacher's hidden size (0: d)
    teacher_grad: bool = False    # distill: the teacher's tensors require grad
    same_class: bool = True       # distill with confident: both models favour one class

    def code(self):
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if getattr(self, f.name) != f.default or f.name == "seed")
        return f"Case({fields})"


def draw(rng, backend):
    """A random case for ``backend`` (rng: random.Random)."""
    small = backend == "cuda-host"  # the emulation runs every CUDA thread as a fiber
    c = Case(seed=rng.randrange(2 ** 31), backend=backend)
    c.entry = rng.choice(["linear", "linear", "logits"])
    n = rng.choice([0, 1, 2, 3, 7, 16, 31, 33, 64] if not small else [0, 1, 3, 9, 17, 32])
    c.lead = (n,) if rng.random() < 0.8 else (rng.choice([1, 2, 3]), n)
    c.v = rng.choice([1, 2, 3, 17, 64, 100, 129, 257, 400] if not small else
                     [1, 2, 5, 33, 64, 129, 200])
    c.d = rng.choice([1, 3, 8, 16, 24, 40, 64] if not small else [1, 4, 8, 16, 24, 40])
    c.dtype = rng.choice(list(DTYPES))
    c.master = c.dtype != "fp32" and rng.random() < 0.3
    c.bias = rng.random() < 0.4
    c.class_weight = rng.random() < 0.3
    c.ignore = rng.choice([0.0, 0.0, 0.2, 1.0])
    c.reduction = rng.choice(["mean", "sum", "none"])
    c.label_smoothing = rng.choice([0.0, 0.0, 0.1, 0.5])
    c.z_loss = rng.choice([0.0, 0.0, 1e-3, 0.1])
    c.softcap = rng.choice([0.0, 0.0, 3.0, 30.0])
    c.temperature = rng.choice([1.0, 1.0, 0.5, 1.7])
    c.lse = rng.random() < 0.3
    c.entropy = rng.random() < 0.3
    if c.entry == "linear":
        c.single_pass = rng.choice([None, True, False])
        if c.single_pass and (c.reduction == "none" or c.lse or c.entropy):
            c.single_pass = None
    c.confident = rng.choice([0.0, 0.0, 20.0, 60.0, 150.0])
    c.scale = rng.choice([0.5, 1.0, 4.0])
    c.x_layout = rng.choice(["plain", "plain", "strided", "transposed"])
    c.w_layout = rng.choice(["plain", "plain", "strided", "transposed", "rows"])
    c.t_layout = rng.choice(["plain", "strided"])
    c.class_dim = rng.choice([0, 0, 0, 1]) if c.entry == "logits" and len(c.lead) == 1 else 0
    if c.entry == "linear" and not (backend == "cuda-host" and c.dtype == "bf16"):
        # From its own stream, so that the cases drawn after this one stay as they were. (The
        # CUDA backend refuses True for bf16: tests/api/test_bf16_grad.py.)
        c.exact_bf16_grad = random.Random(c.seed).choice([None, True, False])
    s = random.Random(f"soft-{c.seed}")  # (probability targets: a stream of their own too)
    if s.random() < SOFT_FRACTION:
        c.soft = s.choice(SOFT_KINDS)
        c.soft_dtype = s.choice(list(DTYPES))
        c.soft_grad = s.random() < 0.25
        c.ignore = 0.0  # (no ignore_index for probability targets)
    p = random.Random(f"pivot-{c.seed}")  # (its own stream too)
    if not c.soft and p.random() < PIVOT_FRACTION:
        # Class weights with label smoothing in fp32 over a wide vocabulary, no confident rows:
        # each row's largest logit is (mostly) not its target, where a target distribution's
        # pivot entry once cancelled to 1e-4 relative (issue 51).
        c.class_weight, c.label_smoothing = True, p.choice([0.1, 0.5])
        c.dtype, c.master, c.confident = "fp32", False, 0.0
        c.v = p.choice([1000, 4000] if not small else [400, 1000])
        # (without lse / entropy, whose upstream gradients would be finite beside the NaN)
        if c.reduction == "mean" and not (c.lse or c.entropy) and p.random() < 0.2:
            c.zero_weights = True
    if backend == "cuda-host" and (c.soft or c.class_weight and c.label_smoothing):
        c.cuda_distributions = random.Random(c.seed + 1).random() < 0.5  # (its own stream too)
    k = random.Random(f"distill-{c.seed}")  # (its own stream too)
    if backend == "cpu" and k.random() < DISTILL_FRACTION:
        # (plain torch ops on every device: the CUDA backend's emulation has nothing to add)
        c = dataclasses.replace(
            c, entry="distill", soft="", class_weight=False, label_smoothing=0.0, z_loss=0.0,
            softcap=0.0, lse=False, entropy=False, single_pass=None, exact_bf16_grad=None,
            class_dim=0, zero_weights=False, soft_grad=False, soft_dtype="fp32",
            cuda_distributions=False, ignore=k.choice([0.0, 0.0, 0.2, 1.0]))
        c.divergence, c.beta = k.choice(DIVERGENCES)
        c.hard_weight = k.choice([0.0, 0.0, 0.5, 1.0])
        c.soft_weight = k.choice([1.0, 1.0, 0.5, 2.0])
        c.d_teacher = k.choice([0, 0, 8, 40])
        c.teacher_grad = k.random() < 0.3
        c.same_class = k.random() < 0.5
    return c


def _filler(shape, dtype):
    return torch.full(shape, math.nan if dtype.is_floating_point else -7, dtype=dtype)


def _view(a, layout):
    """``a``'s values in ``layout``: a view whose strides a kernel would misread if it assumed
    them (a column-strided slice of wider storage, D-major storage, or every other row)."""
    # The storage a view skips holds NaN (floats) or an invalid class (targets): an element read
    # from the wrong place shows up.
    if layout == "strided":
        wide = _filler(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]
    if layout == "transposed" and a.dim() >= 2:
        return a.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "rows" and a.dim() >= 2:
        tall = _filler((2 * a.shape[0],) + a.shape[1:], a.dtype)
        tall[::2] = a
        return tall[::2]
    return a


def make_inputs(c):
    """The case's tensors (values first, then their layouts): dict of name -> tensor."""
    if c.entry == "distill":
        return _distill_inputs(c)
    g = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    n = math.prod(c.lead)
    t = torch.randint(0, c.v, c.lead, generator=g)
    if c.ignore:
        t = torch.where(torch.rand(c.lead, generator=g) < c.ignore, torch.full_like(t, -100), t)
    out = {}
    # Confident rows (target margin ~confident) and rows where a non-target class dominates:
    # for the linear entry one class raised by the bias, half the rows' targets moved to it;
    # for given logits, half the rows' target raised, the other half's a random other class.
    boost = torch.zeros(c.v, dtype=torch.float64)
    row_boost = torch.zeros(n, c.v, dtype=torch.float64)
    if c.confident:
        half = torch.rand(c.lead, generator=g) < 0.5
        if c.entry == "linear":
            top = int(torch.randint(0, c.v, (1,), generator=g))
            boost[top] = c.confident
            t = torch.where(half & (t != -100), torch.full_like(t, top), t)
        else:
            other = torch.randint(0, c.v, (n,), generator=g)
            col = torch.where(half.reshape(-1), t.reshape(-1).clamp_min(0), other)
            row_boost[torch.arange(n), col] = c.confident
    out["target"] = t
    if c.soft:
        # [..., V], class-last; the column-strided view before any move of the class dimension
        out["target"] = _view(_soft_target(c, t).reshape(c.lead + (c.v,)), c.t_layout)
    if c.entry == "linear":
        x = torch.randn(c.lead + (c.d,), generator=g, dtype=torch.float64) * c.scale / c.d ** 0.25
        w = torch.randn((c.v, c.d), generator=g, dtype=torch.float64) / c.d ** 0.25
        wdt = torch.float32 if c.master else dt
        out["input"] = x.to(dt)
        out["weight"] = w.to(wdt)
        if c.bias or c.confident:
            b = torch.randn(c.v, generator=g, dtype=torch.float64) * 0.5 + boost
            out["bias"] = b.to(wdt)
        out["input"] = _view(out["input"], c.x_layout)
        out["weight"] = _view(out["weight"], c.w_layout)
        if "bias" in out:
            out["bias"] = _view(out["bias"], "strided" if c.w_layout == "strided" else "plain")
    else:
        z = torch.randn((n, c.v), generator=g, dtype=torch.float64) * c.scale + row_boost
        logits = z.to(dt).reshape(c.lead + (c.v,))
        logits = _view(logits, c.x_layout)
        if c.class_dim and len(c.lead) == 1:
            # (N, C, d1): torch's class dimension 1, targets (N, d1) (probabilities: like the
            # logits)
            logits = logits.reshape(1, c.lead[0], c.v).permute(0, 2, 1)
            out["target"] = out["target"].reshape(1, c.lead[0], c.v).permute(0, 2, 1) \
                if c.soft else t.reshape(1, c.lead[0])
        elif len(c.lead) == 2:
            logits = logits.movedim(-1, 1)  # (N, C, d1)
            if c.soft:
                out["target"] = out["target"].movedim(-1, 1)
        out["input"] = logits
    if c.class_weight:
        out["class_weight"] = (torch.rand(c.v, generator=g, dtype=torch.float64) + 0.25).float()
        if c.zero_weights and not c.soft:
            out["class_weight"][t[t != -100]] = 0.0
    if not c.soft:
        out["target"] = _view(out["target"], c.t_layout)
    return out


def _soft_target(c, t):
    """Probability targets [rows, V] in the case's target dtype (values exact in float64 after
    it), centred on the class ids ``t`` (which the confident rows' logits favour): "dense" a
    softmax of random logits, "sharp" an fp32 softmax at a large inverse temperature (most
    entries exactly 0 there, some subnormal), "onehot" the class, "sparse" the class and a few
    others with random weights, the rest exactly 0."""
    g = torch.Generator().manual_seed(c.seed + 3)
    n, v = math.prod(c.lead), c.v
    onehot = torch.zeros(n, v, dtype=torch.float64)
    onehot[torch.arange(n), t.reshape(-1).clamp_min(0)] = 1.0
    if c.soft == "dense":
        y = torch.softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 2 + 3 * onehot, 1)
    elif c.soft == "sharp":
        r = torch.randn(n, v, generator=g, dtype=torch.float64) + 2 * onehot
        y = torch.softmax((r * 40).float(), 1).double()
    elif c.soft == "onehot":
        y = onehot
    else:
        keep = (onehot > 0) | (torch.rand(n, v, generator=g, dtype=torch.float64) < 3.0 / v)
        y = torch.where(keep, torch.rand(n, v, generator=g, dtype=torch.float64) + 0.05, 0.0)
        y = y / y.sum(1, keepdim=True)
    return y.to(DTYPES[c.soft_dtype])


def _options(c):
    return dict(reduction=c.reduction, label_smoothing=c.label_smoothing, z_loss=c.z_loss,
                softcap=c.softcap or None, temperature=c.temperature)


def _upstreams(c, shape):
    g = torch.Generator().manual_seed(c.seed + 1)
    return {"loss": torch.rand(shape, generator=g, dtype=torch.float64) + 0.5,
            "lse": torch.rand(shape, generator=g, dtype=torch.float64) - 0.5,
            "entropy": torch.rand(shape, generator=g, dtype=torch.float64) - 0.5}


def _row_shape(c, inputs):
    """The shape of the per-row outputs (the class targets', or the probabilities' without V)."""
    if not c.soft:
        return inputs["target"].shape
    if c.entry == "linear":
        return inputs["target"].shape[:-1]
    shape = inputs["input"].shape
    return shape[:1] + shape[2:]


def run_flce(c, inputs):
    """flce's outputs and gradients: dict name -> float64 tensor (CPU), row-major [rows, ...]."""
    if c.entry == "distill":
        return _run_distill(c, inputs)
    grads = ("input", "weight", "bias") + (("target",) if c.soft_grad else ())
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items() if k in grads}
    target = leaves.get("target", inputs["target"])
    opts = _options(c)
    if c.entry == "linear":
        res = flce.linear_cross_entropy(leaves["input"], leaves["weight"], target,
                                        bias=leaves.get("bias"), return_lse=c.lse,
                                        return_entropy=c.entropy, single_pass=c.single_pass,
                                        exact_bf16_grad=c.exact_bf16_grad,
                                        class_weight=inputs.get("class_weight"), **opts)
    else:
        res = flce.cross_entropy(leaves["input"], target,
                                 weight=inputs.get("class_weight"), return_lse=c.lse,
                                 return_entropy=c.entropy, **opts)
    res = list(res) if (c.lse or c.entropy) else [res]
    outs = {"loss": res.pop(0)}
    if c.lse:
        outs["lse"] = res.pop(0)
    if c.entropy:
        outs["entropy"] = res.pop(0)
    up = _upstreams(c, _row_shape(c, inputs))
    total = 0.0
    for k, o in outs.items():
        assert o.dtype == torch.float32, (k, o.dtype)
        w = up[k] if (k != "loss" or c.reduction == "none") else torch.tensor(1.0)
        total = total + (o * w.float()).sum()
    total.backward()
    got = {k: o.detach().double().reshape(-1) for k, o in outs.items()}
    for k, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, k
        got["d" + k] = leaf.grad.double()
    return got


def _class_last(c, inputs):
    """The logits' values as flce computes with them, float64 [rows, V], and targets [rows]
    (probabilities: [rows, V] float64)."""
    t = inputs["target"].reshape(-1)
    if c.soft:
        t = inputs["target"].detach()
        t = (t.reshape(-1, c.v) if c.entry == "linear" or t.dim() == 1 else
             t.movedim(1, -1).reshape(-1, c.v)).double()
    if c.entry == "linear":
        x = inputs["input"].double().reshape(-1, c.d)
        w = inputs["weight"].to(DTYPES[c.dtype]).double()
        b = inputs["bias"].to(DTYPES[c.dtype] if not c.master else torch.float32).double() \
            if "bias" in inputs else None
        return x, w, b, t
    z = inputs["input"]
    z = z.reshape(1, -1) if z.dim() == 1 else z.movedim(1, -1).reshape(-1, c.v)
    return z.double(), None, None, t


def reference_and_bounds(c, inputs):
    """float64 reference outputs and gradients and their element-wise first-order bounds."""
    x, w, b, t = _class_last(c, inputs)
    dt = DTYPES[c.dtype]
    rows, v = t.shape[0], c.v
    if c.entry == "linear":
        u = x @ w.T + (b if b is not None else 0.0)
        mag = x.abs() @ w.abs().T + (b.abs() if b is not None else 0.0)
        du = math.ceil(math.log2(2 * c.d)) * U32 * mag
    else:
        u = x.clone()
        du = torch.zeros_like(u)
    u = u.detach().requires_grad_()
    # transforms, with their derivative and its own first-order error
    z, dz = u, du.clone()
    chain = torch.ones_like(u)  # dz/du
    if c.softcap:
        z = c.softcap * torch.tanh(u / c.softcap)
        chain = 1 - (z.detach() / c.softcap) ** 2
        dz = dz * chain + U32 * (3 * z.detach().abs() + 2 * c.softcap)
    if c.temperature != 1.0:
        z = z / c.temperature
        chain = chain / c.temperature
        dz = dz / c.temperature + U32 * 2 * z.detach().abs()
    zmax = z.detach().abs().amax(1, keepdim=True) if v else torch.zeros(rows, 1)
    # the row statistics' own rounding (lse_x = m + log s), as if every logit carried it
    stat = U32 * (zmax + math.log2(2 * max(v, 1)) + 4)
    dz = dz.detach() + stat
    zz = z.detach().requires_grad_()
    cw = inputs.get("class_weight")
    cw = None if cw is None else cw.double()
    if c.soft:
        # Probability targets: flce.reference's collapse-safe soft formula, every -log p_c
        # taken from the row's largest logit a (the pivot), whose class-index formulas give the
        # lse and entropy; below, the pivot stands in for the class target (t_key).
        y = t.detach().requires_grad_(c.soft_grad)
        loss, lse, ent = flce.reference.soft_cross_entropy(
            zz, y, reduction="none", label_smoothing=c.label_smoothing, z_loss=c.z_loss,
            weight=cw)
        t_key = zz.detach().argmax(1) if v else torch.zeros(rows, dtype=torch.int64)
        valid = torch.ones(rows, dtype=torch.bool)
        # the target weights as the loss takes them, y'_c = w_c ((1 - eps) y_c + eps / V)
        y_eff = ((1 - c.label_smoothing) * y.detach() + c.label_smoothing / max(v, 1)) * \
            (cw if cw is not None else 1.0)
    else:
        loss, lse, ent = flce.reference.logits_cross_entropy(
            zz, t, reduction="none", label_smoothing=c.label_smoothing, z_loss=c.z_loss,
            return_lse=True, return_entropy=True, weight=cw)
        t_key = t
        valid = t != -100
    # first-order sensitivity of each per-row output to its row's logits
    def sens(o):
        (gz,) = torch.autograd.grad(o.sum(), zz, retain_graph=True, allow_unused=True)
        return gz if gz is not None else torch.zeros_like(zz)
    p = torch.softmax(zz.detach(), 1) if v else zz.detach()
    # q: the mass off the target (probability targets: off the pivot)
    q = torch.where(valid, 1 - p.gather(1, torch.where(valid, t_key, 0)[:, None])[:, 0], 1.0) \
        if v else torch.ones(rows, dtype=torch.float64)
    if c.soft and v:
        q = p.scatter(1, t_key[:, None], 0.0).sum(1)  # (1 - p_a is 0 in float64 past margin 37)
    lv = lse.detach()
    mean_abs_z = zz.detach().abs().mean(1) if v else torch.zeros(rows)
    ref, bound = {}, {}
    s_loss = sens(loss)
    if c.soft:
        # wrow: the row's target mass Y = sum_c y'_c (the z-loss's weight). The loss
        # Y softplus(lse_x - z_a) + sum_c y'_c (z_a - z_c) + z_loss Y lse^2 is a sum of terms
        # >= 0: each y'_c (two or three roundings), gap and product a few ulps, their sum
        # pairwise; and lse_x's own rounding (stat) enters softplus with weight Y q_a, which
        # the logits' sensitivity need not cover (a target near softmax(z) has dL/dz ~ 0).
        wrow = y_eff.sum(1) if v else torch.zeros(rows, dtype=torch.float64)
        terms = loss.detach().abs() + c.z_loss * wrow * lv ** 2
        b_loss = (s_loss.abs() * dz).sum(1) + wrow * q * stat[:, 0] + \
            (8 + math.log2(2 * max(v, 1))) * U32 * terms + 4 * FLT_MIN * (1 + wrow)
    else:
        wrow = torch.ones(rows, dtype=torch.float64) if cw is None else \
            torch.where(valid, cw[torch.where(valid, t, 0)], 0.0)
        terms = ((1 - c.label_smoothing) * loss.detach().abs() +
                 c.label_smoothing * (cw.sum() / v if cw is not None else 1.0) *
                 (lv.abs() + math.log2(2 * max(v, 1)) * mean_abs_z) + c.z_loss * wrow * lv ** 2)
        b_loss = (s_loss.abs() * dz).sum(1) + 8 * U32 * terms + 4 * FLT_MIN
        b_loss = torch.where(valid, b_loss, 0.0)
    ref["lse"], bound["lse"] = lv, (sens(lse).abs() * dz).sum(1) + 8 * U32 * lv.abs() + FLT_MIN
    ent_d = ent.detach()
    bound["entropy"] = (sens(ent).abs() * dz).sum(1) + 8 * U32 * (
        ent_d.abs() + q * (math.log2(2 * max(v, 1)) + 2)) + \
        4 * FLT_MIN * (2 + 2 * zmax[:, 0])  # q underflowing, times softplus(z_t - lse_x)
    ref["entropy"] = ent_d
    up = _upstreams(c, _row_shape(c, inputs))
    # (probability targets: "mean" over every row, class weights or not)
    count = float(rows) if c.soft else wrow.sum() if cw is not None else valid.sum().double()
    if c.reduction == "none":
        ref["loss"], bound["loss"] = loss.detach(), b_loss
        g_loss = up["loss"].reshape(-1)
    else:
        # (the mean of no token: a NaN loss and zero gradients)
        scale = 1.0 if c.reduction == "sum" else (1.0 / count if count > 0 else 0.0)
        tot = loss.detach().sum() * scale
        ref["loss"] = tot.reshape(1)
        acc = math.log2(2 * max(rows, 1)) * U32 * loss.detach().abs().sum()
        bound["loss"] = ((b_loss.sum() + acc) * abs(scale)).reshape(1)
        g_loss = torch.full((rows,), float(scale), dtype=torch.float64)
    if not c.lse:
        ref.pop("lse"), bound.pop("lse")
    if not c.entropy:
        ref.pop("entropy"), bound.pop("entropy")
    # the gradient tile dL/dz, its first-order error, then the chain rule to u
    obj = (loss * g_loss).sum()
    g_lse = up["lse"].reshape(-1) if c.lse else torch.zeros(rows, dtype=torch.float64)
    g_ent = up["entropy"].reshape(-1) if c.entropy else torch.zeros(rows, dtype=torch.float64)
    obj = obj + (lse * g_lse).sum() + (ent * g_ent).sum()
    (gz, gy) = torch.autograd.grad(obj, [zz] + ([y] if c.soft_grad else []),
                                   allow_unused=True) + ((None,) if not c.soft_grad else ())
    gz = torch.zeros_like(zz) if gz is None else gz
    logp = torch.log(p.clamp_min(1e-300))
    # |A|, the coefficient of p_j in dz_j (probability targets: smoothing is in y', and
    # A = g (Y + 2 z_loss Y lse) + g_lse; math.h soft_row_grad)
    coef = (g_loss.abs() * wrow * (1 + 2 * c.z_loss * (lv.abs() + 1)) + g_lse.abs() +
            (0.0 if c.soft else g_loss.abs() * c.label_smoothing *
             (cw.sum() if cw is not None else v) / max(v, 1)))
    env = gz.abs() + p * (coef[:, None] + g_ent.abs()[:, None] * (2 + logp.abs() +
                                                                  ent_d[:, None]))
    # d(dz_j) = dz_j-ish * (du_j - sum_k p_k du_k) through the softmax: at most env_j (du_j + the
    # p-weighted mean of du; the target's collapse-safe -q: the non-target-weighted mean)
    if v:
        rest = p.scatter(1, torch.where(valid, t_key, 0)[:, None], 0.0) / \
            q.clamp_min(1e-300)[:, None]
        mean_dz = torch.maximum((p * dz).sum(1), (rest * dz).sum(1))[:, None]
        err_gz = env * (dz + mean_dz)
    else:
        err_gz = env
    gu = gz * chain
    # (the chain rule as computed: a saturated tanh rounds to 1 - 2^-24 as well as to 1, so
    # softcap' carries ~2 2^-24 of absolute error, which multiplies the tile's own error even
    # where the exact softcap' underflows to 0)
    chain_up = chain + (4 * U32 / c.temperature if c.softcap else 0.0)
    err_gu = chain_up * (err_gz + 4 * FLT_MIN * (coef + g_ent.abs())[:, None]) + \
        4 * U32 * gu.abs()
    if c.softcap:
        # d(dz/du) = 2 |z T| / cap^2 / T dz
        err_gu = err_gu + gz.abs() * 2 * (z.detach() * c.temperature).abs() / c.softcap ** 2 \
            / c.temperature * dz
    # Where float64's largest two logits are within their errors of each other, either can be
    # the row's pivot (its largest fp32 logit): a target distribution's collapse-safe entry.
    zd = zz.detach()
    if v:
        ra, piv = torch.arange(rows), zd.argmax(1)
        near = zd >= (zd[ra, piv] - dz[ra, piv])[:, None] - dz
    # Target distributions on the fused soft ops (flce::soft_*: probability targets, and class
    # targets with class weights and label smoothing, on the CPU and with
    # FLCE_CUDA_OPT_IN=distributions; not for targets that require grad) or, for probability targets,
    # the composite path.
    fused_dist = (c.backend == "cpu" or c.cuda_distributions) and (
        not c.soft_grad if c.soft else bool(c.class_weight and c.label_smoothing))
    if v and (c.soft or fused_dist):
        # The pivot's entry: g (A p_a - y'_a), every column's form, while p_a <= 1/2, and
        # (A - g Y) p_a - g Y q_a + g y_rest beyond, on the fused ops (math.h soft_row_grad) and
        # the composite path (flce.reference soft_cross_entropy's two forms) alike: a few ulps
        # of the smaller set of terms; y_rest, a sum of V weights, leaves its accumulation
        # error times p_a.
        if c.soft:
            y_w = y_eff
        else:  # y'_c = w_c ((1 - eps) [c = t] + eps / V), none for an ignored row
            onehot = torch.zeros_like(zd).scatter(1, torch.where(valid, t, 0)[:, None], 1.0)
            y_w = torch.where(valid[:, None], (cw if cw is not None else 1.0) * (
                (1 - c.label_smoothing) * onehot + c.label_smoothing / v), 0.0)
        y_mass = y_w.sum(1, keepdim=True)
        g_abs = g_loss.abs()[:, None]
        y_rest = y_mass - y_w
        lg = math.log2(2 * v)
        terms = torch.where(p <= 0.5, y_mass * p + y_w, y_mass * (1 - p) + y_rest)
        piv_err = U32 * g_abs * (6 * terms + (3 + lg) * p * y_rest)
        err_gu = err_gu + torch.where(near, chain_up * piv_err, 0.0)
    # the tile's rounding: the CUDA backend's 16-bit GEMMs take it in the compute dtype (its
    # target entry kept in fp32), as the CPU's bf16 GEMMs do where they round it once
    # (csrc/cpu/tile_gemm.h bf16_grad); the CPU's other modes are fp32-exact. Probability
    # targets: the CPU's soft ops keep exact 16-bit gradients (fp32 GEMMs), the composite path
    # (targets that require grad; the CUDA backend without FLCE_CUDA_OPT_IN=distributions) has fp32
    # GEMMs; only the CUDA soft ops round the tile.
    fused_cuda = c.backend != "cpu" and (c.soft and c.cuda_distributions and not c.soft_grad
                                         or not c.soft)
    distribution = c.backend != "cpu" and c.cuda_distributions and (
        not c.soft_grad if c.soft else c.class_weight and c.label_smoothing)
    if c.soft:
        rounded = dt != torch.float32 and fused_cuda
    else:
        rounded = dt != torch.float32 and (c.backend != "cpu" or (
            c.entry == "linear" and dt == torch.bfloat16 and
            torch.ops.flce.cpu_bf16_grad(c.exact_bf16_grad) == "rounded"))
    tile_unit = UNIT[dt] if rounded else U32
    tile = tile_unit * gu.abs()
    if fused_cuda and dt == torch.float16 and gu.numel():
        # The fp16 tile holds scale * dz, the scale a power of two that puts an a-priori bound of
        # every row's |dz| (flce_grad.cu, row_coef: |a| p_max + |u| + |dz_t| + the entropy's
        # term, over T; soft_coef, a target distribution's: |u| (|y_a| + |y_rest|) = |g| Y for
        # |u|) in (2^13, 2^14]: what falls below fp16's subnormals there is lost. That bound, up
        # to a factor 2 (2^-12 below):
        own = torch.where(valid, t_key, 0)[:, None]
        p_max = p.scatter(1, own, 0.0).amax(1) if v else torch.zeros(rows)
        a_bound = (gz.abs().amax(1) + coef * p_max +
                   g_ent.abs() * (0.37 + ent_d.abs() + lv.abs())) / c.temperature
        if distribution:
            y_mass = wrow if c.soft else (1 - c.label_smoothing) * wrow + \
                c.label_smoothing * (cw.sum() if cw is not None else v) / max(v, 1)
            a_bound = a_bound + g_loss.abs() * y_mass / c.temperature
        tile = tile + TINY[dt] * 2.0 ** -12 * a_bound.max()
    if rounded and v and distribution:
        # The CUDA soft ops (a target distribution) keep their pivot's entry in fp32: each row's
        # largest fp32 logit (docs/cuda.md "Target distributions"), not the class target's.
        # Where float64's largest two are within their logits' errors of each other, either
        # can be the pivot, and both keep their 16-bit rounding in the bound.
        sure = near.sum(1) == 1
        tile[ra[sure], piv[sure]] = U32 * gu.abs()[ra[sure], piv[sure]]
    elif rounded and v:
        own = valid.nonzero()[:, 0]
        tile[own, t[own]] = U32 * gu.abs()[own, t[own]]
    err_gu = (err_gu + tile).detach()
    gu = gu.detach()
    if c.entry == "linear":
        out_unit = UNIT[dt]
        w_unit = U32 if c.master else UNIT[dt]
        w_tiny = TINY[torch.float32] if c.master else TINY[dt]
        acc_v = math.ceil(math.log2(2 * max(v, 1))) * U32
        acc_n = math.ceil(math.log2(2 * max(rows, 1))) * U32
        # A bf16 GEMM on hardware that multiplies bf16 natively (AVX512-BF16's VDPBF16PS, AMX's
        # TDPBF16PS) flushes subnormal products and sums to zero: each term may lose FLT_MIN
        # (seed 1123681288: a dW element of -3.5e-39, one product, came out 0).
        ftz = FLT_MIN if dt == torch.bfloat16 else 0.0
        ref["dinput"] = (gu @ w).reshape(inputs["input"].shape)
        bound["dinput"] = ((err_gu @ w.abs() + acc_v * (gu.abs() @ w.abs())) +
                           out_unit * (gu @ w).abs() + TINY[dt] + ftz * v
                           ).reshape(inputs["input"].shape)
        ref["dweight"] = gu.T @ x
        bound["dweight"] = err_gu.T @ x.abs() + acc_n * (gu.abs().T @ x.abs()) + \
            w_unit * (gu.T @ x).abs() + w_tiny + ftz * rows
        if "bias" in inputs:
            ref["dbias"] = gu.sum(0)
            bound["dbias"] = err_gu.sum(0) + acc_n * gu.abs().sum(0) + w_unit * gu.sum(0).abs() + \
                w_tiny
    else:
        shape = inputs["input"].shape
        g = gu if inputs["input"].dim() == 2 else None
        if g is None:
            if inputs["input"].dim() == 1:
                g, e = gu.reshape(shape), err_gu.reshape(shape)
            else:
                lead = (shape[0],) + tuple(shape[2:])
                g = gu.reshape(lead + (shape[1],)).movedim(-1, 1)
                e = err_gu.reshape(lead + (shape[1],)).movedim(-1, 1)
        else:
            e = err_gu
        ref["dinput"] = g
        bound["dinput"] = e + UNIT[dt] * g.abs() + TINY[dt]
    if c.soft_grad:
        # d obj / d y_c = g (1 - eps) w_c (-log p_c + z_loss lse^2) (the composite path, fp32):
        # -log p_c = nll_a + (z_a - z_c) carries sum_j |p_j - [j = c]| dz_j from the logits,
        # lse_x's rounding times q_a, a few ulps of both terms (and of the z-loss's lse^2, whose
        # lse carries the lse's bound), then one rounding to the targets' dtype.
        sdt = DTYPES[c.soft_dtype]
        # -log p_c >= 0 from the pivot (lse - z_c in float64 would cancel where p_c ~ 1)
        nll_a = flce.reference.logits_cross_entropy(zd, t_key, reduction="none") if v else lv
        nlp = (nll_a[:, None] + (zd.gather(1, t_key[:, None]) - zd)) if v else zd
        # sum_{j != c} p_j dz_j + q_c dz_c, q_c = 1 - p_c (the pivot's: q, summed, where
        # 1 - p_a would cancel)
        others = (p * dz).sum(1, keepdim=True) - p * dz
        q_c = 1 - p
        if v:
            others[ra, t_key] = (p * dz).scatter(1, t_key[:, None], 0.0).sum(1)
            q_c[ra, t_key] = q
        err_lse = (p * dz).sum(1) + 8 * U32 * lv.abs() + FLT_MIN
        err_nlp = others + q_c * dz + (q * stat[:, 0])[:, None] + 4 * U32 * nlp.abs() + \
            4 * FLT_MIN
        err_z = c.z_loss * (2 * lv.abs() * err_lse + 4 * U32 * lv ** 2)
        per = (g_loss.abs() * (1 - c.label_smoothing))[:, None] * \
            (cw if cw is not None else torch.ones(max(v, 1), dtype=torch.float64))[:v]
        gy = torch.zeros_like(zd) if gy is None else gy
        e_y = per * (err_nlp + err_z[:, None]) + 4 * U32 * gy.abs()
        shape = inputs["target"].shape
        if c.entry == "linear" or len(shape) == 2:
            ref["dtarget"] = gy.reshape(shape)
            e_y = e_y.reshape(shape)
        else:
            lead = (shape[0],) + tuple(shape[2:])
            ref["dtarget"] = gy.reshape(lead + (shape[1],)).movedim(-1, 1)
            e_y = e_y.reshape(lead + (shape[1],)).movedim(-1, 1)
        bound["dtarget"] = e_y + UNIT[sdt] * ref["dtarget"].abs() + TINY[sdt]
    ref["loss"] = ref["loss"].reshape(-1)
    return ref, bound


def _distill_inputs(c):
    """A distillation case's tensors: each model's input, weight and bias ("s_" the student's,
    "t_" the teacher's; with ``confident`` a class raised by the biases, the student's by 1 to
    1.2 times the teacher's margin, half the rows' targets moved to the student's class)."""
    g = torch.Generator().manual_seed(c.seed)
    dt = DTYPES[c.dtype]
    wdt = torch.float32 if c.master else dt
    t = torch.randint(0, c.v, c.lead, generator=g)
    if c.ignore:
        t = torch.where(torch.rand(c.lead, generator=g) < c.ignore, torch.full_like(t, -100), t)
    top = int(torch.randint(0, c.v, (1,), generator=g))
    other = top if c.same_class or c.v == 1 else (top + 1) % c.v
    if c.confident:
        half = torch.rand(c.lead, generator=g) < 0.5
        t = torch.where(half & (t != -100), torch.full_like(t, other), t)
    out = {"target": _view(t, c.t_layout)}
    for p, d, cls, margin in (("s_", c.d, other, c.confident * (1 + 0.2 * float(
            torch.rand((), generator=g, dtype=torch.float64)))),
                              ("t_", c.d_teacher or c.d, top, c.confident)):
        x = torch.randn(c.lead + (d,), generator=g, dtype=torch.float64) * c.scale / d ** 0.25
        w = torch.randn((c.v, d), generator=g, dtype=torch.float64) / d ** 0.25
        out[p + "input"] = _view(x.to(dt), c.x_layout)
        out[p + "weight"] = _view(w.to(wdt), c.w_layout)
        if c.bias or c.confident:
            b = torch.randn(c.v, generator=g, dtype=torch.float64) * 0.5
            b[cls] += margin
            out[p + "bias"] = _view(b.to(wdt), "strided" if c.w_layout == "strided" else "plain")
    return out


def _run_distill(c, inputs):
    """flce.linear_distillation's per-token losses (the reduction's result for "mean"/"sum")
    and gradients, as run_flce."""
    grads = ("s_input", "s_weight", "s_bias") + \
        (("t_input", "t_weight", "t_bias") if c.teacher_grad else ())
    leaves = {k: v.detach().requires_grad_() if k in grads else v for k, v in inputs.items()}
    loss = flce.linear_distillation(
        leaves["s_input"], leaves["s_weight"], leaves["t_input"], leaves["t_weight"],
        leaves["target"], divergence=c.divergence, beta=c.beta, temperature=c.temperature,
        hard_weight=c.hard_weight, soft_weight=c.soft_weight, reduction=c.reduction,
        student_bias=leaves.get("s_bias"), teacher_bias=leaves.get("t_bias"))
    assert loss.dtype == torch.float32, loss.dtype
    up = _upstreams(c, c.lead)["loss"] if c.reduction == "none" else torch.tensor(1.0)
    (loss * up.float()).sum().backward()
    got = {"loss": loss.detach().double().reshape(-1)}
    for k in grads:
        if k in leaves:
            leaf = leaves[k]
            assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, k
            got["d" + k] = leaf.grad.double()
    return got


def _distill_bounds(c, inputs):
    """float64 reference (flce.reference.distillation) and first-order bounds for a
    distillation case, as the module docstring states."""
    from flce import reference

    dt = DTYPES[c.dtype]
    t = inputs["target"].reshape(-1)
    n, v, temp = t.shape[0], c.v, c.temperature
    models = {}
    for p in ("s_", "t_"):
        x = inputs[p + "input"].double().reshape(n, inputs[p + "input"].shape[-1])
        w = inputs[p + "weight"].to(dt).double()
        b = inputs[p + "bias"].double() if p + "bias" in inputs else None
        z = x @ w.T + (b if b is not None else 0.0)
        mag = x.abs() @ w.abs().T + (b.abs() if b is not None else 0.0)
        dz = math.ceil(math.log2(2 * x.shape[1])) * U32 * mag + U32 * z.abs()
        models[p] = (x, w, b, z.requires_grad_(), dz)
    zs, zt = models["s_"][3], models["t_"][3]
    kw = dict(divergence=c.divergence, beta=c.beta, temperature=temp,
              hard_weight=c.hard_weight, soft_weight=c.soft_weight)
    per_token = reference.distillation(zs, zt, t, reduction="none", **kw)
    valid = t != -100
    count = max(int(valid.sum()), 1)
    up = _upstreams(c, c.lead)["loss"].reshape(-1) if c.reduction == "none" else \
        torch.full((n,), 1.0 / count if c.reduction == "mean" else 1.0, dtype=torch.float64)
    gs, gt = torch.autograd.grad((per_token * up).sum(), (zs, zt))
    with torch.no_grad():
        # each row's log-probabilities' magnitudes from their largest logit: |z_j - z_a| +
        # log1p(s), the terms the row math sums with weights P_j (and the untempered student's
        # for the hard term)
        def stats(z):
            # (P_j, or 1 - P_j where that is smaller: the collapse-safe row math forms a
            # dominant class's entries from the others' mass)
            d = z - z.amax(1, keepdim=True)
            logp = torch.log_softmax(z, 1)
            return torch.minimum(torch.exp(logp), -torch.expm1(logp)), \
                d.abs() + (-logp.amax(1, keepdim=True))

        p_s, m_s = stats(zs / temp)
        p_t, m_t = stats(zt / temp)
        p_h, m_h = stats(zs)
        units = (8 + math.log2(2 * v)) * U32
        soft = c.soft_weight * 4 * U32 * ((p_s + p_t) * (m_s + m_t)).sum(1)
        hard = c.hard_weight * 4 * U32 * (m_h.gather(1, t.clamp_min(0)[:, None])[:, 0] + 1)
        logit_err = ((gs.abs() * models["s_"][4]).sum(1) / up.abs().clamp_min(1e-300) +
                     (gt.abs() * models["t_"][4]).sum(1) / up.abs().clamp_min(1e-300))
        # (the fp32 loss: one rounding, and half its smallest subnormal below its range)
        loss_bound = torch.where(valid, soft + hard + logit_err + 2 * U32 * per_token.abs() +
                                 TINY[torch.float32], 0.0)
        ref = {}
        bound = {}
        if c.reduction == "none":
            ref["loss"], bound["loss"] = per_token.detach(), loss_bound
        else:
            scale = 1.0 / count if c.reduction == "mean" else 1.0
            ref["loss"] = (per_token.detach().sum() * scale).reshape(1)
            bound["loss"] = ((loss_bound.sum() + units * per_token.abs().sum()) *
                             scale).reshape(1)
        # the logit gradients' errors: their probabilities' relative errors (the logits' and
        # the row math's) at the weights' scale, per row's upstream
        weight = (c.soft_weight / temp) * (p_s + p_t) + c.hard_weight * p_h
        rowerr = units * (1 + torch.maximum(m_s, m_t).amax(1, keepdim=True)) + \
            2 * (torch.maximum(models["s_"][4], models["t_"][4]) / temp).amax(1, keepdim=True)
        acc = math.log2(2 * max(n, v)) * U32
        sub = 8 * TINY[torch.float32] * (1 + c.soft_weight / temp + c.hard_weight) * \
            (1 + torch.maximum(m_s, m_t).amax(1, keepdim=True))
        for p, g in (("s_", gs), ("t_", gt)):
            if p == "t_" and not c.teacher_grad:
                continue
            # (and a few of fp32's subnormal spacings, times the factors r_j - KL that multiply
            # a subnormal P_j: entries below fp32's normal range)
            tile = torch.where(valid[:, None], (g.abs() + weight * up.abs()[:, None]) * rowerr +
                               sub * up.abs()[:, None], 0.0)
            x, w, b = models[p][:3]
            gdt = {"input": dt, "weight": inputs[p + "weight"].dtype,
                   "bias": inputs[p + "weight"].dtype}
            parts = {"input": (g @ w, tile @ w.abs() + acc * g.abs() @ w.abs()),
                     "weight": (g.T @ x, tile.T @ x.abs() + acc * g.abs().T @ x.abs())}
            if b is not None:
                parts["bias"] = (g.sum(0), tile.sum(0) + acc * g.abs().sum(0))
            for k, (r, e) in parts.items():
                ref["d" + p + k] = r.reshape(inputs[p + k].shape)
                bound["d" + p + k] = (e + UNIT[gdt[k]] * r.abs() + TINY[gdt[k]]).reshape(
                    inputs[p + k].shape)
    return ref, bound


def check(c):
    """None if the case passes, else a string saying what failed (an exception included)."""
    if c.entry == "distill":
        try:
            inputs = make_inputs(c)
            got = run_flce(c, inputs)
            ref, bound = _distill_bounds(c, inputs)
        except Exception:  # noqa: BLE001  (a crash is a finding)
            return "raised:\n" + traceback.format_exc(limit=6)
        return _compare(c, got, ref, bound)
    try:
        if c.backend == "cuda-host":
            import cuda_emulation

            cuda_emulation.load()
        inputs = make_inputs(c)
        if c.backend == "cuda-host":
            saved = os.environ.get("FLCE_CUDA_OPT_IN")
            os.environ["FLCE_CUDA_OPT_IN"] = "distributions" if c.cuda_distributions else ""
            try:
                with cuda_emulation.routed():
                    got = run_flce(c, inputs)
            finally:
                if saved is None:
                    del os.environ["FLCE_CUDA_OPT_IN"]
                else:
                    os.environ["FLCE_CUDA_OPT_IN"] = saved
        else:
            got = run_flce(c, inputs)
        ref, bound = reference_and_bounds(c, inputs)
    except Exception:  # noqa: BLE001  (a crash is a finding)
        return "raised:\n" + traceback.format_exc(limit=6)
    bad = []
    present = inputs["target"] != -100
    if c.zero_weights and c.class_weight and not c.soft and c.reduction == "mean" and \
            bool(present.any()):
        # torch's weighted mean over zero weights: 0/0 = NaN (label smoothing's terms keep the
        # sum above 0: flce gave inf), and NaN gradients, except ignored rows' (0)
        if not bool(torch.isnan(got["loss"]).all()):
            bad.append(f"loss: {got['loss'].tolist()} where the mean over zero weights is NaN")
        for k in got:
            x = got[k]
            if k.startswith("d") and not (bool(torch.isnan(x).any()) and
                                          bool((torch.isnan(x) | (x == 0)).all())):
                bad.append(f"{k}: not NaN (and 0 for ignored rows) as torch's")
        return "; ".join(bad) if bad else None
    for k in ref:
        counted = math.prod(_row_shape(c, inputs)) > 0 if c.soft else \
            bool((inputs["target"] != -100).any())
        if c.reduction == "mean" and k == "loss" and not counted:
            x = got[k]
            ok = bool(torch.isnan(x).all())  # the mean of nothing: NaN, as torch
            if not ok:
                bad.append(f"{k}: {x.tolist()} where the mean of no token is NaN")
            continue
        bad += _compare_one(k, got[k], ref[k], bound[k])
    return "; ".join(bad) if bad else None


def _compare(c, got, ref, bound):
    """None if every output is within FACTOR times its bound (distillation: the mean of no
    token is 0, as Liger's and TRL's, which the reference gives), else what failed."""
    bad = []
    for k in ref:
        bad += _compare_one(k, got[k], ref[k], bound[k])
    return "; ".join(bad) if bad else None


def _compare_one(k, x, r, b):
    """[] if every element of output ``k`` is finite and within FACTOR times its bound, else
    one line saying where it is worst."""
    x = x.reshape(r.shape)
    err = (x - r).abs()
    over = ~torch.isfinite(x) | (err > FACTOR * b)
    if not over.any():
        return []
    ratio = (err / b.clamp_min(1e-300)).nan_to_num(math.inf)
    i = int(ratio.reshape(-1).argmax())
    return [f"{k}: {int(over.sum())}/{over.numel()} elements beyond {FACTOR}x the bound; worst "
            f"at flat index {i}: got {x.reshape(-1)[i].item():.8e}, float64 "
            f"{r.reshape(-1)[i].item():.8e}, bound {b.reshape(-1)[i].item():.3e} "
            f"({ratio.reshape(-1)[i].item():.2f}x)"]


def ratios(c):
    """Per output, the largest error / bound ratio of a passing case (the fuzzer's margin)."""
    inputs = make_inputs(c)
    got = run_flce(c, inputs)
    ref, bound = (_distill_bounds if c.entry == "distill" else reference_and_bounds)(c, inputs)
    return {k: float(((got[k].reshape(ref[k].shape) - ref[k]).abs() / bound[k].clamp_min(1e-300))
                     .max()) if ref[k].numel() else 0.0 for k in ref}


def _simpler(c):
    """Candidate cases one step simpler than c."""
    plain = {"bias": False, "class_weight": False, "ignore": 0.0, "label_smoothing": 0.0,
             "z_loss": 0.0, "softcap": 0.0, "temperature": 1.0, "lse": False, "entropy": False,
             "single_pass": None, "exact_bf16_grad": None, "confident": 0.0, "scale": 1.0, "x_layout": "plain",
             "w_layout": "plain", "t_layout": "plain", "class_dim": 0, "master": False,
             "reduction": "sum", "cuda_distributions": False, "soft_grad": False,
             "soft_dtype": "fp32", "soft": "", "zero_weights": False, "hard_weight": 0.0,
             "soft_weight": 1.0, "d_teacher": 0, "teacher_grad": False, "same_class": True}
    for k, val in plain.items():
        if getattr(c, k) != val:
            yield dataclasses.replace(c, **{k: val})
    if len(c.lead) > 1:
        yield dataclasses.replace(c, lead=(math.prod(c.lead),))
    if c.lead[-1] > 1:
        yield dataclasses.replace(c, lead=c.lead[:-1] + ((c.lead[-1] + 1) // 2,))
    for k in ("v", "d"):
        if getattr(c, k) > 1:
            yield dataclasses.replace(c, **{k: (getattr(c, k) + 1) // 2})
    if c.dtype != "fp32":
        yield dataclasses.replace(c, dtype="fp32", master=False)


def shrink(c, budget_s=60.0):
    """The simplest case reachable from c by one-step simplifications that still fail."""
    end = time.monotonic() + budget_s
    changed = True
    while changed and time.monotonic() < end:
        changed = False
        for s in _simpler(c):
            if s.single_pass and (s.reduction == "none" or s.lse or s.entropy):
                continue
            if check(s) is not None:
                c, changed = s, True
                break
    return c


def repro(c, why):
    return (f"flce fuzz failure: {why}\n  minimal case: {c.code()}\n  repro: cd tests && python -c "
            f"\"from fuzz import *; print(check({c.code()}))\"")


def fuzz(backend, seconds, seed=0, max_cases=None, log=None):
    """Run random cases for ``seconds`` (or ``max_cases``); returns (cases run, failures)."""
    rng = random.Random(f"{backend}-{seed}")
    end = time.monotonic() + seconds
    n, failures = 0, []
    while time.monotonic() < end and (max_cases is None or n < max_cases):
        c = draw(rng, backend)
        n += 1
        why = check(c)
        if why is not None:
            small = shrink(c)
            failures.append(repro(small, check(small) or why))
            if log:
                log(failures[-1])
    return n, failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--backend", choices=["cpu", "cuda-host"], default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soft-fraction", type=float, default=None,
                    help=f"the fraction of cases with probability targets (default "
                    f"{SOFT_FRACTION}; 1: all of them)")
    a = ap.parse_args(argv)
    if a.soft_fraction is not None:
        globals()["SOFT_FRACTION"] = a.soft_fraction
    t0 = time.monotonic()
    n, fails = fuzz(a.backend, a.minutes * 60, a.seed, log=print)
    rng = random.Random(f"{a.backend}-{a.seed}")  # (the same draws again, to count)
    soft = sum(bool(draw(rng, a.backend).soft) for _ in range(n))
    print(f"{n} cases on {a.backend} in {time.monotonic() - t0:.0f} s ({soft} with probability "
          f"targets): {len(fails)} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
