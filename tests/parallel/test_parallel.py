"""Vocab-parallel flce over torch.distributed (gloo, CPU), against one process and float64.

Each pytest test launches one process group (tests/dist_launch.py: free port, hard timeout) that
runs every check of this file in sequence: a check that fails raises on its rank, which exits
non-zero and brings the launch down. All ranks draw the same inputs from the same seeds and
each takes its shard.

The peer for ``flce.parallel.vocab_parallel_cross_entropy`` is ``megatron_cross_entropy`` below:
a faithful re-implementation of Megatron-Core's ``_VocabParallelCrossEntropy`` (megatron/core/
tensor_parallel/cross_entropy.py: all-reduce MAX of the row max, all-reduce SUM of the predicted
logit, all-reduce SUM of sum-exp, ``loss = log(sum_exp) - predicted``, gradient
``softmax - onehot``), because megatron-core is not installed here.

Tolerances are relative to floors: an error against float64 is compared with the single-process
flce result's error and with the error of rounding the float64 answer to float32.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_launch import flce_path, run_checked  # noqa: E402

HERE = os.path.abspath(__file__)
F32_ULP = 2.0 ** -24


# ---------------------------------------------------------------------------------------------
# The pytest side: one launch per world size.
# ---------------------------------------------------------------------------------------------
def _run(world_size, timeout=150.0):
    run_checked(HERE, world_size, timeout=timeout)


def test_world_size_2():
    _run(2)


def test_world_size_4():
    _run(4)


# return_predicted_tokens over the shards (check_predicted_tokens alone): world 3 has an empty
# middle shard.
@pytest.mark.parametrize("world", [2, 3])
def test_predicted_tokens(world):
    run_checked(HERE, world, timeout=150.0, args=("--predicted",))


# The vocab-parallel fuzzer (fuzz_parallel.py): a short seeded run per world size, the same cases
# every run; the long run is on demand.
@pytest.mark.parametrize("world", [2, 3])
def test_fuzz_short_run(world):
    import fuzz_parallel

    cases = 400
    ran, failed, out = fuzz_parallel.fuzz("cpu", world=world, seed=10 * world, minutes=2.0,
                                          cases=cases)
    assert failed == 0 and ran == cases, out


def test_import_is_cheap_and_plain_tensors_are_not_sharded():
    import subprocess

    code = ("import sys, flce, flce.parallel as p, torch;"
            "assert not p.is_vocab_sharded(torch.ones(2, 2));"
            "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor imported';"
            "flce.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4]))")
    env = dict(os.environ, PYTHONPATH=flce_path())
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_uninitialized_group_is_a_clear_error():
    import flce.parallel as p

    with pytest.raises(RuntimeError, match="not initialized"):
        p.vocab_parallel_linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4),
                                              torch.tensor([0, 1, 4]))
    with pytest.raises(RuntimeError, match="not initialized"):
        p.vocab_parallel_cross_entropy(torch.randn(3, 2, 5), torch.zeros(3, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------------------------
def megatron_cross_entropy(logits, target, group):
    """Megatron-Core's vocab-parallel cross-entropy (label_smoothing = 0), re-implemented."""
    import torch.distributed as dist

    class _Megatron(torch.autograd.Function):
        @staticmethod
        def forward(ctx, vp_logits, target):
            vp_logits = vp_logits.float().clone()
            logits_max = vp_logits.max(dim=-1)[0]
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
            part = vp_logits.shape[-1]
            start = dist.get_rank(group) * part
            vp_logits -= logits_max.unsqueeze(-1)
            target_mask = (target < start) | (target >= start + part)
            masked_target = (target - start).masked_fill(target_mask, 0)
            logits_2d = vp_logits.view(-1, part)
            predicted = logits_2d[torch.arange(logits_2d.shape[0]), masked_target.view(-1)]
            predicted = predicted.clone().view_as(target).masked_fill(target_mask, 0.0)
            exp_logits = vp_logits.exp_()
            sum_exp = exp_logits.sum(dim=-1)
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
            loss = torch.log(sum_exp) - predicted
            exp_logits.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(exp_logits, target_mask, masked_target.view(-1))
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            softmax, target_mask, masked_target_1d = ctx.saved_tensors
            grad_2d = softmax.view(-1, softmax.shape[-1])
            rows = torch.arange(grad_2d.shape[0])
            grad_2d[rows, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
            return softmax.mul_(grad_output.unsqueeze(-1)), None

    return _Megatron.apply(logits, target)


def _margin_inputs(n, v, d, seed, max_margin=200.0):
    """x [n, d], weight [v, d], target [n] with the target's margin over the other logits
    spread over [0, max_margin] (one in eight rows random, negative margins), float64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.3 + 4.0 * w[t] / d ** 0.5
    z = x @ w.T
    zt = z.gather(1, t[:, None])[:, 0]
    other = z.scatter(1, t[:, None], float("-inf")).amax(1)
    margin0 = (zt - other).clamp_min(1e-3)
    want = torch.rand(n, generator=g, dtype=torch.float64) * max_margin
    scale = torch.where(margin0 > 0.5, want / margin0, torch.ones_like(want))
    keep = torch.rand(n, generator=g) < 0.125
    x = torch.where(keep[:, None], torch.randn(n, d, generator=g, dtype=torch.float64), x * scale[:, None])
    return x, w, t


def _margins(x, w, t):
    z = x.double() @ w.double().T
    zt = z.gather(1, t[:, None])[:, 0]
    return zt - z.scatter(1, t[:, None], float("-inf")).amax(1)


def _rel_err(a, ref):
    """Max-norm error of a against ref, relative to ref's max-norm."""
    a, ref = a.double(), ref.double()
    scale = ref.abs().max().clamp_min(1e-300)
    return ((a - ref).abs().max() / scale).item()


def _floor(ref, dtype=torch.float32):
    return max(_rel_err(ref.to(dtype), ref), F32_ULP / 4)


def _elementwise_rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).abs() / ref.abs().clamp_min(1e-300)).max().item()


def _close_to_single(name, tp, single, ref, world, dtype=torch.float32):
    """tp's error vs float64 within (1 + world) x max(single process's error, rounding floor).

    Both round the same math at different points: the row statistics merged over R ranks add
    up to R roundings to the sum-exp that every p_j = exp(z_j - lse) inherits, and dE is summed
    over ranks by the all-reduce; a lost compensation or a wrong merge is far outside that."""
    assert tp.shape == ref.shape and tp.dtype == single.dtype, (name, tp.shape, tp.dtype)
    if ref.numel() == 0:  # an empty shard
        return 1.0
    e_tp, e_one, floor = _rel_err(tp, ref), _rel_err(single, ref), _floor(ref, dtype)
    bound = (1 + world) * max(e_one, floor)
    assert e_tp <= bound, (f"{name}: TP error {e_tp:.3g} > {bound:.3g} (single process "
                           f"{e_one:.3g}, rounding floor {floor:.3g})")
    return e_tp / max(e_one, floor)


def _shards(world, v_rows, kind, seed):
    """Shard sizes summing to v_rows: even, uneven (random, one may be empty)."""
    if kind == "even":
        assert v_rows % world == 0
        return [v_rows // world] * world
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, v_rows + 1, (world - 1,), generator=g).tolist())
    bounds = [0] + cuts + [v_rows]
    return [bounds[i + 1] - bounds[i] for i in range(world)]


