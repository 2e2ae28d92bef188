"""pytest configuration for the flce tests: the ``device`` fixture and tests/ on sys.path.

Every test that takes ``device`` runs on "cpu" and on "cuda"; the CUDA case skips (with a
reason) when no GPU is visible. Shared helpers live in tests/helpers.py.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import DEVICES  # noqa: E402


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
