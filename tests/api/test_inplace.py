"""inplace_backward=True: the gradient is written over the logits' storage, and never silently
wrong. What else saved the logits raises torch's own "modified by an inplace operation" error
(the backward bumps their version counter), a second backward through a retained graph raises,
and leaves that require grad and rows that share memory are refused at the call.
(Vocab-parallel entry points: tests/parallel/test_parallel.py, check_rank_disagreement.)"""
import pytest
import torch

import flce
from helpers import gen, randn

INPLACE = "modified by an inplace operation"


def _logits(device, n=12, c=40, seed=0, dtype=torch.float32):
    return randn((n, c), dtype, device, gen(seed), 3.0).requires_grad_()


def _targets(device, n=12, c=40):
    return torch.randint(0, c, (n,), generator=gen(1)).to(device)


def _out_of_place_grad(fn, leaf):
    """The gradient of ``fn(inplace_backward=False)`` with respect to ``leaf``."""
    x = leaf.detach().clone().requires_grad_()
    fn(x, False).backward()
    return x.grad


@pytest.mark.parametrize("what", ["tanh", "pow", "exp", "sigmoid", "second_inplace_loss"])
@pytest.mark.parametrize("order", ["flce_last", "flce_first"])
def test_logits_saved_elsewhere_right_or_raise(device, what, order):
    """Logits that another op saved for its backward: the gradient equals the out-of-place one
    (the other op's backward ran first, before the write) or backward raises torch's error."""
    h = _logits(device)
    t = _targets(device)
    other = {"tanh": torch.tanh, "pow": lambda z, _: z ** 3, "exp": lambda z, _: torch.exp(z),
             "sigmoid": lambda z, _: torch.sigmoid(z),
             "second_inplace_loss": lambda z, inplace: flce.cross_entropy(
                 z, t, inplace_backward=inplace, reduction="none")}[what]

    def fn(x, inplace):
        z = x * 1  # a non-leaf: the storage flce may write
        if what == "tanh":  # the loss of the tanh's output (which tanh saved)
            z = torch.tanh(z)
            return flce.cross_entropy(z, t, inplace_backward=inplace)
        parts = [lambda: flce.cross_entropy(z, t, inplace_backward=inplace),
                 lambda: other(z, inplace).mean() * 0.25]
        if order == "flce_first":
            a = parts[0]()
            return a + parts[1]()
        b = parts[1]()
        return parts[0]() + b

    want = _out_of_place_grad(fn, h)
    try:
        fn(h, True).backward()
    except RuntimeError as e:
        assert INPLACE in str(e), e
        return
    assert torch.allclose(h.grad, want, rtol=1e-6, atol=1e-7), (h.grad - want).abs().max()


def test_tanh_output_logits(device):
    """Logits that are a tanh's own output (which the tanh saved for its backward): torch's
    error, not gradients 27-100% wrong. A softcap written as cap * tanh(h / cap) hands flce the
    product's output, which nothing saved: the in-place gradient is exact. (flce's own softcap=
    needs neither.)"""
    h = _logits(device)
    t = _targets(device)
    loss = flce.cross_entropy(torch.tanh(h), t, inplace_backward=True)
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    h.grad = None

    def capped(x, inplace):
        return flce.cross_entropy(30 * torch.tanh(x / 30), t, inplace_backward=inplace)
    capped(h, True).backward()
    assert torch.equal(h.grad, _out_of_place_grad(capped, h))


def test_retained_graph_second_backward_raises(device):
    h = _logits(device)
    loss = flce.cross_entropy(h * 1, _targets(device), inplace_backward=True)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
    assert torch.equal(h.grad, first)


def test_leaf_and_views_of_a_leaf_are_refused(device):
    h = _logits(device)
    t = _targets(device)
    for x in (h, h[:, :30], h.view(12, 40)):
        with pytest.raises(ValueError, match="inplace_backward=True would write the gradient"):
            flce.cross_entropy(x, t[: x.shape[0]], inplace_backward=True)
    # A leaf that does not require grad has no backward: accepted and never written.
    frozen = h.detach().clone()
    before = frozen.clone()
    flce.cross_entropy(frozen, t, inplace_backward=True)
    assert torch.equal(frozen, before)
    # A copy flce makes itself (a column-strided view is made contiguous) is its own storage.
    flce.cross_entropy(h.t().contiguous().t(), t, inplace_backward=True).backward()
    assert torch.allclose(h.grad, _out_of_place_grad(
        lambda x, inplace: flce.cross_entropy(x, t, inplace_backward=inplace), h))


