"""TransformerEngine's parallel_cross_entropy cases (tests/pytorch/test_parallel_cross_entropy.py)
on flce, CPU backend, against float64 (peer_check.run_ce).

TE's ``parallel_cross_entropy(inp, target, label_smoothing, reduce_loss, dist_process_group,
ignore_idx, is_cg_capturable)`` takes logits ``(B, SQ, V)`` or ``(SQ, B, V)``, classes last, and
returns the float32 loss: ``reduce_loss=True`` the mean over the non-ignored tokens (TE's
``sum / n_non_ignore``), ``False`` per token shaped like ``target``. It maps onto two flce entry
points, each case run on both:

* ``flce.cross_entropy`` on ``inp.movedim(-1, 1)`` (torch's ``(N, C, d1)`` layout: a view of the
  same storage), ``reduction="mean"`` / ``"none"``, ``ignore_index=ignore_idx``;
* ``flce.parallel.cross_entropy`` on ``inp`` itself (classes last, the vocabulary sharded over
  ``group``; TE's ``dist_process_group``), here on a one-rank gloo group in this process: TE's
  own cases all pass ``dist_process_group=None``, and flce's multi-rank path has its own suite
  (tests/parallel/). (Not ``flce.parallel.vocab_parallel_cross_entropy``: that is Megatron's
  drop-in, with Megatron's label smoothing, ``alpha / (V - 1)`` off the target, where TE smooths
  as torch does, ``alpha / V`` on every class.)

TE squares the loss before the backward (so that the upstream gradient is not 1): the objective
here too. Shapes scaled down for the CPU (README.md).
"""
import pytest
import torch

import flce
import flce.parallel
from helpers import GRAD_FACTOR, assert_close_to_ref, gen
from peer_check import as_dict, run_ce, seed_of

# TE draws SQ from {64, 128}, the batch from {1, 2} and V from {64000, 128000} per iteration:
# here SQ / 4 and V / 8, drawn per iteration from the case's seed.
SQS, BATCHES, VOCABS = (16, 32), (1, 2), (8000, 16000)
APIS = ["cross_entropy", "parallel"]


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group in this process, for flce.parallel."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def entry(api, lead, perm=None):
    """flce's call for TE's on [N, V] logits whose rows are stored in ``lead``'s order and handed
    over as ``permute(perm)`` of it (TE's transposed, non-contiguous views); per-token outputs
    come back as [N] in storage order."""
    perm = list(perm or range(len(lead)))
    back = [perm.index(i) for i in range(len(lead))]

    def fn(x, t, class_weight, *, reduction="mean", return_lse=False, return_accuracy=False,
           return_z_loss=False, inplace_backward=False, **opts):
        z = x.view(*lead, x.shape[-1]).permute(*perm, len(lead))
        tt = t.view(lead).permute(*perm)
        flags = dict(reduction=reduction, return_lse=return_lse,
                     return_accuracy=return_accuracy, inplace_backward=inplace_backward)
        if api == "parallel":
            assert not return_z_loss
            out = flce.parallel.cross_entropy(z, tt, class_weight=class_weight, **flags, **opts)
        else:
            out = flce.cross_entropy(z.movedim(-1, 1), tt, class_weight,
                                     return_z_loss=return_z_loss, **flags, **opts)
        out = dict(as_dict(out))
        for name in ("lse",) + (("loss", "accuracy") if reduction == "none" else ()):
            if name in out:
                assert out[name].shape == tt.shape, (name, out[name].shape)
                out[name] = out[name].permute(*back).reshape(-1)
        return out
    return fn


def squared(out):
    """TE's objective: the squared loss (summed when per token)."""
    return (out["loss"] ** 2).sum()


def te_case(dtype, seed, *, swap_dim, ignore_idx):
    """TE's inputs: uniform [0, 1) logits in ``dtype``, uniform targets; with ``ignore_idx``,
    5 distinct positions among the first SQ - 1 of batch row 0 set to -100. Returns the [N, V]
    logits and [N] targets in storage order and the storage's leading shape."""
    g = gen(seed)
    sq = SQS[int(torch.randint(2, (1,), generator=g))]
    batch = BATCHES[int(torch.randint(2, (1,), generator=g))]
    vocab = VOCABS[int(torch.randint(2, (1,), generator=g))]
    lead = (sq, batch) if swap_dim else (batch, sq)
    z = torch.rand(*lead, vocab, generator=g, dtype=torch.float64).to(dtype)
    t = torch.randint(0, vocab, lead, generator=g)
    if ignore_idx:
        for i in torch.randperm(sq - 1, generator=g)[:5].tolist():
            t[(i, 0) if swap_dim else (0, i)] = -100
    return z.reshape(-1, vocab), t.reshape(-1), lead


def one_iteration(request, api, dtype, iteration, *, swap_dim=False, label_smoothing=0.0,
                  reduce_loss=True, ignore_idx=False, name):
    if api == "parallel":
        request.getfixturevalue("one_rank")
    s = seed_of(name, api, iteration)
    z, t, lead = te_case(dtype, s, swap_dim=swap_dim, ignore_idx=ignore_idx)
    out, grad = run_ce(z, t, seed=s, fn=entry(api, lead), objective=squared,
                       reduction="mean" if reduce_loss else "none",
                       label_smoothing=label_smoothing)
    assert out["loss"].dtype == torch.float32
    ignored = t == -100
    assert torch.all(grad[ignored] == 0)
    if not reduce_loss:
        assert torch.all(out["loss"][ignored] == 0)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(5))
