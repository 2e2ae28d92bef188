"""The peers' cases run with torch on one thread: their shapes are small, and on a shared
machine threads oversubscribe it (one thread measured 20x faster per case on two busy cores).
flce's threaded paths have their own tests (tests/cpu/)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def _peers_on_one_thread(one_thread):
    yield
