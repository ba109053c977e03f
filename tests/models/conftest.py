"""Fixtures of the model tests; the helpers themselves live in paged_helpers.py."""
from __future__ import annotations

import pytest
from paged_helpers import PagedRunner


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    """``paged_runner(model, num_blocks=..., block_size=...)`` -> a PagedRunner bound to ``model``."""
    return PagedRunner