def check_fused(rank, world, group, *, n=96, d=24, v_rows=None, shards="even", vocab_size=None,
                bias=False, dtype=torch.float32, weight_dtype=None, seed=0, seq_par=False, target_in=None,
                ignore_frac=0.2, ignore_index=-100, **options):
    """One configuration: vocab-parallel loss, lse, dE, dC, db vs one process vs float64."""
    import flce
    import flce.parallel as fp
    from flce import reference

    v_rows = v_rows or 64 * world
    sizes = _shards(world, v_rows, shards, seed)
    vocab = vocab_size or v_rows
    x64, w64, t = _margin_inputs(n * (world if seq_par else 1), v_rows, d, seed)
    t = t % vocab if target_in is None else target_in(t, sizes)
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.where(torch.rand(t.shape, generator=g) < ignore_frac, torch.full_like(t, ignore_index), t)
    b64 = torch.randn(v_rows, generator=g, dtype=torch.float64) if bias else None
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    reduction = options.get("reduction", "mean")
    upstream = torch.rand(t.shape, generator=g) + 0.5  # weights the "none" losses
    lse_up = torch.rand(t.shape, generator=g) - 0.5

    def run(fn, x, w, b):
        x = x.detach().requires_grad_()
        w = w.detach().requires_grad_()
        b = b.detach().requires_grad_() if b is not None else None
        loss, lse = fn(x, w, b)
        obj = (loss * upstream).sum() if reduction == "none" else loss
        (obj + (lse.float() * lse_up).sum()).backward()
        return loss.detach(), lse.detach(), x.grad, w.grad, None if b is None else b.grad

    opts = dict(options, ignore_index=ignore_index, return_lse=True)
    # flce's choice of bf16 rounding (the reference has none)
    mode = {"exact_bf16_grad": opts.pop("exact_bf16_grad")} if "exact_bf16_grad" in opts else {}
    x_lp, w_lp = x64.to(dtype), w64.to(weight_dtype or dtype)
    b_lp = b64.to(w_lp.dtype) if bias else None
    # float64 oracle and the one-process flce result, over the real vocabulary.
    ref = run(lambda x, w, b: reference.linear_cross_entropy(x, w[:vocab], t, bias=None if b is None else b[:vocab], **opts),
              x_lp.double(), w_lp.double(), None if b_lp is None else b_lp.double())
    one = run(lambda x, w, b: flce.linear_cross_entropy(x, w[:vocab], t, bias=None if b is None else b[:vocab], **opts,
                                                        **mode),
              x_lp, w_lp, b_lp)
    tok = slice(rank * n, (rank + 1) * n) if seq_par else slice(None)
    par = run(lambda x, w, b: fp.vocab_parallel_linear_cross_entropy(
        x, w, t[tok], group=group, bias_local=b, vocab_size=vocab_size,
        sequence_parallel=seq_par, **opts, **mode), x_lp[tok], w_lp[sl],
        None if b_lp is None else b_lp[sl])

    ratios = {}
    for i, name in enumerate(("loss", "lse")):
        ratios[name] = _close_to_single(name, par[i], one[i], ref[i], world)
    ratios["dE"] = _close_to_single("dE", par[2], one[2][tok], ref[2][tok], world, dtype)
    ratios["dC"] = _close_to_single("dC", par[3], one[3][sl], ref[3][sl], world, w_lp.dtype)
    if bias:
        ratios["db"] = _close_to_single("db", par[4], one[4][sl], ref[4][sl], world, w_lp.dtype)
    # Padding rows: exactly zero gradient.
    pad = slice(max(0, vocab - start), sizes[rank])
    assert (par[3][pad] == 0).all() and (bias is False or (par[4][pad] == 0).all())
    if reduction == "none" and dtype == torch.float32 and not options.get("softcap"):
        # Collapse-safe: per-token loss accurate where every other peer returns 0.
        m = _margins(x_lp, w_lp[:vocab], t.clamp_min(0))
        band = (m > 30) & (m < 70) & (t != ignore_index)
        if not (options.get("label_smoothing") or options.get("z_loss")) and band.any():
            rel = _elementwise_rel(par[0][band], ref[0][band])
            assert rel < 1e-3 and (par[0][band] > 0).all(), f"collapse band rel err {rel:.3g}"
    return ratios


def check_exact_bf16_grad(rank, world, group):
    """exact_bf16_grad reaches the CPU backward through the vocab-parallel path: each mode's
    gradients against float64 within check_fused's bound of the one-process call in the same
    mode, and the rounded mode's dE and dC differ from the exact mode's."""
    import flce.parallel as fp

    # logits of std ~8: the non-target gradients weigh, and their rounding shows
    g = torch.Generator().manual_seed(15)
    v = 64 * world
    x0 = (torch.randn(96, 24, generator=g) * 8 / 24 ** 0.25).to(torch.bfloat16)
    w0 = (torch.randn(v, 24, generator=g) / 24 ** 0.25).to(torch.bfloat16)
    t = torch.randint(0, v, (96,), generator=g)
    sl = slice(rank * 64, (rank + 1) * 64)
    grads = {}
    for exact in (False, True):
        check_fused(rank, world, group, shards="uneven", dtype=torch.bfloat16, bias=True,
                    exact_bf16_grad=exact, seed=14)
        x, w = x0.clone().requires_grad_(), w0[sl].clone().requires_grad_()
        fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                               exact_bf16_grad=exact).backward()
        grads[exact] = (x.grad, w.grad)
    assert not torch.equal(grads[False][0], grads[True][0])
    assert not torch.equal(grads[False][1], grads[True][1])


def check_all_ignored(rank, world, group):
    """Every token ignored: sum 0, zero gradients, lse finite; mean is 0/0 = nan as in torch."""
    import flce
    import flce.parallel as fp

    x64, w64, t = _margin_inputs(40, 32 * world, 16, seed=20)
    t = torch.full_like(t, -100)
    sl = slice(rank * 32, (rank + 1) * 32)
    for reduction in ("sum", "mean"):
        x = x64.float().requires_grad_()
        w = w64.float()[sl].clone().requires_grad_()
        loss, lse = fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                           reduction=reduction, return_lse=True)
        loss.backward()
        one = flce.linear_cross_entropy(x64.float(), w64.float(), t, reduction=reduction)
        if reduction == "sum":
            assert loss.item() == 0.0 and one.item() == 0.0
        else:
            assert torch.isnan(loss) and torch.isnan(one)
        assert torch.isfinite(lse).all()
        assert (x.grad == 0).all() and (w.grad == 0).all()


def check_input_grad_left_to_caller(rank, world, group):
    """reduce_input_grad=False: the ranks' dE contributions sum to the reduced dE."""
    import torch.distributed as dist
    import flce.parallel as fp

    x64, w64, t = _margin_inputs(48, 24 * world, 16, seed=21)
    sl = slice(rank * 24, (rank + 1) * 24)
    grads = []
    for reduce in (True, False):
        x = x64.float().requires_grad_()
        fp.vocab_parallel_linear_cross_entropy(x, w64.float()[sl], t, group=group,
                                               reduce_input_grad=reduce).backward()
        grads.append(x.grad)
    partial = grads[1].clone()
    dist.all_reduce(partial, group=group)
    assert not torch.equal(grads[1], grads[0]) or world == 1
    assert torch.equal(partial, grads[0])


def check_input_grad_rounded_once(rank, world, group):
    """16-bit dE over the shards at its rounding floor, as on one device: the ranks' parts are
    summed in fp32 and rounded once (the sum of each rank's part rounded first and added in
    16 bits, what a caller's TP region does with reduce_input_grad=False, is measurably above
    it: the check's own control). Class targets (the all-reduce and, under sequence
    parallelism, the reduce-scatter) and probability targets."""
    import torch.distributed as dist
    import flce.parallel as fp
    from flce import reference

    n, v_shard, d = 128, 160, 48
    sl = slice(rank * v_shard, (rank + 1) * v_shard)
    cases = [(torch.bfloat16, "class", False), (torch.float16, "class", True),
             (torch.bfloat16, "probabilities", False)]
    for dtype, kind, seq_par in cases:
        g = torch.Generator().manual_seed(31)
        x = torch.randn(n * world, d, generator=g).to(dtype)
        w = (torch.randn(v_shard * world, d, generator=g) / d ** 0.25).to(dtype)
        if kind == "class":
            target = torch.randint(0, v_shard * world, (n * world,), generator=g)
            local_target = lambda rows: target[rows]
        else:
            target = torch.softmax(2 * torch.randn(n * world, v_shard * world, generator=g), -1)
            local_target = lambda rows: target[rows, sl]
        xr = x.double().requires_grad_()
        if kind == "class":
            reference.linear_cross_entropy(xr, w.double(), target).backward()
        else:
            reference.soft_cross_entropy(xr @ w.double().T, target.double()).backward()
        ref = xr.grad
        floor = ((ref.to(dtype).double() - ref).norm() / ref.norm()).item()
        tok = slice(rank * n, (rank + 1) * n) if seq_par else slice(None)
        errs = {}
        for reduce in (True, False):
            if seq_par and not reduce:
                continue
            xp = x[tok].clone().requires_grad_()
            fp.vocab_parallel_linear_cross_entropy(
                xp, w[sl], local_target(tok), group=group, reduce_input_grad=reduce,
                sequence_parallel=seq_par).backward()
            gx = xp.grad
            if not reduce:
                dist.all_reduce(gx, group=group)  # in 16 bits
            errs[reduce] = ((gx.double() - ref[tok]).norm() / ref[tok].norm()).item() / floor
        where = f"{dtype} {kind} sequence_parallel={seq_par}"
        assert errs[True] <= 1.05, f"{where}: dE at {errs[True]:.3f}x its rounding floor"
        if False in errs and world > 1:
            assert errs[False] > 1.2, f"{where}: the control's 16-bit sum at {errs[False]:.3f}x"


