"""pagedllm/utils.py: cdiv, the one ceiling division."""
from __future__ import annotations

import math

import pytest

from pagedllm.utils import cdiv


@pytest.mark.parametrize("a, b, want", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2),
                                        (9, 4, 3), (172, 8, 22), (31, 32, 1), (33, 32, 2)])
def test_cdiv(a, b, want):
    assert cdiv(a, b) == want


def test_cdiv_is_exact_past_float_precision():
    a = 2 ** 60 + 1
    assert cdiv(a, 2) == 2 ** 59 + 1
    assert math.ceil(a / 2) != cdiv(a, 2)  # the float route would be off by one here
