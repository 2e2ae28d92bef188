"""flce.parallel.vocab_parallel_linear_distillation over gloo (CPU), against float64
(flce.reference.distillation) and the single-process flce.linear_distillation.

One launch per world size runs every check of this file (tests/dist_launch.py; world 2 with
uneven shards, world 3 with an empty one): every divergence and beta, temperature, the hard
term with ignored targets, reductions, biases, shift, shards in reverse order, vocabulary
padding, student and teacher of other hidden sizes, bf16 inputs with fp32 master weights, float64,
the teacher with and without gradients; the collapse (both models on one class, margins up to
100, the target on another rank than the dominant class); ties of the dominant class across a
shard boundary and a NaN on one rank; reduce_input_grad=False; NaN-poisoned buffers; ranks that
disagree. Tolerances as test_parallel.py's: an error against float64 within (1 + world) times
the single-process call's error or the rounding floor, whichever is larger.
"""
import contextlib
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_launch import run_checked  # noqa: E402

HERE = os.path.abspath(__file__)
DS, DT = 16, 24
F32_EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_distillation(world):
    run_checked(HERE, world, timeout=150.0)


# ---------------------------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------------------------
def _sizes(world, v_rows):
    """Uneven shard sizes in rank order (world 3: the middle shard empty)."""
    if world == 2:
        return [v_rows // 2 + 5, v_rows - v_rows // 2 - 5]
    return [v_rows // 2 - 3, 0, v_rows - v_rows // 2 + 3]


def _inputs(lead, v_rows, dtype, seed, bias):
    """Fresh random full tensors (xs, ws, xt, wt, bs, bt, t): 16-bit inputs get fp32 master
    weights; logits of standard deviation about 2."""
    g = torch.Generator().manual_seed(seed)
    wdt = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    def r(shape, dt, s):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * s).to(dt)

    ss, st = 2 ** 0.5 / DS ** 0.25, 2 ** 0.5 / DT ** 0.25
    xs, ws = r(lead + (DS,), dtype, ss), r((v_rows, DS), wdt, ss)
    xt, wt = r(lead + (DT,), dtype, st), r((v_rows, DT), wdt, st)
    bs = r((v_rows,), wdt, 0.3) if bias else None
    bt = r((v_rows,), wdt, 0.3) if bias else None
    t = torch.randint(0, v_rows, lead, generator=g)
    return [xs, ws, xt, wt, bs, bt], t


def _run(fn, tensors, teacher_grad, upstream, reduction):
    """(loss, gradients of the six tensors) of fn(*leaves); the teacher's tensors require grad
    only with teacher_grad (a frozen teacher's, its hidden states from torch.no_grad, do not)."""
    leaves = [None if x is None else
              x.detach().clone().requires_grad_(teacher_grad or i in (0, 1, 4))
              for i, x in enumerate(tensors)]
    loss = fn(*leaves)
    (loss * upstream).sum().backward() if reduction == "none" else (loss * 1.7).backward()
    return loss.detach(), [None if x is None else x.grad for x in leaves]


def check_against_reference(rank, world, group, *, divergence="jsd", beta=0.5, temperature=1.0,
                            hard_weight=0.0, soft_weight=1.0, reduction="mean", bias=False,
                            dtype=torch.float32, teacher_grad=True, shift=False, reverse=False,
                            pad=0, ignore_index=-100, seed=0):
    """One configuration: loss and every gradient of the vocab-parallel call against the
    single-process call and float64."""
    import flce
    import flce.parallel as fp
    from flce import reference
    from test_parallel import _close_to_single

    v_rows = 40 * world
    sizes = _sizes(world, v_rows)
    vocab = v_rows - pad
    lead = (3, 8) if shift else (24,)
    tensors, t = _inputs(lead, v_rows, dtype, seed, bias)
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.where(torch.rand(lead, generator=g) < 0.25, ignore_index, t % vocab)
    k = int(shift)
    upstream = torch.rand(lead[:-1] + (lead[-1] - k,), generator=g) + 0.5
    start = sum(sizes[rank + 1:]) if reverse else sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    opts = dict(divergence=divergence, beta=beta, temperature=temperature,
                hard_weight=hard_weight, soft_weight=soft_weight, reduction=reduction)

    def real(w):  # the classifier without its padding rows
        return None if w is None else w[:vocab]

    def single(xs, ws, xt, wt, bs, bt):
        return flce.linear_distillation(xs, real(ws), xt, real(wt), t, student_bias=real(bs),
                                        teacher_bias=real(bt), shift=shift,
                                        ignore_index=ignore_index, **opts)

    def parallel(xs, ws, xt, wt, bs, bt):
        local = [None if w is None else w[sl] for w in (ws, wt, bs, bt)]
        return fp.vocab_parallel_linear_distillation(
            xs, local[0], xt, local[1], t, group=group, student_bias_local=local[2],
            teacher_bias_local=local[3], shift=shift, ignore_index=ignore_index,
            vocab_start=start if reverse else None, vocab_size=vocab if pad else None, **opts)

    def oracle(xs, ws, xt, wt, bs, bt):
        zs = xs @ real(ws).T + (0 if bs is None else real(bs))
        zt = xt @ real(wt).T + (0 if bt is None else real(bt))
        tt = t if not k else torch.cat([t[..., k:], torch.full_like(t[..., :k], ignore_index)], -1)
        loss = reference.distillation(zs.reshape(-1, vocab), zt.reshape(-1, vocab),
                                      tt.reshape(-1), ignore_index=ignore_index, **opts)
        return loss.reshape(lead)[..., :lead[-1] - k] if reduction == "none" else loss

    # float64 of the values flce computes with: each weight rounded to its input's dtype
    wide = [None if x is None else x.to(tensors[i - 1 if i in (1, 3) else i].dtype).double()
            for i, x in enumerate(tensors)]
    ref = _run(oracle, wide, teacher_grad, upstream.double(), reduction)
    one = _run(single, tensors, teacher_grad, upstream, reduction)
    par = _run(parallel, tensors, teacher_grad, upstream, reduction)
    what = f"{opts} dtype={dtype} bias={bias} shift={shift} pad={pad} reverse={reverse}"
    assert par[0].dtype == one[0].dtype and par[0].shape == one[0].shape, what
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight",
             "student_bias", "teacher_bias")
    if dtype == torch.float64:
        torch.testing.assert_close(par[0], ref[0], rtol=1e-12, atol=1e-14, msg=what)
    else:
        _close_to_single(f"loss {what}", par[0], one[0], ref[0], world)
    for i, name in enumerate(names):
        got, want, mid = par[1][i], ref[1][i], one[1][i]
        if want is None or (i in (2, 3, 5) and not teacher_grad):
            assert got is None, (name, what)
            continue
        rows = slice(None) if i in (0, 2) else sl
        got = got[rows]  # (a shard's rows: sliced from the whole tensor, whose leaf it is)
        assert got.dtype == mid.dtype, (name, got.dtype, mid.dtype)
        if dtype == torch.float64:
            torch.testing.assert_close(got, want[rows], rtol=1e-10, atol=1e-13,
                                       msg=f"{name}: {what}")
        else:
            _close_to_single(f"{name} {what}", got, mid[rows], want[rows], world, got.dtype)
        if i not in (0, 2):
            # padding rows: no distribution sees them, exactly zero gradient
            assert (got[max(0, vocab - start):] == 0).all(), (name, what)


