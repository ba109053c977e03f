"""Memory truth: every byte of KV the runner holds lies inside the budget the user gave
(``kv_cache_memory_bytes``), with decodes, prefix sharing and forks running: no second copy of
the cache, no per-request buffers that outlive a step; and RAM backs only the blocks written."""
from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch
from paged_helpers import STORIES_DIR
from torch._subclasses.fake_tensor import FakeTensor

from benchmarks.common import rss_bytes
from pagedllm import LLM, SamplingParams
from pagedllm.layers.kv_cache import allocate_kv_cache, kv_cache_shape


def _live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of every live tensor storage in the process except those in ``exclude`` (and
    opaque (mkldnn) ones, which have no storage to read; and fake ones, which hold no memory: a
    compiling test earlier in the process may leave some behind)."""
    seen, total = set(exclude), 0
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch module attributes
        warnings.simplefilter("ignore")
        # type(), not isinstance(): a dead weakref.proxy among the objects raises on __class__.
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for obj in tensors:
        if (obj.device.type == "cpu" and not obj.is_meta and not obj.is_mkldnn
                and not isinstance(obj, FakeTensor)):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def test_kv_bytes_held_are_the_budget_and_nothing_else():
    # stories260K: 5 layers x 4 kv heads x head_dim 8, float32: 5,120 bytes per block of 4.
    bytes_per_block = 2 * 5 * 4 * 8 * 4 * 4
    budget = 200 * bytes_per_block + 1000
    llm = LLM(str(STORIES_DIR / "hf"), device="cpu", block_size=4, max_num_seqs=8,
              kv_cache_memory_bytes=budget)
    runner = llm.llm_engine.executor.runner
    weights = {p.untyped_storage().data_ptr() for p in runner.model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in runner.model.buffers()}
    kv = {c.untyped_storage().data_ptr() for c in runner.kv_caches}
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert budget - bytes_per_block < kv_bytes <= budget

    baseline = _live_tensor_bytes(weights | kv)
    prompts = [{"prompt_token_ids": [1, 400 + i, 20, 30, 40, 50, 60, 70, 80]} for i in range(6)]
    prompts.append(prompts[0])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(temperature=0.8, n=3, max_tokens=30, seed=0),
                 use_tqdm=False)  # forks share blocks (copy-on-write)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    gc.collect()
    # After the steps: the same KV tensors, and no tensors of any kind left beside them beyond
    # a few small ones (the bound is far below one layer's share of the cache).
    assert {c.untyped_storage().data_ptr() for c in runner.kv_caches} == kv
    assert _live_tensor_bytes(weights | kv) - baseline < bytes_per_block * 4


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_kv_memory_is_committed_as_blocks_are_written():
    """The whole budget is reserved, zero-filled, but RAM backs only the blocks written: an
    engine whose requests use a few blocks of a large budget does not hold the rest."""
    mib = 1 << 20
    before = rss_bytes("VmRSS")
    cache = allocate_kv_cache(kv_cache_shape(4096, 16, 8, 64), torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 4096, 16, 8, 64) and cache.nbytes == 256 * mib
    assert rss_bytes("VmRSS") - before < 16 * mib
    assert not cache[:, ::64].any()  # zeros (reading maps the zero page: nothing committed)
    cache[:, 100:108] = 1.0  # 8 blocks' keys and values: 256 KiB each side
    assert rss_bytes("VmRSS") - before < 16 * mib
    assert cache.sum().item() == 2 * 8 * 16 * 8 * 64
    del cache

    before = rss_bytes("VmRSS")
    llm = LLM(str(STORIES_DIR / "hf"), device="cpu", kv_cache_memory_bytes=1 << 30)
    assert sum(c.nbytes for c in llm.llm_engine.executor.runner.kv_caches) > 1000 * mib
    llm.generate([{"prompt_token_ids": [1, 400, 20, 30]}] * 4,
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert rss_bytes("VmRSS") - before < 256 * mib  # the model, its compiled graphs, a few blocks
