"""The peers' cases run with torch on one thread: their shapes are small, and on a shared
machine threads oversubscribe it (one thread measured 20x faster per case on two busy cores).
flce's threaded paths have their own tests (tests/cpu/).

By default a test function whose grid has more than ``FULL_GRID_MAX`` cases runs a covering
subset of it: every pair of option values that occurs in the grid (any two axes, e.g. fp16 with
softcap, bf16 with shift) in at least one case, chosen greedily and deterministically (the same
cases on every run and machine). ``--peers-full`` (tests/conftest.py) runs every case.
"""
import itertools
import os
import zlib

import pytest

FULL_GRID_MAX = 12
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True, scope="module")
def _peers_on_one_thread(one_thread):
    yield


def _axes(item):
    """A case's option values, one (axis, value) per parametrized argument."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [(name, repr(value)) for name, value in sorted(params.items())]


def pairwise_subset(items):
    """A subset of one test function's cases in which every pair of (axis, value) that occurs
    in some case occurs too (single values where a grid has one axis). Greedy: the case that
    covers most pairs not yet covered, ties to the smallest CRC of the case's id; the cases
    keep their collection order. A case marked xfail (a known defect, strict) is always kept."""
    covers = []
    for it in items:
        axes = _axes(it)
        covers.append(set(itertools.combinations(axes, 2)) if len(axes) > 1 else set(axes))
    left = set().union(*covers)
    chosen = {i for i, it in enumerate(items) if it.get_closest_marker("xfail") is not None}
    for i in chosen:
        left -= covers[i]
    while left:
        best = max((i for i in range(len(items)) if i not in chosen),
                   key=lambda i: (len(covers[i] & left), -zlib.crc32(items[i].nodeid.encode())))
        chosen.add(best)
        left -= covers[best]
    return [it for i, it in enumerate(items) if i in chosen]


def pytest_collection_modifyitems(config, items):
    if config.getoption("peers_full"):
        return
    groups = {}
    for it in items:
        if os.path.dirname(str(it.path)) == HERE and hasattr(it, "callspec"):
            groups.setdefault((str(it.path), it.originalname), []).append(it)
    dropped = set()
    for cases in groups.values():
        if len(cases) > FULL_GRID_MAX:
            kept = set(map(id, pairwise_subset(cases)))
            dropped.update(id(it) for it in cases if id(it) not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[it for it in items if id(it) in dropped])
        items[:] = [it for it in items if id(it) not in dropped]