def check_collapse(rank, world, group):
    """Both models dominant on one class (the same one, or the student on another) at margins
    0 to 100, the dominant class on rank 0's shard and the target on the last rank's: the
    fp32 loss within 1e-5 of float64 wherever it is a normal fp32 number, every gradient entry
    within a few roundings of its logits' scale (tests/api/test_distillation.py's
    test_collapse_sweep bounds; the hidden states are the logits, an identity classifier).
    The soft term alone (the hard one would hide its size) and with the hard term."""
    import flce.parallel as fp
    from flce import reference
    from flce.check import gen

    sizes = _sizes(world, 40 * world)
    v, n = sum(sizes), 12
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    eye = torch.eye(v)
    tiny = torch.finfo(torch.float32).tiny
    last = world - 1
    for same in (True, False):
        # 12 rows at each margin 0, 20, ..., 100
        g = gen(300 + same)
        margin = torch.arange(0, 101, 20.0).repeat_interleave(n)
        rows = torch.arange(margin.numel())
        zs, zt = (torch.randn(rows.numel(), v, generator=g) for _ in range(2))
        a = torch.randint(0, sizes[0], rows.shape, generator=g)  # rank 0's classes
        b = a if same else (a + 1) % sizes[0]
        zt[rows, a] += margin
        zs[rows, b] += margin * (1 + 0.1 * torch.rand(rows.shape, generator=g))
        target = sum(sizes[:last]) + torch.randint(0, sizes[last], rows.shape, generator=g)
        for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1),
                                 ("jsd", 0.5)):
            for hard in (0.0, 0.5):
                opts = dict(divergence=divergence, beta=beta, hard_weight=hard, reduction="none")
                xs, xt = zs.clone().requires_grad_(), zt.clone().requires_grad_()
                loss = fp.vocab_parallel_linear_distillation(xs, eye[sl], xt, eye[sl], target,
                                                             group=group, **opts)
                loss.sum().backward()
                s64, t64 = zs.double().requires_grad_(), zt.double().requires_grad_()
                ref = reference.distillation(s64, t64, target, **opts)
                ref.sum().backward()
                where = (same, divergence, beta, hard)
                normal = ref.abs() > tiny
                err = ((loss.double() - ref).abs() / ref.abs())[normal]
                assert not normal.any() or err.max() <= 1e-5, (where, err.max().item())
                assert ((loss.double() - ref).abs()[~normal] <= tiny).all(), where
                for what, got, want, z in (("student", xs.grad, s64.grad, zs),
                                           ("teacher", xt.grad, t64.grad, zt)):
                    scale = want.abs().amax(1, keepdim=True)
                    live = (scale > tiny / F32_EPS)[:, 0]
                    floor = 4 * F32_EPS * (1 + z.abs().amax(1, keepdim=True)) * scale
                    bad = ((got.double() - want).abs() > floor)[live]
                    assert not bad.any(), (what, where,
                                           ((got.double() - want).abs() / scale).max())