def test_rows_sharing_memory_are_refused(device):
    row = _logits(device, n=1)
    x = (row * 1).expand(12, 40)
    with pytest.raises(ValueError, match="do not share memory"):
        flce.cross_entropy(x, _targets(device), inplace_backward=True)
    # One class: rows of stride 0 share their one element too (it once passed, and the
    # gradients of the 12 rows landed on one element, the last one written winning).
    col = (row[:, :1] * 1).expand(12, 1)
    with pytest.raises(ValueError, match="do not share memory"):
        flce.cross_entropy(col, torch.zeros(12, dtype=torch.long, device=device), z_loss=0.1,
                           inplace_backward=True)
    # out of place, the expanded rows' gradients sum into the row
    flce.cross_entropy(x, _targets(device), reduction="sum").backward()
    assert row.grad.shape == (1, 40) and torch.isfinite(row.grad).all()


def test_plain_inplace_is_exact_and_reuses_storage(device):
    h = _logits(device, dtype=torch.bfloat16)
    t = _targets(device)
    z = h * 1
    flce.cross_entropy(z, t, inplace_backward=True, label_smoothing=0.1).backward()
    assert torch.equal(z.detach(), h.grad)  # the gradient is in the logits' storage
    want = _out_of_place_grad(
        lambda x, inplace: flce.cross_entropy(x * 1, t, inplace_backward=inplace,
                                              label_smoothing=0.1), h)
    assert torch.equal(h.grad, want)


def test_strided_rows_that_do_not_overlap_are_accepted(device):
    # A padded vocabulary's columns (a row stride above C) and every other row: no two elements
    # share memory, and the kernel takes any row stride. (Refused before: torch's overlap probe
    # answers "too hard" for any non-contiguous tensor.)
    h = _logits(device, n=24, c=60)
    t = _targets(device, n=12)
    for view in (lambda z: z[:12, :40], lambda z: z[::2, :40]):
        fn = lambda x, inplace: flce.cross_entropy(view(x * 1), t, inplace_backward=inplace)
        want = _out_of_place_grad(fn, h)
        fn(h, True).backward()
        assert torch.equal(h.grad, want)
        h.grad = None


def test_no_refusal_where_nothing_is_written_in_place(device):
    # Without gradients, and on the composite path (float64, a functorch transform), no gradient
    # is written over the logits: a leaf is accepted.
    h = _logits(device)
    t = _targets(device)
    with torch.no_grad():
        flce.cross_entropy(h, t, inplace_backward=True)
    flce.cross_entropy(h.double().detach().requires_grad_(), t, inplace_backward=True).backward()
    got = torch.func.grad(lambda z: flce.cross_entropy(z, t, inplace_backward=True))(h.detach())
    assert torch.allclose(got, _out_of_place_grad(
        lambda x, inplace: flce.cross_entropy(x, t, inplace_backward=inplace), h))


def test_inplace_under_torch_compile(device):
    h = _logits(device)
    t = _targets(device)
    f = torch.compile(lambda z: flce.cross_entropy(z * 1, t, inplace_backward=True),
                      fullgraph=True, backend="aot_eager")
    f(h).backward()
    assert torch.allclose(h.grad, _out_of_place_grad(
        lambda x, inplace: flce.cross_entropy(x * 1, t, inplace_backward=inplace), h))


def test_inplace_under_inductor_with_dynamic_shapes(device):
    """Inductor with a symbolic batch size (dynamic=True, or the default after a second size)
    failed in its decompose_auto_functionalized pass on the mutating logits_backward_; such a
    graph takes the functional op (the gradient in a buffer of its own)."""
    torch._dynamo.reset()
    f = torch.compile(lambda z, t: flce.cross_entropy(z * 1, t, inplace_backward=True),
                      fullgraph=True, dynamic=True)
    for n in (24, 40):
        h = _logits(device, n=n)
        t = torch.randint(0, h.shape[1], (n,), device=device)
        f(h, t).backward()
        assert torch.allclose(h.grad, _out_of_place_grad(
            lambda x, inplace: flce.cross_entropy(x * 1, t, inplace_backward=inplace), h))
