"""``pagedllm::unified_attention``, the compiled graph's attention call (layers/attention/unified_attention.py):
with a step entered it gives the layer's Python path's output bit for bit without calling that
path; whatever the kernel alone cannot do (no step, a fresh prompt of a plain layer, a narrower
cache, a layer never bound) goes to the Python path; a dropped layer is forgotten. A compiled
engine's decode steps never call attention in Python."""
from __future__ import annotations

import gc
from pathlib import Path
from unittest import mock

import pytest
import torch

from pagedllm.layers import (
    Attention,
    bind_kv_caches,
    build_attention_metadata,
    get_attn_backend,
    kv_cache_shape,
    set_forward_context,
)
from pagedllm.layers.attention.unified_attention import available_on_cpu

DEMO_MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"


@pytest.fixture(scope="module")
def cpu_paged():
    backend = get_attn_backend("cpu_paged", "cpu")
    assert backend.name == "cpu_paged", "the cpu_paged kernel did not build (see the warning)"
    return backend


def _layer(cache_dtype=torch.float32, **features) -> Attention:
    layer = Attention(4, 2, 8, 0.35, layer_idx=0, **features)
    if layer.sinks is not None:
        torch.nn.init.normal_(layer.sinks)
    cache = torch.randn(kv_cache_shape(12, 4, 2, 8), generator=torch.Generator().manual_seed(1)).to(cache_dtype)
    bind_kv_caches([layer], [cache])
    return layer


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(num_tokens, 4, 8, generator=gen), torch.randn(num_tokens, 2, 8, generator=gen),
            torch.randn(num_tokens, 2, 8, generator=gen))


def _unified(layer: Attention, q, k, v) -> torch.Tensor:
    return torch.ops.pagedllm.unified_attention(q, k, v, layer._op_id, layer.scale, layer.sliding_window or 0,
                                                layer.logits_soft_cap or 0.0, layer.sinks)


def _both(layer: Attention, md, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the op's output, the Python path's, how often the op called the Python path); each
    from the same cache, since both store the step's K/V."""
    q, k, v = _inputs(num_tokens)
    saved = layer.kv_cache.clone()
    with mock.patch.object(Attention, "attend", autospec=True, side_effect=Attention.attend) as attend:
        with set_forward_context(md):
            got = _unified(layer, q, k, v)
        calls = attend.call_count
    layer.kv_cache.copy_(saved)
    with set_forward_context(md):
        want = layer.attend(q, k, v)
    return got, want, calls


# A decode, and a 3-token chunk over a cached 5-token prefix: every row in the kernel.
_CACHED = dict(query_lens=[1, 3], num_computed_tokens=[6, 5], block_tables=[[3, 7], [5, 1, 9]])


@pytest.mark.parametrize("features", [{}, {"sliding_window": 3}, {"logits_soft_cap": 2.0}, {"has_sinks": True}],
                         ids=["plain", "window", "soft_cap", "sinks"])
def test_a_step_without_python(cpu_paged, features):
    layer = _layer(**features)
    md = build_attention_metadata(**_CACHED, block_size=4, backend=cpu_paged)
    got, want, calls = _both(layer, md, 4)
    assert calls == 0
    assert got.shape == (4, 32) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fresh_prompt_of_a_plain_layer_goes_to_python(cpu_paged):
    layer = _layer()
    md = build_attention_metadata([1, 3], [6, 0], [[3, 7], [5]], block_size=4, backend=cpu_paged)
    got, want, calls = _both(layer, md, 4)
    assert calls == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    windowed = _layer(sliding_window=2)  # the kernel attends a windowed layer's fresh prompts
    assert _both(windowed, md, 4)[2] == 0


def test_a_narrower_cache_goes_to_python(cpu_paged):
    layer = _layer(torch.bfloat16)
    md = build_attention_metadata(**_CACHED, block_size=4, backend=cpu_paged)
    got, want, calls = _both(layer, md, 4)
    assert calls == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_step_goes_to_python_and_leaving_a_step_clears_it(cpu_paged):
    layer = _layer()
    md = build_attention_metadata(**_CACHED, block_size=4, backend=cpu_paged)
    with set_forward_context(md):
        pass
    q, k, v = _inputs(3)
    with mock.patch.object(Attention, "attend", autospec=True, side_effect=Attention.attend) as attend:
        got = _unified(layer, q, k, v)  # no step: one causal sequence, no cache
    assert attend.call_count == 1
    torch.testing.assert_close(got, layer.attend(q, k, v), rtol=0, atol=0)


def test_a_layer_is_told_its_group_and_forgotten_when_dropped(cpu_paged):
    """Two groups: the layer reads its own group's tables; a dropped layer's entry (and cache
    reference) goes with it."""
    layer = Attention(4, 2, 8, 0.35, layer_idx=0)
    cache = torch.randn(kv_cache_shape(12, 4, 2, 8), generator=torch.Generator().manual_seed(1))
    bind_kv_caches([layer], [cache], [(1, 0)])
    group0 = build_attention_metadata([1], [6], [[3, 7]], block_size=4, backend=cpu_paged)
    group1 = build_attention_metadata([1], [6], [[8, 2]], block_size=4, backend=cpu_paged)
    group0.group_metadata = [group0, group1]
    got, want, calls = _both(layer, group0, 1)
    assert calls == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(want, _both(_layer(), group0, 1)[1])  # group 0's tables differ

    layer_id, refs = layer._op_id, cache._use_count()
    del layer
    gc.collect()
    assert cache._use_count() < refs  # the op's table let go of the cache
    with set_forward_context(group0), pytest.raises(Exception, match=str(layer_id)):
        torch.ops.pagedllm.unified_attention(*_inputs(1), layer_id, 0.35, 0, 0.0, None)


@pytest.mark.slow
def test_compiled_decode_steps_call_no_python_attention():
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(DEMO_MODEL), enforce_eager=False, device="cpu", block_size=4)
    assert llm.llm_engine.executor.runner.compiled is not None
    assert available_on_cpu()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(str(DEMO_MODEL), enforce_eager=True, device="cpu", block_size=4).generate(
        [{"prompt_token_ids": [1]}], params, use_tqdm=False)
    with mock.patch.object(Attention, "attend", autospec=True, side_effect=Attention.attend) as attend:
        got = llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)  # one-token prompt
    assert attend.call_count == 0
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