def check_ties_and_nan(rank, world, group):
    """The shards' argmax (flce.parallel._VocabShard) against torch.argmax of the whole row:
    exact ties across a shard boundary and across the shards' ends (the lowest column wins, as
    torch's; also with the shards in reverse order and an empty shard), a NaN on one rank
    (its column, a NaN value), all -inf. Then the loss of such rows against the single-process
    call, and a NaN on one rank's logits: that row's loss NaN on every rank, the others'
    finite."""
    import flce
    import flce.parallel as fp
    from flce import parallel

    sizes = _sizes(world, 40 * world)
    v, n = sum(sizes), 10
    g = torch.Generator().manual_seed(50)
    z = torch.randint(-3, 4, (n, v), generator=g).float()
    b0 = sizes[0]  # the first column of the next non-empty shard
    z[0, b0 - 1] = z[0, b0] = 9.0           # across the boundary
    z[1, 0] = z[1, v - 1] = 9.0             # the first shard's first column, the last's last
    z[2, [3, b0 + 2, v - 2]] = 9.0          # three ways
    z[3, b0] = z[3, b0 + 1] = 9.0           # within one shard
    z[4] = -math.inf                        # all -inf: column 0, as torch.argmax
    z[5, b0 + 1] = math.nan                 # a NaN on the second non-empty shard
    z[6, 2] = math.nan                      # on rank 0
    z[6, v - 1] = 9.0
    for reverse in (False, True):
        start = sum(sizes[rank + 1:]) if reverse else sum(sizes[:rank])
        layout = parallel._Layout(start, v, sizes[rank], None, tuple(sizes))
        shard = parallel._VocabShard(layout, group, world, parallel._Tokens())
        (a, m), = shard.argmax(z[:, start:start + sizes[rank]])
        want = z.argmax(1)
        assert torch.equal(a[:, 0], want), (reverse, a[:, 0], want)
        wm = z.gather(1, want[:, None])
        assert torch.equal(m.isnan(), wm.isnan()) and torch.equal(m[~m.isnan()], wm[~wm.isnan()])
    # The loss of tied rows: as one process's (tolerance: the sums' roundings)
    ws, wt = (torch.randint(-1, 2, (v, DS), generator=g).float() for _ in range(2))
    xs, xt = (torch.randint(-1, 2, (n, DS), generator=g).float() for _ in range(2))
    ws[b0 - 1] = ws[b0] = wt[b0 - 1] = wt[b0] = 0.0  # every logit 0 there: ties in every row
    ws[b0 - 1, 0] = ws[b0, 0] = wt[b0 - 1, 0] = wt[b0, 0] = 40.0
    xs[:, 0] = xt[:, 0] = 1.0
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    t = torch.randint(0, v, (n,), generator=g)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        kw = dict(divergence=divergence, hard_weight=0.3, reduction="none")
        got = fp.vocab_parallel_linear_distillation(xs, ws[sl], xt, wt[sl], t, group=group, **kw)
        one = flce.linear_distillation(xs, ws, xt, wt, t, **kw)
        torch.testing.assert_close(got, one, rtol=8 * F32_EPS, atol=0)
        xn = xs.clone()
        xn[4, 1] = math.nan
        got = fp.vocab_parallel_linear_distillation(xn, ws[sl], xt, wt[sl], t, group=group, **kw)
        assert got[4].isnan() and got[torch.arange(n) != 4].isfinite().all(), got
        # the NaN in one rank's logits alone (its own bias)
        bn = torch.zeros(sizes[rank])
        if rank == world - 1:
            bn[-1] = math.nan
        got = fp.vocab_parallel_linear_distillation(xs, ws[sl], xt, wt[sl], t, group=group,
                                                    teacher_bias_local=bn, **kw)
        assert got.isnan().all(), got


