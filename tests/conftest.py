"""pytest configuration for the flce tests: the ``device`` fixture, the routing of "cuda-host"
tests to the host-emulated CUDA backend, and tests/ on sys.path.

Every test that takes ``device`` runs on "cpu", on "cuda" (skipped, with a reason, when no GPU is
visible) and on "cuda-host": CPU tensors served by the CUDA backend's binding and kernels under
the host SIMT emulation (tests/cuda_emulation.py). Tests marked ``skip_cuda_host`` are too large for
the emulation (their reason says why). FLCE_REQUIRE_CUDA_HOST=1 (CI) turns "cannot build the
emulation here" into a failure instead of a skip. Shared helpers live in tests/helpers.py.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import DEVICES  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--peers-full", action="store_true", dest="peers_full",
                     help="tests/peers: every case of the peers' grids (default: a subset that "
                          "covers every pair of option values, tests/peers/conftest.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_host: runs on the host-emulated CUDA backend")
    config.addinivalue_line("markers", "skip_cuda_host(reason): too large for the emulation")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): tiny models gain nothing from threads, and on a shared machine they
    oversubscribe it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cuda_host_routing(request):
    if request.node.get_closest_marker("cuda_host") is None:
        yield
        return
    skip = request.node.get_closest_marker("skip_cuda_host")
    if skip is not None:
        pytest.skip(skip.kwargs.get("reason") or (skip.args[0] if skip.args else
                                                  "too large for the host emulation"))
    import cuda_emulation as cuda_host

    cuda_host.load_or_skip()
    with cuda_host.routed():
        yield
