"""benchmarks/omp_regions.py: the preloaded counter sees torch's parallel regions, one a
parallel op, none for work on one thread; without it there is no count."""
from __future__ import annotations

import shutil

import pytest

from benchmarks import omp_regions

_CHILD = """
import torch
from benchmarks import omp_regions
torch.set_num_threads(2)
x = torch.ones(1 << 22)
start = omp_regions.regions()
x.sum()
after_sum = omp_regions.regions()
torch.set_num_threads(1)
x.sum()
assert after_sum - start >= 1, (start, after_sum)
assert omp_regions.regions() == after_sum, (after_sum, omp_regions.regions())
"""


def test_counts_parallel_regions_only_with_the_shim():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the shim")
    assert omp_regions.regions() is None and not omp_regions.active()
    assert omp_regions.with_counter(["-c", _CHILD]) == 0
