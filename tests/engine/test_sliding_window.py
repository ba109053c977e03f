"""Sliding-window models (issue 31's correctness bug, now exact).

A Mistral config with ``sliding_window: 8`` used to load with full attention past the window and
give greedy ids different from transformers; then the context was capped at the window. Now the
attention layers apply the window (layers/attention/; the kernel-level tests are in
tests/models/test_attention_features.py), so the context is the model's max_position_embeddings.
Checked here:

* the rule of pagedllm/hf_config.py on config dicts (Mistral, Qwen2's flag, layer_types, nesting);
* the engine's max_model_len on a FakeRunner: the window no longer caps it;
* end to end on a tiny random Mistral with sliding_window 8 against transformers (eager
  attention): prompts of 7-43 tokens with max_num_batched_tokens=16 (the issue's failing case:
  chunks that cross the window edge), greedy ids equal, and the engine idle afterwards;
* a Qwen2 config carrying sliding_window with use_sliding_window false has no window, and still
  matches transformers past the would-be window.

The hybrid KV cache (issue 31, part 2; core/kv_cache_manager.py): window layers give back the
blocks that left the window. On the same tiny Mistral (one window group) and on a Gemma-2-like
model (local/global layers: two groups sharing the KV tensors), greedy ids equal transformers
under batching, chunked prefill across the window, prefix hits and preemption; the KV tensors
are sized per group; a request of 8x the window holds about a window of KV in its window layers.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import ValidationError
from pagedllm.hf_config import sliding_window
from pagedllm.runner.fake import FakeRunner

WINDOW = 8
EOS = frozenset({2})


# -- the rule, on config dicts ------------------------------------------------------------------
@pytest.mark.parametrize("config, window", [
    ({"model_type": "mistral", "sliding_window": 8, "max_position_embeddings": 256}, 8),
    ({"model_type": "mistral", "sliding_window": None, "max_position_embeddings": 256}, None),
    ({"model_type": "mistral", "max_position_embeddings": 256}, None),
    # As long as the context: the window never slides.
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 4096}, None),
    # Qwen2 checkpoints: a window size with the flag off means no window.
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False,
      "max_position_embeddings": 256}, None),
    ({"model_type": "qwen2", "sliding_window": 8, "max_position_embeddings": 256}, None),
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
      "max_position_embeddings": 256}, 8),
    # transformers' layer_types is the per-layer answer: no windowed layer, no window.
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 256}, None),
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"], "max_position_embeddings": 256}, 8),
    # Multimodal-style nesting.
    ({"text_config": {"model_type": "mistral", "sliding_window": 8,
                      "max_position_embeddings": 256}}, 8),
])
def test_active_window_rule(config, window):
    assert sliding_window(config) == window


# -- the engine's max_model_len, on a FakeRunner ------------------------------------------------
def _fake_engine(max_model_len: int | None, window: int | None) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=max_model_len),
                          CacheConfig(block_size=4, num_gpu_blocks_override=8))
    info = ModelInfo(vocab_size=50, max_position_embeddings=64, eos_token_ids=frozenset({7}),
                     sliding_window=window)
    return LLMEngine(config, runner=FakeRunner(vocab_size=50), model_info=info,
                     load_tokenizer=False)


def test_window_does_not_cap_max_model_len():
    assert _fake_engine(None, WINDOW).max_model_len == 64  # max_position_embeddings
    assert _fake_engine(40, WINDOW).max_model_len == 40
    with pytest.raises(ValidationError) as info:
        _fake_engine(65, WINDOW)
    assert info.value.param == "max_model_len" and "max_position_embeddings (64)" in str(info.value)


# -- end to end: a tiny random Mistral with sliding_window 8 ------------------------------------
@pytest.fixture(scope="module")
def mistral(tmp_path_factory, e2e):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM

    folder = e2e.build_tiny_model("mistral_swa", tmp_path_factory.mktemp("mistral_swa"))
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == WINDOW
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
              block_size=4)
    yield folder, hf, llm
    del llm


def test_mistral_past_the_window_matches_transformers(mistral, e2e):
    """The issue's case: prompts of 7-43 tokens, 16-token steps, generation past the window."""
    from pagedllm import SamplingParams

    _, hf, llm = mistral
    assert llm.llm_engine.max_model_len == json.loads(
        (mistral[0] / "config.json").read_text())["max_position_embeddings"]
    rng = random.Random(31)
    prompts = [[1] + [rng.randrange(3, 32000) for _ in range(n - 1)] for n in (7, 12, 20, 31, 43)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        want = e2e.hf_greedy(hf, p, 12, eos_ids=EOS)
        assert out.outputs[0].token_ids == want, (len(p), out.outputs[0].token_ids, want)
    e2e.assert_engine_idle(llm)


# -- Qwen2: a window size with use_sliding_window false is no window ----------------------------
def test_qwen2_with_window_flag_off_is_not_capped(tmp_path, e2e):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    folder = e2e.build_tiny_model("qwen2", tmp_path / "qwen2")
    # As Qwen2 checkpoints ship it: a window size, the flag off, no layer_types.
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(sliding_window=WINDOW, use_sliding_window=False)
    cfg.pop("layer_types", None)
    cfg_path.write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4)
    assert llm.llm_engine.max_model_len == cfg["max_position_embeddings"] == 256
    prompt = [1] + [400 + 7 * i for i in range(11)]  # 12 tokens + 8 generated: past the "window"
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    assert out[0].outputs[0].token_ids == e2e.hf_greedy(hf, prompt, 8, eos_ids=EOS)
    e2e.assert_engine_idle(llm)