@contextlib.contextmanager
def _nan_poisoned_buffers():
    """torch.empty and Tensor.new_empty return NaN-filled floating tensors: a buffer element
    the chunk loop does not write shows."""
    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def poison(x):
        return x.fill_(math.nan) if x.is_floating_point() else x

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: poison(new_empty(self, *a, **k))
    try:
        yield
    finally:
        torch.empty, torch.Tensor.new_empty = empty, new_empty


def check_chunks_poisoned_and_input_grad(rank, world, group):
    """Chunks of 2 rows (every rank plans them by the widest shard, whatever its own width:
    a narrower shard alone would take 3),
    buffers NaN-poisoned: the losses and gradients of reduction "none" (recomputed in the
    backward) and "sum" equal the one-chunk call's; reduce_input_grad=False: the ranks'
    parts of both inputs' gradients sum to the reduced gradient."""
    import torch.distributed as dist
    import flce.parallel as fp
    from flce import distill
    from test_parallel import _rel_err

    sizes = _sizes(world, 40 * world)
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    (xs, ws, xt, wt, bs, bt), t = _inputs((17,), sum(sizes), torch.float32, 60, True)
    t[::5] = -100
    for reduction in ("none", "sum"):
        kw = dict(divergence="jsd", beta=0.3, temperature=2.0, hard_weight=0.5,
                  reduction=reduction)
        upstream = torch.rand(17, generator=torch.Generator().manual_seed(61)) + 0.5
        up = upstream if reduction == "none" else torch.tensor(1.3)

        def call(reduce=True):
            leaves = [x.clone().requires_grad_() for x in (xs, ws[sl], xt, wt[sl], bs[sl])]
            loss = fp.vocab_parallel_linear_distillation(
                leaves[0], leaves[1], leaves[2], leaves[3], t, group=group,
                student_bias_local=leaves[4], reduce_input_grad=reduce, **kw)
            (loss * up).sum().backward()
            return [loss.detach()] + [x.grad for x in leaves]

        whole = call()
        saved = distill.CPU_ROWS_CHUNK_BYTES
        distill.CPU_ROWS_CHUNK_BYTES = 3 * 4 * max(sizes) - 1
        try:
            with _nan_poisoned_buffers():
                chunked = call()
        finally:
            distill.CPU_ROWS_CHUNK_BYTES = saved
        for got, want in zip(chunked, whole):
            # (the weights' gradients summed over other chunks of rows: a few roundings)
            assert got.isfinite().all(), reduction
            assert got.numel() == 0 or _rel_err(got, want) <= 8 * F32_EPS, reduction
        parts = call(reduce=False)
        assert world == 1 or not torch.equal(parts[1], whole[1])
        for i in (1, 3):
            dist.all_reduce(parts[i], group=group)
            assert torch.equal(parts[i], whole[i]), (reduction, i)