def check_dtensor(rank, world, group):
    """flce.linear_cross_entropy with a DTensor weight Shard(0) (uneven chunks) on a CPU mesh."""
    if world != 2:
        return  # once: the first DTensor op costs seconds of CPU per rank
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    import flce

    mesh = init_device_mesh("cpu", (world,))
    v = 48 * world - 5  # torch.chunk sharding: the last shard is short
    x64, w64, t = _margin_inputs(64, v, 16, seed=22)
    g = torch.Generator().manual_seed(23)
    b64 = torch.randn(v, generator=g, dtype=torch.float64)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, reduction="mean")
    x1 = x64.float().requires_grad_()
    w1 = w64.float().requires_grad_()
    b1 = b64.float().requires_grad_()
    one = flce.linear_cross_entropy(x1, w1, t, bias=b1, **opts)
    one.backward()
    for dtensor_input in (False, True):
        w = distribute_tensor(w64.float(), mesh, [Shard(0)]).requires_grad_()
        b = distribute_tensor(b64.float(), mesh, [Shard(0)]).requires_grad_()
        x = x64.float()
        x = distribute_tensor(x, mesh, [Replicate()]) if dtensor_input else x
        x.requires_grad_()
        loss = flce.linear_cross_entropy(x, w, t, bias=b, **opts)
        loss.backward()
        assert torch.allclose(loss, one, rtol=4 * F32_ULP, atol=0), (loss, one)
        gx = x.grad.full_tensor() if dtensor_input else x.grad
        for name, got, want in (("dE", gx, x1.grad), ("dC", w.grad.full_tensor(), w1.grad),
                                ("db", b.grad.full_tensor(), b1.grad)):
            err = _rel_err(got, want)
            assert err < 16 * F32_ULP, f"DTensor {name}: rel err vs one process {err:.3g}"
        assert tuple(w.grad.placements) == (Shard(0),)
    # One rank's bad option: every rank raises it (checked here before the exchange, it left the
    # other ranks waiting there)
    w = distribute_tensor(w64.float(), mesh, [Shard(0)])
    _expect(ValueError, "rank 1's arguments are invalid: flce: label_smoothing must be in",
            lambda: flce.linear_cross_entropy(x64.float(), w, t, label_smoothing=1.5 * rank))
    logits = distribute_tensor(x64.float() @ w64.float().T, mesh, [Shard(1)])
    _expect(ValueError, "rank 1's arguments are invalid: flce: reduction must be",
            lambda: flce.cross_entropy(logits, t, reduction="bogus" if rank else "mean"))
    # Placements flce cannot take: a clear error, not a wrong answer.
    w_rep = distribute_tensor(w64.float(), mesh, [Replicate()])
    try:
        flce.linear_cross_entropy(x64.float(), w_rep, t)
    except ValueError as e:
        assert "Shard(0)" in str(e)
    else:
        raise AssertionError("Replicate weight accepted")


def check_torchtitan_dropin(rank, world, group):
    """flce.cross_entropy of a DTensor [N, V] sharded over the vocabulary (TorchTitan's loss
    function under loss_parallel: pred.flatten(0, 1), Shard(-1) logits), bf16, against the
    single-device call and float64; the logits' gradient is a DTensor with their placement;
    flce.parallel.cross_entropy with inplace_backward writes it over the local logits."""
    if world != 2:
        return  # once: the first DTensor op costs seconds of CPU per rank
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    import flce
    import flce.parallel as fp
    from flce import reference

    mesh = init_device_mesh("cpu", (world,))
    b, s_len, v = 3, 8, 61 * world + 3  # uneven torch.chunk shards
    g = torch.Generator().manual_seed(70)
    pred64 = torch.randn(b, s_len, v, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, v, (b, s_len), generator=g)
    labels[0, :3] = -100
    pred = pred64.to(torch.bfloat16)
    opts = dict(label_smoothing=0.1, z_loss=1e-4)

    def loss_fn(p, y):  # the TorchTitan loss function, with flce
        return flce.cross_entropy(p.flatten(0, 1), y.flatten(0, 1), **opts)

    one_in = pred.clone().requires_grad_()
    one = loss_fn(one_in, labels)
    one.backward()
    dp = distribute_tensor(pred, mesh, [Shard(-1)]).requires_grad_()
    loss = loss_fn(dp, labels)
    assert not isinstance(loss, type(dp)) and loss.dtype == torch.float32
    loss.backward()
    ref_in = pred.double().flatten(0, 1).requires_grad_()
    ref = reference.logits_cross_entropy(ref_in, labels.flatten(), **opts)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 8 * F32_ULP * abs(ref.item()), (loss, ref)
    assert abs(loss.item() - one.item()) <= 8 * F32_ULP * abs(one.item()), (loss, one)
    assert tuple(dp.grad.placements) == (Shard(2),), dp.grad.placements
    got = dp.grad.full_tensor()
    assert got.dtype == torch.bfloat16
    # The gradient is the float64 one rounded once to bf16 (up to the fp32 math beneath).
    err = (got.double().flatten(0, 1) - ref_in.grad).abs()
    assert (err <= 2 ** -8 * ref_in.grad.abs() + 1e-12).all(), err.max()
    assert torch.equal(got, one_in.grad)
    # flce.parallel.cross_entropy: torch's semantics on local columns, in place.
    sizes = [c.shape[-1] for c in torch.chunk(pred, world, dim=-1)]
    lo = sum(sizes[:rank])
    local = pred.flatten(0, 1)[:, lo:lo + sizes[rank]].clone().requires_grad_()
    tmp = local * 1
    fp.cross_entropy(tmp, labels.flatten(), group=group, inplace_backward=True, **opts).backward()
    assert torch.equal(local.grad, one_in.grad.flatten(0, 1)[:, lo:lo + sizes[rank]])
    assert torch.equal(tmp.detach(), local.grad), "the gradient is not in the logits' storage"


