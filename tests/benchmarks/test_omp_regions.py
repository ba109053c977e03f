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


_DECODE_CHILD = """
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.layers.attention import Attention
from pagedllm.layers.embed_head import ParallelLMHead
from pagedllm.layers.linear import Linear
from benchmarks import omp_regions
from benchmarks.step_cost import DEFAULT_MODEL

torch.set_num_threads(2)
llm = LLM(str(DEFAULT_MODEL), enforce_eager=False, device="cpu")
runner = llm.llm_engine.executor.runner
assert runner.compiled is not None and runner.compiled.loop_threads == 1
modules = list(runner.model.modules())
kernel_calls = sum(isinstance(m, (Linear, ParallelLMHead, Attention)) for m in modules)
engine = llm.llm_engine
engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=40, ignore_eos=True))
for _ in range(4):  # the prefill, then warm-up decodes
    engine.step()
start = omp_regions.regions()
for _ in range(10):
    engine.step()
per_step = (omp_regions.regions() - start) / 10
# The graph's fused loops open none, and at batch 1 every kernel call is below the kernels'
# threading rule (kernels/csrc/parallel_work.h): none at all.
assert per_step == 0, per_step
for i in range(7):
    engine.add_request(f"r{i}", {"prompt_token_ids": [1, 2, 3 + i]}, SamplingParams(max_tokens=40, ignore_eos=True))
for _ in range(3):
    engine.step()
start = omp_regions.regions()
for _ in range(10):
    engine.step()
per_step = (omp_regions.regions() - start) / 10
# At batch 8 the widest linears (the head) have the work to split; one region per call at most.
assert 0 < per_step <= kernel_calls, (per_step, kernel_calls)
"""


@pytest.mark.slow
def test_a_tiny_models_compiled_decode_step_opens_regions_only_for_work_that_pays(monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the shim")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")  # every linear a kernel call, counted above
    monkeypatch.delenv("PAGEDLLM_ENFORCE_EAGER", raising=False)
    assert omp_regions.with_counter(["-c", _DECODE_CHILD]) == 0
