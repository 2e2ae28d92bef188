"""Differential fuzzer of the vocab-parallel entry points (flce.parallel) over a gloo group.

Each case is drawn from a seed, the same on every rank: the entry point
(``vocab_parallel_linear_cross_entropy``, ``flce.parallel.cross_entropy`` on the rank's logit
columns, or ``flce.linear_cross_entropy`` with a DTensor classifier ``Shard(0)`` and a plain or
replicated DTensor input), sizes with tails, dtype and fp32 master weights, bias, class targets
with ignored rows or probability targets, class weights, reduction, label smoothing, z-loss,
softcap, temperature, lse / entropy / accuracy outputs, ``shift``, ``sequence_parallel``,
``reduce_input_grad=False``, vocabulary padding rows (``vocab_size``), and even, uneven or empty
shards; on "cuda-host" (the CUDA backend under the host emulation, tests/cuda_emulation.py, with
its opt-in target distributions) also ``single_pass``. Every output and every gradient, through
a random upstream of each output, is compared with float64 (flce's own single-device call on
float64 copies of the inputs: the composite path, torch ops of the collapse-safe formulas, which
the single-device tests hold to ``flce.reference``) and held, norm-wise, to ``(1 + R)`` times
the larger of the single-device call's error in the same dtype and the output dtype's rounding
floor, as tests/parallel/test_parallel.py ``_close_to_single`` (R ranks merge the row statistics
with up to R roundings; a lost term, a wrong shard offset or a gradient rounded twice is far
outside it), the floor at least 16 fp32 ulps. It checks the plumbing over the shards (offsets,
padding, the exchange, the collectives, the reduction of dE); the per-element numerics of each
op are tests/fuzz.py's. With ``reduce_input_grad=False`` the ranks' parts of dE are summed here
in float64, and the bound gains their own rounding (each part is in the input's dtype). Padding
rows must get exactly zero gradient. Known gap: the gradients' bound has no term for the error of
dz itself where its terms cancel (the entropy's p_j (lse - z_j - H), smoothing's p_j - y_j): an
fp32 case there can exceed it on several ranks (2 in 20,150 cases: 1.4x and 1.8x the bound, fp32
with V = 2 or D = 1); tests/fuzz.py's per-element bound models that term.

    python tests/parallel/fuzz_parallel.py --minutes 5 [--backend cuda-host] [--world 3]
                                           [--seed S] [--cases K]

(from the repository, flce installed). A failing case prints ``FAIL seed=S`` and its options;
``--seed S --cases 1`` runs it alone; ``--trace`` prints each seed as it starts (a rank that
raises alone leaves the others waiting in a collective until gloo's timeout: the last seed is
the case). The suite runs a short seeded run of each backend
(tests/parallel/test_parallel.py ``test_fuzz_short_run``).
"""
import argparse
import math
import os
import random
import sys
import time
import traceback

import torch