def _expect(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"expected {match!r} in {e}"
    else:
        raise AssertionError(f"no {exc.__name__} ({match})")


def check_rank_disagreement(rank, world, group):
    """Mismatched ranks raise the same clear error everywhere instead of hanging."""
    import flce.parallel as fp

    def call(n=20, d=8, dtype=torch.float32, v=16, target=None, **kw):
        g = torch.Generator().manual_seed(30)
        x = torch.randn(n, d, generator=g).to(dtype)
        w = torch.randn(v, d, generator=g).to(dtype)
        t = torch.randint(0, v * world, (n,), generator=g) if target is None else target
        return fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group, **kw)

    _expect(ValueError, "disagree on D", lambda: call(d=8 + (rank == 1)))
    _expect(ValueError, "disagree on N", lambda: call(n=20 + rank))
    _expect(ValueError, "disagree on input dtype",
            lambda: call(dtype=torch.bfloat16 if rank == 0 else torch.float32))
    _expect(ValueError, "disagree on label_smoothing", lambda: call(label_smoothing=0.1 * rank))
    _expect(IndexError, "out of range", lambda: call(target=torch.full((20,), 16 * world)))
    # Rows of the padding are not classes: a target there is out of range too.
    _expect(IndexError, "out of range", lambda: call(target=torch.full((20,), 16 * world - 2),
                                                     vocab_size=16 * world - 3))
    _expect(ValueError, "tile [0, V)", lambda: call(vocab_start=0))
    _expect(ValueError, "on every rank or on none",
            lambda: call(n=21, vocab_start=0 if rank == 0 else None))
    # One rank's own arguments are bad: every rank raises that rank's error (it used to raise on
    # that rank alone while the others waited in the exchange until the group's timeout).
    last = world - 1
    mine = rank == last
    bad = f"rank {last}'s arguments are invalid"
    _expect(ValueError, f"{bad}: flce: target must have shape (20,)",
            lambda: call(target=torch.zeros(19 if mine else 20, dtype=torch.int64)))
    _expect(ValueError, f"{bad}: flce: label_smoothing must be in [0, 1]",
            lambda: call(label_smoothing=1.5 if mine else 0.0))
    _expect(TypeError, f"{bad}: flce: ignore_index must be an int",
            lambda: call(ignore_index=1.5 if mine else -100))
    # A target out of range on one rank only, found before the statistics' all-gather.
    _expect(IndexError, f"rank {last} has a target of {16 * world}",
            lambda: call(target=torch.full((20,), 16 * world if mine else 3)))
    # One rank changes N after an agreed call: every rank raises (it used to be an abort on one
    # rank and a NaN loss on the other).
    call()
    _expect(ValueError, "disagree on N", lambda: call(n=21 if mine else 20))
    # The logits-level paths exchange the same way.
    logits = torch.randn(20, 16)
    _expect(ValueError, f"{bad}: flce: target must have shape (20,)",
            lambda: fp.vocab_parallel_cross_entropy(
                logits, torch.zeros(19 if mine else 20, dtype=torch.int64), tp_group=group))
    _expect(IndexError, f"rank {last} has a target of -5",
            lambda: fp.cross_entropy(logits, torch.full((20,), -5 if mine else 1), group=group))
    # An offset past int64 on one rank (the exchange's row is int64): every rank raises.
    _expect(ValueError, f"{bad}: flce.parallel: vocab_start must be a non-negative int64",
            lambda: call(vocab_start=2 ** 63 if mine else 16 * rank))
    # inplace_backward over a leaf that requires grad, on one rank: every rank raises.
    leaf = torch.randn(20, 16).requires_grad_()
    for entry in (lambda x: fp.cross_entropy(x, torch.full((20,), 1), group=group,
                                             inplace_backward=True),
                  lambda x: fp.vocab_parallel_cross_entropy(x, torch.full((20,), 1),
                                                            tp_group=group, inplace_backward=True)):
        _expect(ValueError, f"{bad}: flce: inplace_backward=True would write the gradient",
                lambda: entry(leaf if mine else leaf * 1))
        # logits that a tanh saved: the backward raises on every rank, rather than the tanh's
        # backward reading the gradient as its output
        _expect(RuntimeError, "modified by an inplace operation",
                lambda: entry(torch.tanh(leaf)).sum().backward())
    # Explicit offsets in reverse rank order are a valid layout.
    call(vocab_start=16 * (world - 1 - rank))
    # Options whose disagreement met different collectives in the backward (the dE all-reduce
    # on some ranks only: a hang), or gave each rank other target columns (shift: inf, silently)
    _expect(ValueError, "disagree on shift", lambda: call(shift=mine))
    _expect(ValueError, "disagree on reduce_input_grad", lambda: call(reduce_input_grad=not mine))
    g = torch.Generator().manual_seed(31)
    x, w = torch.randn(20, 8, generator=g), torch.randn(16, 8, generator=g).requires_grad_()
    _expect(ValueError, "disagree on input requires grad",
            lambda: fp.vocab_parallel_linear_cross_entropy(
                x.clone().requires_grad_(not mine), w, torch.zeros(20, dtype=torch.int64),
                group=group).backward())
    call()  # the group still works


class _OpSpy:
    """Stands for flce._ops.ops in a block, recording the ops the API calls by name, and
    whether any was given a process group's name."""

    def __init__(self, ops):
        self.ops, self.calls, self.group_names = ops, [], []

    def __getattr__(self, name):
        self.calls.append(name)
        op = getattr(self.ops, name)

        def call(*args, **kwargs):
            self.group_names += [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
            return op(*args, **kwargs)

        return call


def _collectives_refused():
    """torch.distributed's collectives replaced by ones that raise, and a function that puts
    them back."""
    import torch.distributed as dist

    names = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_gather_object",
             "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
             "barrier")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran in a world of one rank")

    for n in saved:
        setattr(dist, n, refuse)
    return lambda: [setattr(dist, n, f) for n, f in saved.items()]


def check_one_rank(group):
    """A group of one rank is the single-device call: no collective, the same ops, bitwise the
    same values and gradients as flce.linear_cross_entropy / flce.cross_entropy (the padding
    rows cut away with a zero gradient), and a bad argument raises at once as it is."""
    import flce
    import flce._ops as _ops
    import flce.parallel as fp

    g = torch.Generator().manual_seed(60)
    n, v, pad, d = 37, 90, 6, 16
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v + pad, d, generator=g) / d ** 0.5
    b = torch.randn(v + pad, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[::4] = -100
    up = torch.rand(n, generator=g)

    def run(fn, **kw):
        xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
        spy = _OpSpy(_ops.ops)
        _ops.ops = spy
        try:
            out = fn(xs, ws, bs, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            ((loss * up).sum() if loss.dim() else loss).backward()
        finally:
            _ops.ops = spy.ops
        assert not spy.group_names, spy.group_names
        return spy.calls, [o.detach() for o in (out if isinstance(out, tuple) else (out,))], \
            xs.grad, ws.grad, bs.grad

    restore = _collectives_refused()
    try:
        for kw in (dict(), dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
                   dict(reduction="none", return_lse=True, return_entropy=True, softcap=9.0,
                        temperature=0.8, return_accuracy=True)):
            one = run(lambda xs, ws, bs, **k: flce.linear_cross_entropy(
                xs, ws[:v], t, bias=bs[:v], **k), **kw)
            for extra in (dict(), dict(sequence_parallel=True), dict(reduce_input_grad=False)):
                par = run(lambda xs, ws, bs, **k: fp.vocab_parallel_linear_cross_entropy(
                    xs, ws, t, group=group, bias_local=bs, vocab_size=v, **k), **kw, **extra)
                assert par[0] == one[0] and par[0], (par[0], one[0], kw, extra)
                assert all(torch.equal(a, c) for a, c in zip(par[1], one[1])), (kw, extra)
                assert torch.equal(par[2], one[2]), (kw, extra)
                assert torch.equal(par[3][:v], one[3][:v]) and (par[3][v:] == 0).all()
                assert torch.equal(par[4][:v], one[4][:v]) and (par[4][v:] == 0).all()
        logits = torch.randn(n, v, generator=g) * 4
        for kw in (dict(), dict(reduction="none", label_smoothing=0.2, return_lse=True)):
            one = run(lambda xs, ws, bs, **k: flce.cross_entropy(logits * ws.sum(), t, **k), **kw)
            par = run(lambda xs, ws, bs, **k: fp.cross_entropy(logits * ws.sum(), t,
                                                               group=group, **k), **kw)
            assert par[0] == one[0] == ["logits_forward"], (par[0], one[0])
            assert all(torch.equal(a, c) for a, c in zip(par[1], one[1])) and \
                torch.equal(par[3], one[3]), kw
        eps = 0.1 * v / (v - 1)  # Megatron's smoothing over V classes
        one = run(lambda xs, ws, bs: flce.cross_entropy(logits * ws.sum(), t, reduction="none",
                                                        label_smoothing=eps))
        par = run(lambda xs, ws, bs: fp.vocab_parallel_cross_entropy(logits * ws.sum(), t, 0.1,
                                                                     tp_group=group))
        assert par[0] == one[0] and torch.equal(par[1][0], one[1][0]) and \
            torch.equal(par[3], one[3])
        # This rank's bad argument: its own exception, at once (no exchange to bring it).
        _expect(ValueError, "flce: label_smoothing must be in [0, 1]",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                               label_smoothing=2.0))
        _expect(ValueError, "tile [0, V)",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                               vocab_start=3))
        # (True was taken as a vocabulary of 1, and a return_lse of "no" as True)
        _expect(ValueError, "vocab_size must be a positive int64",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                               vocab_size=True))
        _expect(TypeError, "return_lse must be True or False",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                               return_lse="no"))
        _expect(ValueError, "ignore_index is not supported with probability targets",
                lambda: fp.cross_entropy(logits, torch.softmax(logits, 1), group=group,
                                         ignore_index=0))
        _expect(ValueError, "not differentiable",
                lambda: fp.cross_entropy(logits, t, group=group, label_smoothing=0.1,
                                         class_weight=torch.rand(v, requires_grad=True)))
    finally:
        restore()