# -- the hybrid KV cache ------------------------------------------------------------------------
def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32000) for _ in range(n - 1)] for n in lengths]


def _check_greedy(llm, hf, e2e, prompts, max_tokens: int = 12) -> None:
    from pagedllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for p, out in zip(prompts, outs):
        want = e2e.hf_greedy(hf, p, max_tokens, eos_ids=EOS)
        assert out.outputs[0].token_ids == want, (len(p), out.outputs[0].token_ids, want)
    e2e.assert_engine_idle(llm)


_GEMMA = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
              max_position_embeddings=256, final_logit_softcapping=10.0, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, e2e):
    """A Gemma-2-like model: 4 layers alternating local (window 8) and global, soft caps."""
    from transformers import Gemma2Config

    return _save_gemma(Gemma2Config(**_GEMMA, num_hidden_layers=4, attn_logit_softcapping=20.0),
                       tmp_path_factory.mktemp("gemma2_hybrid"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, e2e):
    """A Gemma-3-like model: local, global, local (two local groups of one layer each)."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        **_GEMMA, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return _save_gemma(config, tmp_path_factory.mktemp("gemma3_hybrid"))


def _save_gemma(config, folder):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))  # Gemma norms scale by 1 + weight
    model.save_pretrained(folder)
    # The tiny-model builder's tokenizer (tests/engine/conftest.py: SYNTHETIC_TOKENIZER_DIR; a
    # test module cannot import conftest reliably, several folders have one).
    tokenizer_dir = Path(__file__).resolve().parents[2].parent / "shared" / "models" / \
        "synthetic-tokenizer-32k"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    return folder, hf


def _runner(llm):
    return llm.llm_engine.executor.runner


def test_gemma2_groups_share_the_kv_tensors(gemma2):
    """Two groups (global, local) of 2 layers: 2 KV tensors, so a block costs 2 layers' bytes,
    and the KV memory the user gives is what is allocated."""
    from pagedllm import LLM

    budget = 1 << 20
    llm = LLM(str(gemma2[0]), device="cpu", dtype="float32", block_size=4,
              kv_cache_memory_bytes=budget)
    runner = _runner(llm)
    assert runner.get_kv_cache_groups() == [None, WINDOW]
    assert llm.llm_engine.scheduler.kv_cache_manager.sliding_windows == (None, WINDOW)
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 tensors, block 4, 2 KV heads, head_dim 16, fp32
    assert runner.bytes_per_block(4) == per_block
    assert len(runner.kv_caches) == 2 and llm.llm_engine.num_blocks == budget // per_block
    allocated = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    assert budget - per_block < allocated <= budget
    layers = [m for m in runner.model.modules() if type(m).__name__ == "Attention"]
    assert [(a.sliding_window, a.kv_cache_group) for a in layers] == [
        (WINDOW, 1), (None, 0), (WINDOW, 1), (None, 0)]
    assert layers[0].kv_cache is layers[1].kv_cache and layers[2].kv_cache is layers[3].kv_cache


def test_mistral_one_window_group_sizes_like_before(mistral):
    """Every layer windowed: one group, one tensor per layer (the plain cache's size)."""
    runner = _runner(mistral[2])
    assert runner.get_kv_cache_groups() == [WINDOW]
    assert len(runner.kv_caches) == runner.model.num_layers


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gemma2_hybrid_matches_transformers(gemma2, e2e, backend):
    """Batched prompts of 7-43 tokens in 16-token steps (chunks cross the window), then prefix
    hits of the same prompts, then a cache so small that requests are preempted."""
    from pagedllm import LLM

    folder, hf = gemma2
    prompts = _prompts(7, (7, 12, 20, 31, 43))
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4,
              attention_backend=backend)
    _check_greedy(llm, hf, e2e, prompts)
    # The same prompts, and ones sharing their prefixes: hits in both groups.
    before = llm.get_metrics()["pagedllm:prefix_cache_hits"]
    _check_greedy(llm, hf, e2e, prompts + [p[:-3] + [5, 6, 7] for p in prompts[2:]])
    assert llm.get_metrics()["pagedllm:prefix_cache_hits"] > before
    del llm
    small = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
                block_size=4, num_gpu_blocks_override=40, attention_backend=backend)
    _check_greedy(small, hf, e2e, _prompts(8, (30, 33, 36, 39)), max_tokens=16)
    assert small.get_metrics()["pagedllm:num_preemptions"] > 0


