"""Vocab-parallel training on the CUDA backend's single pass (flce::sum_and_grad with a process
group: the [rows, 4] statistics of each chunk of rows all-gathered inside the op), run on the CPU
through the host emulation of the CUDA backend (tests/cuda_emulation.py) over gloo.

Each rank routes flce's ops to the emulated CUDA backend, takes its shard (uneven, and an empty
one), and trains on a small workspace budget so that every rank walks several row chunks (each
one a collective): the loss, the gathered weight gradient and the reduced input gradient must
match one process on the whole vocabulary (the same emulated backend) and float64. The ranks
also run test_parallel.py's return_predicted_tokens checks on the emulated backend's shard ops.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_launch import run_checked  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_parallel import check_one_rank, check_predicted_tokens  # noqa: E402

HERE = os.path.abspath(__file__)


def _run(world_size, timeout=240.0):
    import cuda_emulation

    cuda_emulation.load_or_skip()  # built once here; the ranks load the cached module
    run_checked(HERE, world_size, timeout=timeout)


def test_single_pass_world_size_2():
    _run(2)


def test_single_pass_world_size_3_with_an_empty_shard():
    _run(3)


def test_fuzz_short_run():
    """fuzz_parallel.py on the emulated CUDA backend (its single pass and target distributions
    over the shards): a short seeded run."""
    import cuda_emulation
    import fuzz_parallel

    cuda_emulation.load_or_skip()
    cases = 150
    ran, failed, out = fuzz_parallel.fuzz("cuda-host", world=2, seed=7, minutes=3.0, cases=cases)
    assert failed == 0 and ran == cases, out


# ---------------------------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------------------------
SHARDS = {2: [700, 301], 3: [520, 0, 481]}
N, V, D = 150, 1001, 40


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def _gather_shards(local, sizes):
    """The ranks' uneven shards concatenated (gloo's all_gather wants equal sizes: pad, trim)."""
    import torch.distributed as dist

    big = max(sizes)
    pad = local.new_zeros((big,) + tuple(local.shape[1:]))
    pad[:local.shape[0]] = local
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def _check_rl_outputs(rank, sizes, start, backend):
    """Temperature and entropy over the shards: per-token entropy (and its gradient through a
    random upstream) and the tempered loss equal one process on the whole vocabulary."""
    import flce
    import flce.parallel as fp

    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D ** 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    up = torch.rand(N, generator=g) - 0.5
    xs = x.clone().requires_grad_()
    ws = w[start:start + sizes[rank]].clone().requires_grad_()
    loss, ent = fp.vocab_parallel_linear_cross_entropy(xs, ws, t, reduction="none",
                                                       temperature=0.7, softcap=9.0,
                                                       return_entropy=True)
    (loss.sum() + (ent * up).sum()).backward()
    gw = _gather_shards(ws.grad, sizes)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss1, ent1 = flce.linear_cross_entropy(x1, w1, t, reduction="none", temperature=0.7,
                                            softcap=9.0, return_entropy=True)
    (loss1.sum() + (ent1 * up).sum()).backward()
    assert _rel(loss, loss1) < 1e-6 and _rel(ent, ent1) < 1e-6, (_rel(loss, loss1), _rel(ent, ent1))
    assert _rel(xs.grad, x1.grad) < 1e-5 and _rel(gw, w1.grad) < 1e-5, backend
    assert (ent[t == -100] == 0).all()
    print(f"rank {rank} {backend} temperature and entropy: ok")


def _check_compiled(rank, sizes, start):
    """The single pass over the shards (its autograd Function, the fp32 dE all-reduce) under
    torch.compile (aot_eager): the eager result bitwise."""
    import flce.parallel as fp

    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) / D ** 0.5).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)

    def f(x, w):
        return fp.vocab_parallel_linear_cross_entropy(x, w, t, label_smoothing=0.1)

    out = []
    for fn in (f, torch.compile(f, backend="aot_eager")):
        xs, ws = x.clone().requires_grad_(), w[start:start + sizes[rank]].clone().requires_grad_()
        loss = fn(xs, ws)
        loss.backward()
        out.append((loss.detach(), xs.grad, ws.grad))
    assert all(torch.equal(a, b) for a, b in zip(*out))
    print(f"rank {rank} compiled single pass: ok")


def _check_padding_shard(rank, world):
    """Vocabulary padding on the single pass: at 3 ranks the last rank's shard is wholly in it,
    its start past vocab_size (the op's shard check raised on that rank alone, the others
    waiting in the op's all-gather); at 2, partly. The loss and gradients of one process on the
    real vocabulary, and zero gradient on the padding rows."""
    import flce
    import flce.parallel as fp

    g = torch.Generator().manual_seed(5)
    v, rows = 90, 48  # rows per rank: the last rank holds rows [48 (R - 1), 48 R), past v
    x = torch.randn(N, D, generator=g)
    w = torch.randn(rows * world, D, generator=g) / D ** 0.5
    t = torch.randint(0, v, (N,), generator=g)
    xs, ws = x.clone().requires_grad_(), w[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    loss = fp.vocab_parallel_linear_cross_entropy(xs, ws, t, vocab_size=v)
    loss.backward()
    x1, w1 = x.clone().requires_grad_(), w[:v].clone().requires_grad_()
    loss1 = flce.linear_cross_entropy(x1, w1, t)
    loss1.backward()
    assert abs(loss.item() - loss1.item()) <= 1e-6 * abs(loss1.item()), (loss, loss1)
    assert _rel(xs.grad, x1.grad) < 1e-5
    real = max(0, min(rows, v - rank * rows))
    assert real == 0 or _rel(ws.grad[:real], w1.grad[rank * rows:rank * rows + real]) < 1e-5
    assert not ws.grad[real:].any()
    print(f"rank {rank} padding shard: ok")


def _worker():
    import torch.distributed as dist

    import cuda_emulation
    import flce
    import flce.parallel as fp
    from dist_launch import finish_worker, init_worker

    rank, world = init_worker()
    cuda_emulation.load()
    # 0.3 MiB: a handful of 64-row chunks per group (each one an all-gather) at this shape.
    os.environ["FLCE_CUDA_WORKSPACE_MB"] = "0.3"
    sizes = SHARDS[world]
    start = sum(sizes[:rank])
    calls = []
    with cuda_emulation.routed() as ops:
        real_sum_and_grad = ops.sum_and_grad

        class Spy:
            def __getattr__(self, name):
                calls.append(name)
                return getattr(ops, name)

        flce._ops.ops = Spy()
        for dtype in (torch.float32, torch.bfloat16):
            for opts in (dict(reduction="mean"),
                         dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=8.0)):
                g = torch.Generator().manual_seed(1)
                x = torch.randn(N, D, generator=g).to(dtype)
                w = (torch.randn(V, D, generator=g) / D ** 0.5).to(dtype)
                b = (torch.randn(V, generator=g) * 0.1).to(dtype)
                t = torch.randint(0, V, (N,), generator=g)
                t[::9] = -100
                ws = w[start:start + sizes[rank]].clone().requires_grad_()
                bs = b[start:start + sizes[rank]].clone().requires_grad_()
                xs = x.clone().requires_grad_()
                calls.clear()
                loss = fp.vocab_parallel_linear_cross_entropy(xs, ws, t, bias_local=bs, **opts)
                assert calls == ["sum_and_grad"], calls
                (loss * 0.7).backward()
                gw, gb = _gather_shards(ws.grad, sizes), _gather_shards(bs.grad, sizes)
                # one process, the whole vocabulary, the same emulated backend
                x1, w1, b1 = (a.clone().requires_grad_() for a in (x, w, b))
                loss1 = flce.linear_cross_entropy(x1, w1, t, bias=b1, **opts)
                (loss1 * 0.7).backward()
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                assert abs(loss.item() - loss1.item()) <= 1e-6 * abs(loss1.item()), (loss, loss1)
                assert _rel(xs.grad, x1.grad) < tol, _rel(xs.grad, x1.grad)
                assert _rel(gw, w1.grad) < tol, _rel(gw, w1.grad)
                assert _rel(gb, b1.grad) < tol, _rel(gb, b1.grad)
                # float64
                xr, wr, br = (a.double().requires_grad_() for a in (x, w, b))
                ref = flce.reference.linear_cross_entropy(xr, wr, t, bias=br, **opts)
                (ref * 0.7).backward()
                assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), (loss, ref)
                assert _rel(xs.grad, xr.grad) < 2 * tol and _rel(gw, wr.grad) < 2 * tol
                # dE summed over the ranks in fp32 and rounded once: as far from float64 as one
                # process's (the ranks' parts rounded to bf16 first: 1.2-1.3x as far)
                e_tp, e_one = _rel(xs.grad, xr.grad), _rel(x1.grad, xr.grad)
                assert e_tp <= 1.05 * e_one, (e_tp, e_one)
                print(f"rank {rank} {dtype} {opts}: ok")
        flce._ops.ops = ops
        assert real_sum_and_grad is ops.sum_and_grad
        _check_rl_outputs(rank, sizes, start, "cuda-host")
        _check_compiled(rank, sizes, start)
        _check_padding_shard(rank, world)
        check_predicted_tokens(rank, world, dist.group.WORLD, dtensor=False)
        solo = dist.new_group([0])  # (on every rank)
        if rank == 0:
            check_one_rank(solo)  # the single pass of one rank: no group in the op
    _check_rl_outputs(rank, sizes, start, "cpu")
    dist.barrier()
    print("ALL CHECKS PASSED", flush=True)
    finish_worker()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