def check_group_errors(rank, world, group):
    """A wrong group= is refused before any collective where this rank can tell; groups whose
    members differ across ranks that met in the exchange raise on every rank."""
    import torch.distributed as dist

    import flce.parallel as fp

    x, w = torch.randn(5, 4), torch.randn(3, 4)
    t = torch.zeros(5, dtype=torch.int64)
    for bad in ("tp", 0, dist):
        _expect(TypeError, "group must be a torch.distributed ProcessGroup",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=bad))
        _expect(TypeError, "group must be a torch.distributed ProcessGroup",
                lambda: fp.cross_entropy(w, t[:3], group=bad))
    # new_group on every rank; rank 0 alone is in it: a world of one rank there, no collective
    solo = dist.new_group([0])
    if rank == 0:
        check_one_rank(solo)
    else:
        _expect(ValueError, f"global rank {rank} is not a member of group",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=solo))
        _expect(ValueError, f"global rank {rank} is not a member of group",
                lambda: fp.vocab_parallel_cross_entropy(w[None], t[None, :3], tp_group=solo))
    # One rank's group has other members than the others' (the exchange met over it): every
    # rank raises. (Standing in for a group object whose members a rank sees otherwise.)
    real = fp._group_fingerprint
    if rank == world - 1:
        fp._group_fingerprint = lambda grp: [real(grp)[0], real(grp)[1] + 1]
    try:
        _expect(ValueError, "disagree on group members",
                lambda: fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group))
        _expect(ValueError, "disagree on group members",
                lambda: fp.cross_entropy(w, t[:3], group=group))
    finally:
        fp._group_fingerprint = real
    fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group)  # the group still works


def check_megatron_dropin(rank, world, group):
    """vocab_parallel_cross_entropy vs Megatron's algorithm and float64: equal below the
    collapse margin, accurate above it where Megatron returns 0; -100 rows zeroed; logits
    untouched; bf16 upcast; same eager and compiled."""
    import flce.parallel as fp
    from flce import reference

    seq, batch, part = 24, 4, 40
    v = part * world
    x64, w64, t = _margin_inputs(seq * batch, v, 16, seed=40)
    logits64 = x64 @ w64.T
    margin = _margins(x64, w64, t)
    g = torch.Generator().manual_seed(41)
    t[torch.rand(t.shape, generator=g) < 0.1] = -100
    upstream = (torch.rand(seq, batch, generator=g) + 0.5)
    sl = slice(rank * part, (rank + 1) * part)
    valid = t != -100

    def grads(fn, logits_full, dtype):
        local = logits_full[:, sl].to(dtype).reshape(seq, batch, part).detach().requires_grad_()
        before = local.detach().clone()
        loss = fn(local, t.reshape(seq, batch))
        (loss * upstream).sum().backward()
        assert torch.equal(local.detach(), before), "input logits modified"
        return loss.detach().reshape(-1), local.grad.reshape(-1, part)

    for dtype in (torch.float32, torch.bfloat16):
        lp = logits64.to(dtype)
        ref_in = lp.double().requires_grad_()
        ref = reference.logits_cross_entropy(ref_in, t, reduction="none")
        (ref * upstream.reshape(-1)).sum().backward()
        ref_grad = ref_in.grad[:, sl]
        ours = grads(lambda l, tt: fp.vocab_parallel_cross_entropy(l, tt, tp_group=group), lp, dtype)
        meg = grads(lambda l, tt: megatron_cross_entropy(l, tt, group), lp, dtype)
        assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype
        # Ignored labels: exactly zero loss and gradient (Megatron: finite, nonzero).
        assert (ours[0][~valid] == 0).all() and (ours[1][~valid] == 0).all()
        assert torch.isfinite(meg[0]).all()
        low = valid & (margin < 8)
        high = valid & (margin > 30) & (margin < 70)
        assert low.sum() >= 5 and high.sum() >= 5, (low.sum(), high.sum())
        # Below the collapse margin: as accurate as Megatron (within fp32 rounding).
        e_ours, e_meg = _elementwise_rel(ours[0][low], ref[low]), _elementwise_rel(meg[0][low], ref[low])
        assert e_ours <= 2 * max(e_meg, 4 * F32_ULP), (e_ours, e_meg)
        # Gradients: p_j = exp(z_j - lse) with the row's lse rounded to fp32, as in the fused
        # kernels (math.h logit_grad), adds |lse| * 2^-24 relative to Megatron's
        # exp(z_j - max) / sum_exp; beyond that they agree.
        rows = low.nonzero()[:, 0]
        lse_ulp = torch.logsumexp(logits64[rows], 1).abs().max().item() * F32_ULP
        e_ours = _rel_err(ours[1][rows], ref_grad[rows])
        e_meg = _rel_err(meg[1][rows], ref_grad[rows])
        bound = 2 * max(e_meg, _floor(ref_grad[rows], dtype)) + 2 * lse_ulp
        assert e_ours <= bound, (e_ours, e_meg, lse_ulp)
        # Above it: Megatron's lse - z_t is 0 (relative error 1); ours stays accurate.
        e_ours = _elementwise_rel(ours[0][high], ref[high])
        e_meg = _elementwise_rel(meg[0][high], ref[high])
        assert e_ours < 1e-3 and e_meg > 0.5, (e_ours, e_meg)
        # The whole gradient, collapse rows included, within the rounding floor of the output.
        lse_ulp = torch.logsumexp(logits64[valid], 1).abs().max().item() * F32_ULP
        e_grad, floor = _rel_err(ours[1][valid], ref_grad[valid]), _floor(ref_grad[valid], dtype)
        assert e_grad <= 2 * floor + 2 * lse_ulp, (e_grad, floor, lse_ulp)
        if dtype == torch.float32:
            # Target-column gradient at collapse margins: -sigmoid(lse_x - z_t), nonzero.
            owned = high & (t >= rank * part) & (t < (rank + 1) * part)
            if owned.any():
                r = owned.nonzero()[:, 0]
                col = (t[r] - rank * part)[:, None]
                got, want = ours[1][r].gather(1, col), ref_grad[r].gather(1, col)
                assert (got != 0).all() and _elementwise_rel(got, want) < 1e-3
                assert (meg[1][r].gather(1, col) == 0).all()
    # Label smoothing: Megatron's convention = torch's with eps = alpha V / (V - 1), global V.
    alpha = 0.1
    ref = reference.logits_cross_entropy(logits64, t, reduction="none",
                                         label_smoothing=alpha * v / (v - 1))
    lsm = fp.vocab_parallel_cross_entropy(logits64[:, sl].float().reshape(seq, batch, part),
                                          t.reshape(seq, batch), alpha, group)
    assert _rel_err(lsm.reshape(-1), ref) < 8 * F32_ULP
    # torch.compile traces it (dynamo + AOT autograd; the aot_eager backend skips inductor's
    # C++ build, which costs ~20 s here) and gives the eager result.
    if world != 2:
        return  # once is enough: importing and tracing with dynamo takes seconds
    fn = lambda l, tt: fp.vocab_parallel_cross_entropy(l, tt, 0.05, tp_group=group)
    eager = grads(fn, logits64, torch.float32)
    torch._dynamo.reset()
    compiled = grads(torch.compile(fn, backend="aot_eager", fullgraph=False), logits64,
                     torch.float32)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), _rel_err(a, b)


