"""One rank's bad argument raises on every rank, fast, whatever the exception's type.

A rank whose own checks raise (or whose shift or reshape, before the ranks' exchange, does)
must put its error into the exchange: raising alone leaves the other ranks waiting in a
collective until the group's timeout (60 s here; each check must finish within 10 s).
"""
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_launch import run_checked  # noqa: E402

HERE = os.path.abspath(__file__)
LIMIT_S = 10.0


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_bad_argument_raises_everywhere(world):
    run_checked(HERE, world, timeout=150.0)


def _expect_fast(exc, match, fn):
    t0 = time.monotonic()
    try:
        fn()
    except exc as e:
        assert match in str(e), f"expected {match!r} in {e}"
    else:
        raise AssertionError(f"no {exc.__name__} ({match})")
    took = time.monotonic() - t0
    assert took < LIMIT_S, f"{match}: raised after {took:.1f} s"


def run_checks(rank, world, group):
    import flce.parallel as fp

    last = world - 1
    mine = rank == last
    bad = f"rank {last}'s arguments are invalid"
    g = torch.Generator().manual_seed(40)
    x, w = torch.randn(6, 8, generator=g), torch.randn(16, 8, generator=g)
    t = torch.randint(0, 16 * world, (6,), generator=g)
    both = torch.tensor([True, True])

    def linear(**kw):
        return fp.vocab_parallel_linear_cross_entropy(kw.pop("x", x), w, kw.pop("t", t),
                                                      group=group, **kw)

    # shift=True with a 0-d target (one token, input (D,)): the shift, applied after the local
    # checks, raised on that rank alone.
    _expect_fast(ValueError, f"{bad}: flce: shift=True needs target of shape (..., T)",
                 lambda: linear(x=x[0] if mine else x, t=t[0] if mine else t, shift=True))
    # A flag given as a 2-element tensor: RuntimeError (its truth value is ambiguous), which the
    # exchange did not forward; every rank raises a RuntimeError.
    _expect_fast(RuntimeError, bad, lambda: linear(return_lse=both if mine else False))
    _expect_fast(TypeError, f"{bad}: flce: shift must be", lambda: linear(shift=both if mine
                                                                          else False))
    logits = torch.randn(6, 16, generator=g)
    _expect_fast(RuntimeError, bad, lambda: fp.cross_entropy(
        logits, t, group=group, return_entropy=both if mine else False))
    _expect_fast(RuntimeError, bad, lambda: fp.vocab_parallel_cross_entropy(
        logits, t, tp_group=group, inplace_backward=both if mine else False))
    # Every rank still meets the others: the group works after the errors.
    ref = linear()
    torch.testing.assert_close(linear(), ref, rtol=0, atol=0)


def _worker_main():
    from dist_launch import finish_worker, init_worker

    rank, world = init_worker(timeout_s=60)
    import torch.distributed as dist

    run_checks(rank, world, dist.group.WORLD)
    print("ALL CHECKS PASSED", flush=True)
    finish_worker()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main()