def check_rank_errors(rank, world, group):
    """Ranks that disagree, one rank's bad argument, a target out of range on one rank: the
    same exception on every rank (no hang); the group works afterwards."""
    import flce.parallel as fp
    from test_parallel import _expect

    sizes = _sizes(world, 40 * world)
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    (xs, ws, xt, wt, _, _), t = _inputs((12,), sum(sizes), torch.float32, 70, False)
    last = world - 1
    mine = rank == last
    bad = f"rank {last}'s arguments are invalid"

    def call(**kw):
        args = dict(student_input=xs, student_weight_local=ws[sl], teacher_input=xt,
                    teacher_weight_local=wt[sl], target=t, group=group)
        args.update(kw)
        return fp.vocab_parallel_linear_distillation(**args)

    _expect(ValueError, "ranks disagree on divergence: ['jsd', ",
            lambda: call(divergence="forward_kl" if mine else "jsd"))
    _expect(ValueError, "ranks disagree on beta", lambda: call(beta=0.2 if mine else 0.5))
    _expect(ValueError, "ranks disagree on hard_weight",
            lambda: call(hard_weight=0.1 if mine else 0.0))
    _expect(ValueError, "ranks disagree on teacher D",
            lambda: call(teacher_input=xt[:, :-1] if mine else xt,
                         teacher_weight_local=wt[sl, :-1] if mine else wt[sl]))
    _expect(ValueError, "ranks disagree on requires grad",
            lambda: call(student_input=xs.clone().requires_grad_(not mine)))
    _expect(ValueError, f"{bad}: flce: beta must be in", lambda: call(beta=1.5 if mine else 0.5))
    _expect(ValueError, f"{bad}: flce: teacher_weight's V",
            lambda: call(teacher_weight_local=wt[sl][:-1] if mine else wt[sl]))
    _expect(ValueError, f"{bad}: flce: hard_weight=0.5 needs target",
            lambda: call(target=None, hard_weight=0.5) if mine else call(hard_weight=0.5))
    _expect(IndexError, f"rank {last} has a target of {sum(sizes)}",
            lambda: call(target=torch.full((12,), sum(sizes) if mine else 1)))
    _expect(IndexError, "out of range",
            lambda: call(target=torch.full((12,), sum(sizes) - 2), vocab_size=sum(sizes) - 3))
    _expect(ValueError, "tile [0, V)", lambda: call(vocab_start=0))
    # the group still works; check_ranks=False: the exchange once per group and call shape
    want = call()
    for _ in range(2):
        assert torch.equal(call(check_ranks=False), want)


def check_one_rank(rank, world, group):
    """A group of one rank (new_group([0])): the single-device call on the shard without its
    padding rows, bitwise, the CPU backend's fused row op included."""
    import torch.distributed as dist
    import flce
    import flce.parallel as fp

    solo = dist.new_group([0])
    if rank != 0:
        return
    (xs, ws, xt, wt, bs, bt), t = _inputs((9,), 30, torch.bfloat16, 80, True)
    kw = dict(divergence="forward_kl", hard_weight=0.2)
    for vocab_size in (None, 27):
        v = vocab_size or 30
        outs = []
        for entry in ("one", "solo"):
            leaves = [x.clone().requires_grad_() for x in (xs, ws, xt, wt, bs)]
            if entry == "one":
                loss = flce.linear_distillation(leaves[0], leaves[1][:v], leaves[2],
                                                leaves[3][:v], t % v, student_bias=leaves[4][:v],
                                                **kw)
            else:
                loss = fp.vocab_parallel_linear_distillation(
                    leaves[0], leaves[1], leaves[2], leaves[3], t % v, group=solo,
                    student_bias_local=leaves[4], vocab_size=vocab_size, **kw)
            loss.backward()
            outs.append([loss] + [x.grad for x in leaves])
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def run_checks(rank, world):
    import time

    import torch.distributed as dist

    t0 = time.perf_counter()
    group = dist.group.WORLD
    configs = [
        dict(divergence="forward_kl"),
        dict(divergence="reverse_kl", temperature=2.0, hard_weight=0.3, reduction="sum",
             bias=True, seed=1),
        dict(divergence="jsd", beta=0.5, temperature=1.5, hard_weight=0.4, soft_weight=0.7,
             reduction="none", bias=True, reverse=True, seed=2),
        dict(divergence="jsd", beta=0.1, pad=13, bias=True, seed=3),
        # the last rank's shard all padding
        dict(divergence="jsd", beta=0.9, pad=_sizes(world, 40 * world)[-1] + 2,
             reduction="none", seed=4),
        dict(divergence="jsd", beta=0.3, dtype=torch.bfloat16, teacher_grad=False, bias=True,
             hard_weight=0.5, temperature=0.7, seed=5),
        dict(divergence="forward_kl", dtype=torch.float16, reduction="none", seed=6),
        dict(divergence="reverse_kl", shift=True, ignore_index=7, reduction="none",
             hard_weight=1.0, teacher_grad=False, seed=7),
        dict(divergence="jsd", beta=0.0, shift=True, reduction="mean", seed=8),
        dict(divergence="jsd", beta=0.6, dtype=torch.float64, temperature=1.3, hard_weight=0.2,
             bias=True, reduction="none", reverse=True, pad=5, seed=9),
    ]
    for cfg in configs:
        check_against_reference(rank, world, group, **cfg)
    for check in (check_collapse, check_ties_and_nan, check_chunks_poisoned_and_input_grad,
                  check_rank_errors, check_one_rank):
        check(rank, world, group)
    print(f"ALL CHECKS PASSED in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    from dist_launch import finish_worker, init_worker

    run_checks(*init_worker())
    finish_worker()