def check_megatron_unequal_shards(rank, world, group):
    """vocab_parallel_cross_entropy with shards of different sizes: without vocab_start every
    rank raises (its offset would be rank * its own size), also once the layout is cached; with
    vocab_start the loss and gradient match float64, in rank order and reversed; an empty shard
    raises on every rank instead of leaving the others waiting in the all-gather."""
    import flce.parallel as fp
    from flce import reference

    sizes = [24 * (r + 1) for r in range(world)]  # 24/48 on 2 ranks
    v, seq, batch = sum(sizes), 12, 4
    x64, w64, t = _margin_inputs(seq * batch, v, 16, seed=60)
    logits = (x64 @ w64.T).float()
    margin = _margins(x64, w64, t)
    g = torch.Generator().manual_seed(61)
    t[torch.rand(t.shape, generator=g) < 0.1] = -100
    upstream = torch.rand(seq * batch, generator=g) + 0.5
    valid = t != -100
    tt = t.reshape(seq, batch)
    in_order = sum(sizes[:rank])

    def local(start):
        return logits[:, start:start + sizes[rank]].reshape(seq, batch, -1)

    for _ in range(2):
        _expect(ValueError, f"{sizes} columns (by rank)",
                lambda: fp.vocab_parallel_cross_entropy(local(in_order), tt, tp_group=group))
    for alpha in (0.0, 0.1):
        eps = alpha * v / (v - 1)
        ref_in = logits.double().requires_grad_()
        ref = reference.logits_cross_entropy(ref_in, t, reduction="none", label_smoothing=eps)
        (ref * upstream).sum().backward()
        for start in (in_order, sum(sizes[rank + 1:])):  # rank order, then reversed
            lp = local(start).detach().requires_grad_()
            loss = fp.vocab_parallel_cross_entropy(lp, tt, alpha, group, vocab_start=start)
            (loss.reshape(-1) * upstream).sum().backward()
            loss, grad = loss.detach().reshape(-1), lp.grad.reshape(seq * batch, -1)
            ref_grad = ref_in.grad[:, start:start + sizes[rank]]
            assert (loss[~valid] == 0).all() and (grad[~valid] == 0).all()
            # Margins up to 80: the loss exp(-margin) is still a normal fp32 number.
            rows = valid & (margin < 80)
            assert (margin[rows] > 30).sum() >= 3, margin[rows]
            assert _elementwise_rel(loss[rows], ref[rows]) < 1e-3
            assert _rel_err(loss, ref) < 8 * F32_ULP, _rel_err(loss, ref)
            lse_ulp = torch.logsumexp(logits[valid].double(), 1).abs().max().item() * F32_ULP
            e_grad, floor = _rel_err(grad[valid], ref_grad[valid]), _floor(ref_grad[valid])
            assert e_grad <= 2 * floor + 2 * lse_ulp, (e_grad, floor, lse_ulp)
    # Shapes no call has used yet (a rank whose call matches a cached layout skips the exchange).
    _expect(ValueError, "on every rank or on none",
            lambda: fp.vocab_parallel_cross_entropy(local(in_order)[:6], tt[:6], tp_group=group,
                                                    vocab_start=0 if rank == 0 else None))
    cols = v if rank == 0 else 0
    _expect(ValueError, "empty vocabulary shard",
            lambda: fp.vocab_parallel_cross_entropy(logits[:8, :cols], t[:8], tp_group=group))


def check_fused_compiled(rank, world, group):
    """The fused path under torch.compile (aot_eager) gives the eager result bitwise."""
    import flce.parallel as fp

    if world != 2:
        return
    x64, w64, t = _margin_inputs(32, 40 * world, 16, seed=50)
    wl = w64.float()[rank * 40:(rank + 1) * 40]

    def f(x, w):
        return fp.vocab_parallel_linear_cross_entropy(x, w, t, group=group, label_smoothing=0.1,
                                                      z_loss=1e-3)

    out = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        x, w = x64.float().requires_grad_(), wl.clone().requires_grad_()
        loss = fn(x, w)
        loss.backward()
        out.append((loss.detach(), x.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*out))


def check_accuracy_and_shift(rank, world, group):
    """return_accuracy and shift over the shards: the accuracy from the combined statistics
    against the argmax of the full logits (every rank gets the same), and shift=True against the
    single-process loss of the sliced hidden states and labels."""
    import flce
    import flce.parallel as P

    g = torch.Generator().manual_seed(31)
    b, t_len, d, rows = 3, 9, 16, 40
    v = rows * world
    x = torch.randn(b, t_len, d, generator=g)
    w_full = torch.randn(v, d, generator=g) / d ** 0.5
    t = torch.randint(0, v, (b, t_len), generator=g)
    z = x @ w_full.T
    pick = torch.rand(b, t_len, generator=g) < 0.5
    t = torch.where(pick, z.argmax(-1), t)
    t[0, 3] = -100
    w = w_full[rank * rows:(rank + 1) * rows]
    for reduction in ("mean", "sum", "none"):
        loss, acc = P.vocab_parallel_linear_cross_entropy(x, w, t, group=group,
                                                          reduction=reduction,
                                                          return_accuracy=True)
        hit = ((z.argmax(-1) == t) & (t != -100)).float()
        ref = {"mean": hit.sum() / (t != -100).sum(), "sum": hit.sum(), "none": hit}[reduction]
        assert torch.equal(acc, ref), (reduction, acc, ref)
    for logits_path in (False, True):
        xs = x.clone().requires_grad_()
        if logits_path:
            shard = (xs @ w.T).reshape(-1, rows)
            got = P.cross_entropy(shard, t.reshape(-1), group=group, reduction="sum",
                                  return_accuracy=True)[1]
            hit = ((z.argmax(-1) == t) & (t != -100)).float().sum()
            assert torch.equal(got, hit), (got, hit)
            continue
        loss = P.vocab_parallel_linear_cross_entropy(xs, w, t, group=group, reduction="sum",
                                                     shift=True)
        loss.backward()
        xr = x.clone().requires_grad_()
        ref = flce.linear_cross_entropy(xr[:, :-1], w_full, t[:, 1:], reduction="sum")
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)
        assert torch.all(xs.grad[:, -1] == 0)
    # An integer shift (Cut Cross Entropy's): per-token outputs (..., T - k)
    got = P.vocab_parallel_linear_cross_entropy(x, w, t, group=group, reduction="none", shift=2,
                                                return_lse=True)
    ref = flce.linear_cross_entropy(x[:, :-2], w_full, t[:, 2:], reduction="none",
                                    return_lse=True)
    assert got.loss.shape == got.lse.shape == (b, t_len - 2)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-5, atol=1e-6)


def check_class_weights(rank, world, group):
    """Per-class weights of the whole vocabulary, replicated, over the shards: the loss and the
    gradients of the single-process call with the full classifier, both entry points; a wrong
    length raises on every rank (the length travels in the exchange)."""
    import flce
    import flce.parallel as P

    g = torch.Generator().manual_seed(41)
    n, d, rows = 30, 12, 24
    v = rows * world
    x = torch.randn(n, d, generator=g)
    w_full = torch.randn(v, d, generator=g) / d ** 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    cw = torch.rand(v, generator=g) + 0.25
    sl = slice(rank * rows, (rank + 1) * rows)
    for reduction in ("mean", "sum", "none"):
        xs, ws = x.clone().requires_grad_(), w_full[sl].clone().requires_grad_()
        loss = P.vocab_parallel_linear_cross_entropy(xs, ws, t, group=group, class_weight=cw,
                                                     reduction=reduction, z_loss=1e-3)
        loss.sum().backward()
        xr, wr = x.clone().requires_grad_(), w_full.clone().requires_grad_()
        ref = flce.linear_cross_entropy(xr, wr, t, class_weight=cw, reduction=reduction,
                                        z_loss=1e-3)
        ref.sum().backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ws.grad, wr.grad[sl], rtol=1e-4, atol=1e-6)
        logits = (x @ w_full.T)[:, sl].contiguous()
        got = P.cross_entropy(logits, t, group=group, class_weight=cw, reduction=reduction)
        torch.testing.assert_close(got, flce.cross_entropy(x @ w_full.T, t, cw,
                                                           reduction=reduction),
                                   rtol=1e-5, atol=1e-6)
    bad = cw[:-1] if rank == 0 else cw
    try:
        P.vocab_parallel_linear_cross_entropy(x, w_full[sl], t, group=group, class_weight=bad)
    except ValueError as e:
        assert "class weights" in str(e) or "class_weight" in str(e), e
    else:
        raise AssertionError("a class_weight of another length on rank 0 was accepted")