def test_mistral_prefix_hits_and_preemption(mistral, e2e):
    from pagedllm import LLM

    folder, hf, llm = mistral
    prompts = _prompts(9, (21, 30, 43))
    _check_greedy(llm, hf, e2e, prompts)
    before = llm.get_metrics()["pagedllm:prefix_cache_hits"]
    _check_greedy(llm, hf, e2e, [p + [11, 12] for p in prompts])
    assert llm.get_metrics()["pagedllm:prefix_cache_hits"] > before
    small = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
                block_size=4, num_gpu_blocks_override=8)
    _check_greedy(small, hf, e2e, _prompts(10, (30, 34, 38, 40)), max_tokens=16)
    assert small.get_metrics()["pagedllm:num_preemptions"] > 0


def test_long_request_holds_about_a_window_of_kv(mistral, e2e):
    """The issue's memory check: a request of 8x the window holds at most window + chunk + one
    block of KV (rounded up to blocks) in its window layers, in the manager's table and in the
    bytes of the block pool in use."""
    from pagedllm import SamplingParams

    _, hf, llm = mistral
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    per_block = _runner(llm).bytes_per_block(4)
    chunk = 16  # max_num_batched_tokens
    prompt = _prompts(11, (8 * WINDOW,))[0]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=8))
    limit = (-(-(WINDOW + chunk) // 4) + 1)  # blocks
    out, most = None, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if "long" in engine.scheduler.requests:
            (table,) = kv.get_block_ids("long")
            held = [b for b in table if b >= 0]
            used = kv.num_blocks - kv.block_pool.get_num_free_blocks()
            assert len(held) <= limit and used * per_block <= limit * per_block, table
            most = max(most, len(held))
    assert most * 4 < len(prompt) // 2  # far less than the sequence
    assert out.outputs[0].token_ids == e2e.hf_greedy(hf, prompt, 8, eos_ids=EOS)
    e2e.assert_engine_idle(llm)


def test_gemma3_two_window_groups_match_transformers(gemma3, e2e):
    """Local / global / local: three groups of one layer (one full, two windows) sharing one
    KV tensor; batched, chunked across the window, and preempted."""
    from pagedllm import LLM

    folder, hf = gemma3
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
              block_size=4, num_gpu_blocks_override=48)
    runner = _runner(llm)
    assert runner.get_kv_cache_groups() == [None, WINDOW, WINDOW] and len(runner.kv_caches) == 1
    _check_greedy(llm, hf, e2e, _prompts(12, (7, 20, 31, 36, 43)), max_tokens=16)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
