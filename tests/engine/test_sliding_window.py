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
"""
from __future__ import annotations

import json
import random

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
                          CacheConfig(block_size=4, num_gpu_blocks_override=16))
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