def check_distributions(rank, world, group):
    """Probability targets (this shard's columns of them) and class weights with label smoothing
    over the shards, both entry points: the loss, lse, entropy and gradients of the
    single-process call, every reduction; the pivot (the row's largest logit) in any shard."""
    import flce
    import flce.parallel as P

    g = torch.Generator().manual_seed(43)
    n, d, rows = 30, 12, 40
    v = rows * world
    x = torch.randn(n, d, generator=g)
    w_full = torch.randn(v, d, generator=g) / d ** 0.5
    b_full = torch.randn(v, generator=g) * 0.1
    q = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    cw = torch.rand(v, generator=g) + 0.25
    sl = slice(rank * rows, (rank + 1) * rows)
    cases = [dict(target=q, local=q[:, sl].contiguous(), opts=dict(z_loss=1e-3)),
             dict(target=q, local=q[:, sl].contiguous(),
                  opts=dict(label_smoothing=0.1, class_weight=cw, softcap=5.0)),
             dict(target=t, local=t, opts=dict(label_smoothing=0.2, class_weight=cw,
                                               z_loss=1e-3))]
    for case in cases:
        for reduction in ("mean", "sum", "none"):
            kw = dict(case["opts"], reduction=reduction, return_lse=True, return_entropy=True)
            xs = x.clone().requires_grad_()
            ws, bs = w_full[sl].clone().requires_grad_(), b_full[sl].clone().requires_grad_()
            got = P.vocab_parallel_linear_cross_entropy(xs, ws, case["local"], group=group,
                                                        bias_local=bs, **kw)
            sum(o.sum() for o in got).backward()
            xr, wr, br = (a.clone().requires_grad_() for a in (x, w_full, b_full))
            ref = flce.linear_cross_entropy(xr, wr, case["target"], bias=br, **kw)
            sum(o.sum() for o in ref).backward()
            for a, r in zip(got, ref):
                torch.testing.assert_close(a, r, rtol=2e-5, atol=1e-6)
            torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(ws.grad, wr.grad[sl], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(bs.grad, br.grad[sl], rtol=1e-4, atol=1e-6)
            z = (x @ w_full.T + b_full).detach()
            zl = z[:, sl].contiguous().requires_grad_()
            ce_kw = {k: v for k, v in kw.items() if k != "class_weight"}
            got = P.cross_entropy(zl, case["local"], group=group,
                                  class_weight=case["opts"].get("class_weight"), **ce_kw)
            sum(o.sum() for o in got).backward()
            zr = z.clone().requires_grad_()
            ref = flce.cross_entropy(zr, case["target"], case["opts"].get("class_weight"),
                                     **ce_kw)
            sum(o.sum() for o in ref).backward()
            for a, r in zip(got, ref):
                torch.testing.assert_close(a, r, rtol=2e-5, atol=1e-6)
            torch.testing.assert_close(zl.grad, zr.grad[:, sl], rtol=1e-4, atol=1e-7)
    # One row: the packed pivot's columns of a [1, 9] state are a "contiguous" view at an odd
    # float offset (the backward's int64 view of them raised).
    xs, ws = x[:1].clone().requires_grad_(), w_full[sl].clone().requires_grad_()
    got = P.vocab_parallel_linear_cross_entropy(xs, ws, q[:1, sl].contiguous(), group=group)
    got.backward()
    xr, wr = x[:1].clone().requires_grad_(), w_full.clone().requires_grad_()
    ref = flce.linear_cross_entropy(xr, wr, q[:1])
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ws.grad, wr.grad[sl], rtol=1e-4, atol=1e-6)
    zl = (x[:1] @ w_full[sl].T).detach().requires_grad_()
    P.cross_entropy(zl, q[:1, sl].contiguous(), group=group).backward()
    zr = (x[:1] @ w_full.T).detach().requires_grad_()
    flce.cross_entropy(zr, q[:1]).backward()
    torch.testing.assert_close(zl.grad, zr.grad[:, sl], rtol=1e-4, atol=1e-7)
    # The last rank's shard empty: its [n, 0] probabilities and logits (which raised on that
    # rank alone, an IndexError or a RuntimeError of reshape, while the others waited for it
    # in the exchange until gloo's timeout).
    cut = slice(rank * v // (world - 1), (rank + 1) * v // (world - 1)) if rank < world - 1 \
        else slice(v, v)
    xs, ws = x.clone().requires_grad_(), w_full[cut].clone().requires_grad_()
    got = P.vocab_parallel_linear_cross_entropy(xs, ws, q[:, cut].contiguous(), group=group)
    got.backward()
    xr = x.clone().requires_grad_()
    ref = flce.linear_cross_entropy(xr, w_full, q)
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
    assert ws.grad.shape == (ws.shape[0], d)
    z = (x @ w_full.T).detach()
    zl = z[:, cut].contiguous().requires_grad_()
    got = P.cross_entropy(zl, q[:, cut].contiguous(), group=group, reduction="none")
    got.sum().backward()
    zr = z.clone().requires_grad_()
    ref = flce.cross_entropy(zr, q, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(zl.grad, zr.grad[:, cut], rtol=1e-4, atol=1e-7)
    # Vocabulary padding (3 rows past vocab_size) at the end of the second-to-last rank's shard,
    # and the last rank's shard empty, after it: with class weights, the last rank's slice of
    # them started past the vocabulary (an IndexError on that rank alone).
    pad = torch.randn(3, d, generator=g) / d ** 0.5
    w_local, q_local = w_full[cut], q[:, cut]
    if rank == world - 2:
        w_local, q_local = torch.cat([w_local, pad]), torch.cat([q_local, torch.zeros(n, 3)], 1)
    for target, local in ((q, q_local), (t, t)):
        xs, ws = x.clone().requires_grad_(), w_local.clone().requires_grad_()
        got = P.vocab_parallel_linear_cross_entropy(xs, ws, local.contiguous(), group=group,
                                                    vocab_size=v, class_weight=cw,
                                                    label_smoothing=0.1)
        got.backward()
        xr = x.clone().requires_grad_()
        ref = flce.linear_cross_entropy(xr, w_full, target, class_weight=cw, label_smoothing=0.1)
        ref.backward()
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
        assert rank != world - 2 or not ws.grad[-3:].any()


def check_dtensor_distributions(rank, world, group):
    """Probability targets with a DTensor classifier Shard(0) (uneven chunks) and with DTensor
    logits Shard(-1): the targets a plain tensor (the whole distribution on every rank) or a
    DTensor (Replicate, Shard(-1)); the loss and the gradients those of the single-process call.
    Targets that require grad are refused (the shards' ops have no gradient for them)."""
    if world != 2:
        return  # once: the first DTensor op costs seconds of CPU per rank
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    import flce

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(47)
    n, d, v = 24, 10, 48 * world - 5  # torch.chunk sharding: the last shard is short
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / d ** 0.5
    q = torch.softmax(torch.randn(n, v, generator=g) * 3, 1)
    cw = torch.rand(v, generator=g) + 0.25
    opts = dict(label_smoothing=0.1, class_weight=cw, z_loss=1e-3)
    xr, wr = (a.clone().requires_grad_() for a in (x, w))
    ref = flce.linear_cross_entropy(xr, wr, q, **opts)
    ref.backward()
    z = (x @ w.T).detach()
    zr = z.clone().requires_grad_()
    ref_ce = flce.cross_entropy(zr, q, cw, label_smoothing=0.1, z_loss=1e-3)
    ref_ce.backward()
    for form in ("plain", "replicate", "shard"):
        qs = q if form == "plain" else \
            distribute_tensor(q, mesh, [Replicate() if form == "replicate" else Shard(-1)])
        xs = x.clone().requires_grad_()
        ws = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        loss = flce.linear_cross_entropy(xs, ws, qs, **opts)
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=2e-6, atol=0)
        for name, got, want in (("dE", xs.grad, xr.grad), ("dC", ws.grad.full_tensor(), wr.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{form} {name}")
        zs = distribute_tensor(z, mesh, [Shard(-1)]).requires_grad_()
        loss = flce.cross_entropy(zs, qs, cw, label_smoothing=0.1, z_loss=1e-3)
        loss.backward()
        torch.testing.assert_close(loss, ref_ce, rtol=2e-6, atol=0)
        assert tuple(zs.grad.placements) == (Shard(1),), zs.grad.placements
        torch.testing.assert_close(zs.grad.full_tensor(), zr.grad, rtol=1e-5, atol=1e-7)
    # Class weights as a DTensor beside DTensor logits, as torch's loss_parallel takes them (they
    # were refused: "mixed torch.Tensor and DTensor"), with probability and class targets.
    t = torch.randint(0, v, (n,), generator=g)
    for tgt in (q, t):
        zr = z.clone().requires_grad_()
        ref_ce = flce.cross_entropy(zr, tgt, cw, label_smoothing=0.1)
        ref_ce.backward()
        for placement in (Replicate(), Shard(0)):
            zs = distribute_tensor(z, mesh, [Shard(-1)]).requires_grad_()
            loss = flce.cross_entropy(zs, tgt, distribute_tensor(cw, mesh, [placement]),
                                      label_smoothing=0.1)
            loss.backward()
            torch.testing.assert_close(loss, ref_ce, rtol=2e-6, atol=0)
            torch.testing.assert_close(zs.grad.full_tensor(), zr.grad, rtol=1e-5, atol=1e-7)
    # Clear errors: probabilities over another number of classes than the classifier's, and
    # targets that require grad (the single-device call differentiates them; the shards do not).
    ws = distribute_tensor(w, mesh, [Shard(0)])
    _expect(ValueError, "target", lambda: flce.linear_cross_entropy(x, ws, q[:, :-3].contiguous()))
    qg = q.clone().requires_grad_()
    _expect(ValueError, "require grad", lambda: flce.linear_cross_entropy(x, ws, qg, **opts))
    zs = distribute_tensor(z, mesh, [Shard(-1)])
    _expect(ValueError, "require grad", lambda: flce.cross_entropy(zs, qg, cw))


def _argmax_want(z64, t, ignore_index=-100):
    """torch.argmax of float64 logits, -1 for ignored targets and rows with a NaN."""
    bad = torch.isnan(z64).any(-1) | (t == ignore_index)
    return torch.where(bad, -1, z64.argmax(-1))


def check_predicted_tokens(rank, world, group, dtensor=True):
    """return_predicted_tokens over vocabulary shards, against torch.argmax of the float64 full
    logits, the same on every rank: uneven shards (an empty one at world 3), exact ties across a
    shard boundary (integer inputs: exact fp32 logits; the lower column wins, also where the
    shards are not in rank order), a tie with the target, ignore_index, a bias, the softcap and
    temperature, shift, NaN on one rank, both entry points and the DTensor ones. The loss is the
    call's without the option, bitwise. (test_parallel_cuda.py runs it on the emulated CUDA
    backend, without the DTensor entry points.)"""
    import flce
    import flce.parallel as P

    sizes = {2: [34, 29], 3: [34, 0, 29]}[world]
    v, n, d = sum(sizes), 40, 8
    start = sum(sizes[:rank])
    g = torch.Generator().manual_seed(41)
    x = torch.randint(-2, 3, (n, d), generator=g).float()
    w = torch.randint(-2, 3, (v, d), generator=g).float()
    e0 = (torch.arange(d) == 0).float()
    w[5] = w[v - 3] = 50.0 * e0  # a tie 3 columns from each end: rank 0's and the last rank's
    x[:16, 0] = 3.0
    b = torch.zeros(v)
    b[::5] = 1.0
    z = x.double() @ w.double().T
    t = torch.randint(0, v, (n,), generator=g)
    t[::6] = -100
    t[1], t[3] = v - 3, 5  # tied with the row's argmax: the later and the earlier column
    want = _argmax_want(z, t)
    assert want[1] == 5 and (want[:16] == 5).sum() >= 12
    mine = slice(start, start + sizes[rank])
    kw = dict(group=group, reduction="none", return_predicted_tokens=True)
    for opts in (dict(), dict(softcap=500.0, temperature=0.5, label_smoothing=0.1)):
        out = P.vocab_parallel_linear_cross_entropy(x, w[mine], t, **kw, **opts)
        assert out._fields == ("loss", "predicted_tokens")
        assert torch.equal(out.predicted_tokens, want), (opts, out.predicted_tokens, want)
        ref = P.vocab_parallel_linear_cross_entropy(x, w[mine], t, group=group,
                                                    reduction="none", **opts)
        assert torch.equal(out.loss, ref)
        got = P.cross_entropy((x @ w[mine].T), t, **kw, **opts).predicted_tokens
        assert torch.equal(got, want), (opts, got, want)
    # A bias, mean reduction, return_lse and accuracy beside
    out = P.vocab_parallel_linear_cross_entropy(x, w[mine], t, group=group, bias_local=b[mine],
                                                return_lse=True, return_accuracy=True,
                                                return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, _argmax_want(z + b.double(), t))
    # shift: (..., T - 1), the targets shifted
    x3, t3 = x.reshape(4, 10, d), t.reshape(4, 10)
    got = P.vocab_parallel_linear_cross_entropy(x3, w[mine], t3, shift=True, **kw)
    shifted = torch.cat([t3[:, 1:], torch.full((4, 1), -100)], 1)
    assert torch.equal(got.predicted_tokens,
                       _argmax_want(z.reshape(4, 10, v), shifted)[:, :-1])
    # The shards in reverse rank order (vocab_start): the lower column still wins the tie (an
    # empty shard shares its start with the next shard, as a layout by cumulative sizes gives)
    rstart = sum(sizes[rank + 1:])
    rmine = slice(rstart, rstart + sizes[rank])
    got = P.cross_entropy((x @ w[rmine].T), t, vocab_start=rstart, **kw).predicted_tokens
    assert torch.equal(got, want)
    # ignore_index other than -100 (every ignored row -1), and a NaN on one rank's columns
    t7 = torch.where(t == -100, 7, t)
    got = P.cross_entropy((x @ w[mine].T), t7, ignore_index=7, **kw).predicted_tokens
    assert torch.equal(got, _argmax_want(z, t7, 7))
    zn = z.clone()
    zn[2, v - 1] = zn[9, 0] = float("nan")  # the last rank's column, rank 0's
    zl = zn[:, mine].float()
    got = P.cross_entropy(zl, t, **kw).predicted_tokens
    assert torch.equal(got, _argmax_want(zn, t)) and got[2] == -1 and got[9] == -1
    # The DTensor entry points (once: the first DTensor op costs seconds of CPU per rank)
    if world == 2 and dtensor:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        wd = distribute_tensor(w, mesh, [Shard(0)])  # (torch.chunk: 32 + 31 rows)
        out = flce.linear_cross_entropy(x, wd, t, return_predicted_tokens=True)
        assert torch.equal(out.predicted_tokens, want)
        zd = distribute_tensor((x @ w.T), mesh, [Shard(1)])
        out = flce.cross_entropy(zd, t, return_predicted_tokens=True, reduction="sum")
        assert torch.equal(out.predicted_tokens, want)


def run_checks(rank, world):
    import time

    import torch.distributed as dist

    t0 = time.perf_counter()

    group = dist.group.WORLD
    configs = [
        dict(shards="even"),
        dict(shards="uneven", bias=True, reduction="sum"),
        dict(shards="uneven", reduction="none", seed=3),
        dict(shards="even", label_smoothing=0.1, z_loss=1e-3, reduction="mean", seed=4),
        dict(shards="uneven", vocab_size=64 * world - 37, bias=True, label_smoothing=0.05, seed=5),
        dict(shards="even", softcap=30.0, reduction="none", bias=True, seed=6),
        dict(shards="uneven", ignore_index=7, z_loss=1e-2, reduction="sum", seed=7),
        dict(shards="even", seq_par=True, reduction="none", bias=True, seed=8),
        dict(shards="uneven", seq_par=True, label_smoothing=0.1, seed=9),
        dict(shards="even", dtype=torch.bfloat16, seed=10),
        # bf16 activations with fp32 master weights (dC comes out in fp32).
        dict(shards="uneven", dtype=torch.bfloat16, weight_dtype=torch.float32, bias=True,
             vocab_size=64 * world - 9, seed=12),
        # The last rank's shard is all padding (and its neighbour's partly).
        dict(shards="even", vocab_size=64 * (world - 1) - 3, bias=True, reduction="none",
             label_smoothing=0.1, seed=13),
        # Every target in rank 0's shard: the other ranks own none.
        dict(shards="even", target_in=lambda t, sizes: t % sizes[0], reduction="none", seed=11),
    ]
    for cfg in configs:
        ratios = check_fused(rank, world, group, **cfg)
        if rank == 0:
            print(f"{time.perf_counter() - t0:.1f}s", cfg,
                  {k: round(v, 2) for k, v in ratios.items()}, flush=True)
    for check in (check_all_ignored, check_input_grad_left_to_caller, check_input_grad_rounded_once,
                  check_rank_disagreement,
                  check_group_errors, check_megatron_dropin, check_megatron_unequal_shards, check_fused_compiled,
                  check_dtensor, check_torchtitan_dropin, check_accuracy_and_shift,
                  check_class_weights, check_distributions, check_dtensor_distributions,
                  check_exact_bf16_grad):
        check(rank, world, group)
        if rank == 0:
            print(f"{time.perf_counter() - t0:.1f}s", check.__name__, "ok", flush=True)
    print("ALL CHECKS PASSED", flush=True)


def _worker_main():
    from dist_launch import finish_worker, init_worker

    rank, world = init_worker()
    if "--predicted" in sys.argv:
        import torch.distributed as dist

        check_predicted_tokens(rank, world, dist.group.WORLD)
        print("ALL CHECKS PASSED", flush=True)
    else:
        run_checks(rank, world)
    finish_worker()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main()