HERE = os.path.abspath(__file__)
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def draw(seed, world, backend):
    """The options of case ``seed`` (plain values: every rank draws the same)."""
    rng = random.Random(seed)
    c = dict(seed=seed, entry=rng.choice(["linear", "linear", "logits", "dtensor"]),
             n=rng.choice([1, 3, 9, 17, 40]), v=rng.choice([world, 5, 33, 130]),
             d=rng.choice([1, 4, 16]), dtype=rng.choice(["fp32", "bf16", "fp16"]))
    linear = c["entry"] != "logits"
    c["master"] = c["dtype"] != "fp32" and linear and rng.random() < 0.4
    c["bias"] = linear and rng.random() < 0.4
    c["soft"] = rng.random() < 0.3
    c["class_weight"] = rng.random() < 0.3
    c["reduction"] = rng.choice(["mean", "sum", "none"])
    c["label_smoothing"] = rng.choice([0.0, 0.0, 0.1])
    c["z_loss"] = rng.choice([0.0, 1e-3])
    c["softcap"] = rng.choice([None, 3.0, 30.0])
    c["temperature"] = rng.choice([1.0, 0.5, 1.7])
    c["return_lse"], c["return_entropy"] = rng.random() < 0.3, rng.random() < 0.3
    c["ignore"] = rng.random() < 0.3
    # (a DTensor Shard(0) splits as torch.chunk: "even")
    c["shards"] = rng.choice(["even", "uneven", "empty"]) if c["entry"] != "dtensor" else "even"
    distribution = c["soft"] or (c["class_weight"] and c["label_smoothing"] > 0)
    c["return_accuracy"] = rng.random() < 0.2 and not distribution
    c["shift"] = rng.random() < 0.2 and not distribution and linear
    c["sequence_parallel"] = (c["entry"] == "linear" and not distribution and not c["shift"]
                              and world > 1 and rng.random() < 0.3)
    c["reduce_input_grad"] = not (c["entry"] == "linear" and not c["sequence_parallel"]
                                  and rng.random() < 0.25)
    c["padding"] = rng.choice([0, 0, 0, 3]) if c["entry"] == "linear" else 0
    c["dtensor_input"] = c["entry"] == "dtensor" and rng.random() < 0.5
    c["single_pass"] = rng.choice([None, None, False]) if backend == "cuda-host" else None
    if c["sequence_parallel"]:
        c["n"] = world * max(1, c["n"] // world)
    return c


def shard_sizes(rows, world, kind):
    if kind == "even":
        sizes = [len(s) for s in torch.chunk(torch.arange(rows), world)]
        return sizes + [0] * (world - len(sizes))
    if kind == "uneven":
        return [len(s) for s in torch.tensor_split(torch.arange(rows), world)][::-1]
    # rank 1's shard empty (rank 0's with one: a one-rank world has no empty shard)
    if world == 1:
        return [rows]
    return [rows] + [0] * (world - 1) if world == 2 else [rows - rows // 2, 0, rows // 2] + \
        [0] * (world - 3)


def _norm_err(a, ref):
    """Norm-wise error of a against ref (NaN positions must agree; absolute if ref is 0)."""
    a, ref = a.detach().double(), ref.detach().double()
    nan = torch.isnan(ref)
    if not torch.equal(nan, torch.isnan(a)):
        return float("inf")
    a, ref = a[~nan], ref[~nan]
    if not torch.isfinite(a).all():
        return float("inf")
    scale = ref.norm().item()
    return (a - ref).norm().item() / scale if scale > 0 else (a - ref).norm().item()


_MESHES = {}


def _mesh(world):
    """The 1-D CPU device mesh of the group (made once per process)."""
    if world not in _MESHES:
        from torch.distributed.tensor import init_device_mesh

        _MESHES[world] = init_device_mesh("cpu", (world,))
    return _MESHES[world]


def run_case(c, rank, world, group):
    """The failures of case c on this rank (messages; empty: it passed)."""
    import torch.distributed as dist

    import flce
    import flce.parallel as fp

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[c["dtype"]]
    n, v, d = c["n"], c["v"], c["d"]
    g = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 2 / d ** 0.25
    rows = v + c["padding"]  # the shards' rows; vocabulary padding past v
    w = torch.randn(rows, d, generator=g, dtype=torch.float64) / d ** 0.25
    b = torch.randn(rows, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    if c["ignore"]:
        t[::3] = -100
    q = torch.softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 3, 1)
    cw = torch.rand(v, generator=g, dtype=torch.float64) + 0.25 if c["class_weight"] else None
    sizes = shard_sizes(rows, world, c["shards"])
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    opts = {k: c[k] for k in ("reduction", "label_smoothing", "z_loss", "softcap", "temperature",
                              "return_lse", "return_entropy", "return_accuracy")}
    wdt = torch.float32 if c["master"] else dtype
    up = torch.Generator().manual_seed(c["seed"] + 1)

    def call(fn, *leaves):
        """fn(*leaves) -> its outputs (a tuple) and the leaves' gradients through a random
        upstream of every floating output."""
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = 0
        for o in outs:
            if o.is_floating_point() and o.requires_grad:
                total = total + (o.double() * (torch.rand(o.shape, generator=up,
                                                          dtype=torch.float64) + 0.5)).sum()
        if isinstance(total, torch.Tensor):
            total.backward()
        return [o.detach() for o in outs], [None if a is None else a.grad for a in leaves]

    def leaf(a, dt):
        return None if a is None else a.to(dt).clone().requires_grad_()

    def single(dt, w_dt):
        """The single-device call in dtype dt (float64: the reference)."""
        cw_dt = None if cw is None else cw.to(torch.float64 if dt == torch.float64 else
                                                torch.float32)
        target = q.to(dt if dt == torch.float64 else torch.float32) if c["soft"] else t
        up.manual_seed(c["seed"] + 1)
        if c["entry"] == "logits":
            z = (x @ w[:v].T).to(dtype).to(dt)
            return call(lambda z: flce.cross_entropy(z, target, cw_dt, **opts), leaf(z, dt))
        bias = leaf(b[:v], w_dt) if c["bias"] else None
        return call(lambda x, w, b: flce.linear_cross_entropy(x, w, target, bias=b,
                                                              class_weight=cw_dt,
                                                              shift=c["shift"], **opts),
                    leaf(x.to(dtype), dt), leaf(w[:v].to(wdt), w_dt), bias)

    ref_out, ref_grads = single(torch.float64, torch.float64)
    one_out, one_grads = single(dtype, wdt)
    acc = None
    if c["entry"] != "logits":
        # |d total / d u| in float64 (u = x w^T + b, the raw logits) and the magnitudes of the
        # gradient GEMMs' sums: an fp32 accumulation (and a gradient tile rounded to a 16-bit
        # compute dtype) errs by a few units of them, whatever the ranks' split of the sums,
        # which may cancel (a single-device call can be luckier there).
        x64, w64 = x.to(dtype).double(), w[:v].to(wdt).double()
        u = x64 @ w64.T + (b[:v].to(wdt).double() if c["bias"] else 0)
        target = q if c["soft"] else flce._common.shift_target(t, -100) if c["shift"] else t
        up.manual_seed(c["seed"] + 1)
        _, (gu,) = call(lambda u: flce.cross_entropy(u, target, cw, **opts),
                        leaf(u, torch.float64))
        dz = gu.abs()
        k = (math.ceil(math.log2(2 * (v + n))) + 4 + world) * UNIT[dtype]
        acc = (k * (dz @ w64.abs()), k * (dz.T @ x64.abs()), k * dz.sum(0))

    # The vocab-parallel call.
    cw32 = None if cw is None else cw.float()
    up.manual_seed(c["seed"] + 1)
    if c["entry"] == "logits":
        z = (x @ w[:v].T).to(dtype)
        target = q[:, lo:hi].float() if c["soft"] else t
        tp_out, tp_grads = call(lambda z: fp.cross_entropy(z, target, group=group,
                                                           class_weight=cw32, **opts),
                                leaf(z[:, lo:hi], dtype))
        pairs = [("d logits", tp_grads[0], one_grads[0][:, lo:hi], ref_grads[0][:, lo:hi],
                  None)]
    elif c["entry"] == "dtensor":
        # flce.linear_cross_entropy with the classifier (and bias) a DTensor Shard(0) of the
        # whole vocabulary; the input plain or a replicated DTensor; full targets.
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        mesh = _mesh(world)

        def dleaf(a, dt, placement):
            return distribute_tensor(a.to(dt), mesh, [placement]).requires_grad_()

        def full(a):
            return a.full_tensor() if isinstance(a, DTensor) else a

        target = q.float() if c["soft"] else t
        xd = dleaf(x, dtype, Replicate()) if c["dtensor_input"] else leaf(x.to(dtype), dtype)
        tp_out, tp_grads = call(
            lambda x, w, b: flce.linear_cross_entropy(x, w, target, bias=b, class_weight=cw32,
                                                      shift=c["shift"], **opts),
            xd, dleaf(w[:v], wdt, Shard(0)), dleaf(b[:v], wdt, Shard(0)) if c["bias"] else None)
        tp_out = [full(o) for o in tp_out]
        pairs = [(name, full(a), o, r, slack) for name, a, o, r, slack in
                 zip(("dE", "dW", "db"), tp_grads, one_grads, ref_grads, acc) if a is not None]
    else:
        m = n // world if c["sequence_parallel"] else n
        tok = slice(rank * m, (rank + 1) * m) if c["sequence_parallel"] else slice(None)
        target = q[:, max(0, min(lo, v)):max(0, min(hi, v))].float() if c["soft"] else t[tok]
        if c["soft"] and hi > v:  # padding columns: zero probability
            target = torch.cat([target, target.new_zeros(n, hi - max(lo, v))], 1)
        extra = {} if c["single_pass"] is None else {"single_pass": c["single_pass"]}
        tp_out, tp_grads = call(
            lambda x, w, b: fp.vocab_parallel_linear_cross_entropy(
                x, w, target, group=group, bias_local=b, class_weight=cw32, shift=c["shift"],
                vocab_size=v if c["padding"] else None,
                sequence_parallel=c["sequence_parallel"],
                reduce_input_grad=c["reduce_input_grad"], **opts, **extra),
            leaf(x.to(dtype)[tok], dtype), leaf(w[lo:hi].to(wdt), wdt),
            leaf(b[lo:hi], wdt) if c["bias"] else None)
        rows_in = max(0, min(hi, v) - lo)  # the shard's rows in the vocabulary; padding after
        ge, slack = tp_grads[0], acc[0][tok]
        if not c["reduce_input_grad"] and ge is not None:
            # the caller's sum of the ranks' parts, each rounded to the input's dtype
            parts = ge.double()
            gathered = [torch.empty_like(parts) for _ in range(world)]
            dist.all_gather(gathered, parts, group=group)
            ge = torch.stack(gathered).sum(0)
            slack = slack + UNIT[dtype] * torch.stack(gathered).abs().sum(0)
        pairs = [("dE", ge, one_grads[0][tok], ref_grads[0][tok], slack)]
        for i, name in ((1, "dW"), (2, "db")):
            if tp_grads[i] is None:
                continue
            if tp_grads[i][rows_in:].ne(0).any():
                pairs.append((f"{name} padding rows", float("inf"), None, None, None))
            pairs.append((name, tp_grads[i][:rows_in], one_grads[i][lo:lo + rows_in],
                          ref_grads[i][lo:lo + rows_in], acc[i][lo:lo + rows_in]))

    bad = []
    # An fp32 computation's own error: each row's logsumexp (m + log s) carries a few ulps of its
    # largest logit, merged over the ranks with up to R more roundings, and a reduced loss adds
    # the rows' (the single-device call may be luckier on a given case).
    floor_min = 16 * UNIT[torch.float32]
    outputs = [(f"output {i}", a, o, r, None)
               for i, (a, o, r) in enumerate(zip(tp_out, one_out, ref_out))]
    for name, a, o, r, slack in outputs + pairs:
        if isinstance(a, float):
            bad.append(name + " not zero")
            continue
        if a is None or r.numel() == 0:
            continue
        e_tp, e_one = _norm_err(a, r), _norm_err(o, r)
        floor = max(_norm_err(r.to(o.dtype), r), floor_min)
        bound = (1 + world) * max(e_one, floor)
        if slack is not None:  # absolute, per element: relative to ref's norm as e_tp
            scale = r.double().norm().item()
            bound += slack.norm().item() / (scale if scale > 0 else 1.0)
        if not e_tp <= bound:
            bad.append(f"{name}: {e_tp:.3g} > bound {bound:.3g} (single-device {e_one:.3g}, "
                       f"floor {floor:.3g})")
    return bad


def worker(args):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from dist_launch import finish_worker, init_worker

    rank, world = init_worker()
    group = dist.group.WORLD
    if args.backend == "cuda-host":
        import cuda_emulation

        routing = cuda_emulation.routed()
        routing.__enter__()
        # (the target distributions' CUDA ops, and several row chunks per call)
        os.environ["FLCE_CUDA_OPT_IN"] = "distributions"
        os.environ["FLCE_CUDA_WORKSPACE_MB"] = "0.3"
    end = time.monotonic() + args.minutes * 60
    cases = failures = 0
    while cases < args.cases:
        go = torch.tensor([1 if time.monotonic() < end else 0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN, group=group)
        if go.item() == 0:
            break
        c = draw(args.seed + cases, world, args.backend)
        if args.trace:
            print("case", c["seed"], flush=True)
        try:
            bad = run_case(c, rank, world, group)
        except Exception:  # noqa: BLE001 (a raise is a failure of the case, reported)
            bad = ["raised " + traceback.format_exc()[-2000:]]
            if args.trace:
                print(bad[0], flush=True)
        cases += 1
        flag = torch.tensor([1 if bad else 0])
        dist.all_reduce(flag, group=group)
        if flag.item():
            failures += 1
            if bad:
                print(f"FAIL seed={c['seed']} rank {rank}: {c}\n  " + "\n  ".join(bad),
                      flush=True)
    if rank == 0:
        print(f"cases {cases} failures {failures}", flush=True)
    finish_worker()


def fuzz(backend="cpu", world=2, seed=0, minutes=1.0, cases=10 ** 9, trace=False):
    """Run the fuzzer on ``world`` gloo ranks; (cases run, failures, rank 0's output)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from dist_launch import launch

    if backend == "cuda-host":
        import cuda_emulation

        cuda_emulation.load()  # built once here; the ranks load the cached module
    args = ["--worker", "--backend", backend, "--seed", str(seed), "--minutes", str(minutes),
            "--cases", str(cases)] + (["--trace"] if trace else [])
    results = launch(HERE, world, args=args, timeout=minutes * 60 + 180)
    # Every failure's lines in full (a long --trace run's tail would lose them), then the tails.
    fails = [line for _, text in results for line in text.splitlines()
             if line.startswith(("FAIL", "  "))]
    out = "\n".join(fails[:400] + [f"--- rank {r} (exit {rc}) ---\n{text[-8000:]}"
                                   for r, (rc, text) in enumerate(results)])
    summary = [line for line in results[0][1].splitlines() if line.startswith("cases ")]
    if not summary or any(rc != 0 for rc, _ in results):
        return 0, -1, out
    _, ran, _, failed = summary[-1].split()
    return int(ran), int(failed), out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cpu", "cuda-host"], default="cpu")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--cases", type=int, default=10 ** 9)
    p.add_argument("--trace", action="store_true",
                   help="print each case's seed before it runs, and a raise at once (a hang)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    ran, failed, out = fuzz(args.backend, args.world, args.seed, args.minutes, args.cases,
                            args.trace)
    if failed:
        print(out)
    what = "a rank failed or hung (its output above)" if failed < 0 else \
        f"{ran} cases, {'no' if failed == 0 else failed} failures"
    print(f"{args.backend}, {args.world} ranks, seed {args.seed}: {what}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