def test_float32_input(request, api, iteration):
    one_iteration(request, api, torch.float32, iteration, name="fp32")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(5))
def test_bfloat16_input(request, api, iteration):
    one_iteration(request, api, torch.bfloat16, iteration, name="bf16")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(5))
def test_swapped_input(request, api, iteration):
    one_iteration(request, api, torch.float32, iteration, swap_dim=True, name="swapped")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(3))
def test_label_smoothing(request, api, iteration):
    one_iteration(request, api, torch.float32, iteration, label_smoothing=0.1, name="ls")


@pytest.mark.parametrize("api", APIS)
def test_non_reduced_loss(request, api):
    one_iteration(request, api, torch.float32, 0, reduce_loss=False, name="none")


# (TE draws swap_dim at random per iteration: here alternately)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(5))
def test_ignore_idx(request, api, iteration):
    one_iteration(request, api, torch.float32, iteration, swap_dim=iteration % 2 == 1,
                  reduce_loss=False, ignore_idx=True, name="ignore")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("iteration", range(5))
def test_ignore_idx_reduced_loss(request, api, iteration):
    one_iteration(request, api, torch.float32, iteration, swap_dim=iteration % 2 == 0,
                  ignore_idx=True, name="ignore_mean")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("reduce_loss", [False, True])
def test_non_contiguous_transposed_input(request, api, reduce_loss):
    """TE's (s, b, v) logits handed over as their (b, s, v) transpose: stride(-2) != v."""
    if api == "parallel":
        request.getfixturevalue("one_rank")
    s_, b_, v_ = 4, 2, 8
    s = seed_of("transposed", api, reduce_loss)
    g = gen(s)
    z = torch.randn(s_ * b_, v_, generator=g, dtype=torch.float64).float()
    t = torch.randint(0, v_, (s_ * b_,), generator=g)
    view = z.view(s_, b_, v_).transpose(0, 1)
    assert view.stride(-1) == 1 and view.stride(-2) != v_
    run_ce(z, t, seed=s, fn=entry(api, (s_, b_), perm=(1, 0)),
           reduction="mean" if reduce_loss else "none")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("rows", [2, 256])
def test_bfloat16_unreduced_external_grad(request, api, rows):
    """Per-token upstream gradients of very different sizes on bf16 logits: each token's
    gradient scaled before its one rounding to bf16 (held to bf16's floor against float64);
    the logits are not written. TE's case has 2 x 2 tokens of 3 classes, upstream
    [[0.01, 0.03], [0.1, 0.7]] and one ignored target; the larger one draws upstream
    gradients over three decades."""
    if api == "parallel":
        request.getfixturevalue("one_rank")
    s = seed_of("external_grad", api, rows)
    g = gen(s)
    z = torch.randn(2 * rows, 3, generator=g, dtype=torch.float64).to(torch.bfloat16)
    if rows == 2:
        t = torch.tensor([0, 1, 2, -100])
        up = torch.tensor([0.01, 0.03, 0.1, 0.7])
    else:
        t = torch.randint(0, 3, (2 * rows,), generator=g)
        t[-1] = -100
        up = 10.0 ** -(3 * torch.rand(2 * rows, generator=g, dtype=torch.float64))

    def external(out):
        return (out["loss"] * up.to(out["loss"].dtype)).sum()

    before = z.clone()
    _, grad = run_ce(z, t, seed=s, fn=entry(api, (2, rows)), reduction="none",
                     objective=external)
    assert torch.equal(z, before)
    # each token's gradient at bf16's floor of its own scale (run_ce's bound is relative to
    # the whole gradient's rms, which the large tokens set)
    z64 = z.double().requires_grad_()
    external({"loss": flce.reference.logits_cross_entropy(z64, t, reduction="none")}).backward()
    scale = up.double()[:, None]
    assert_close_to_ref(grad.double() / scale, z64.grad / scale, torch.bfloat16,
                        factor=GRAD_FACTOR[torch.bfloat16], what="grad per token")


def test_bfloat16_loss_matches_float32_input():
    """bf16 logits and the same values in fp32: each loss at float64's (TE holds the two
    within 2 fp32 eps of each other). TE's (1, 64, 64000), here V / 8."""
    s = seed_of("bf16_vs_fp32")
    g = gen(s)
    z = torch.randn(64, 8000, generator=g, dtype=torch.float64).to(torch.bfloat16)
    t = torch.randint(0, 8000, (64,), generator=g)
    l16, _ = run_ce(z, t, seed=s, reduction="none")
    l32, _ = run_ce(z.float(), t, seed=s, reduction="none")
    eps = torch.finfo(torch.float32).eps
    diff = (l16["loss"] - l32["loss"]).abs()
    assert torch.all(diff <= 2 * eps * l32["loss"].abs()), diff.max()


@pytest.mark.parametrize("api", APIS)
def test_unit_upstream_gradient(request, api):
    """The backward under an upstream gradient of exactly 1 (TE's shortcut, which
    is_cg_capturable turns off; the squared loss above covers the others)."""
    if api == "parallel":
        request.getfixturevalue("one_rank")
    s = seed_of("unit_upstream", api)
    z, t, lead = te_case(torch.bfloat16, s, swap_dim=False, ignore_idx=True)
    run_ce(z, t, seed=s, fn=entry(api, lead), objective=lambda out: out["loss"])


def test_is_cg_capturable():
    pytest.skip("TE's is_cg_capturable (a backward capturable in a CUDA graph): flce takes no "
                "such option, and the CPU backend has no graphs")
