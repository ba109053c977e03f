"""Sliding-window models before sliding-window attention exists (issue 31's correctness bug).

Full attention within the window is exactly what a sliding-window model computes, so pagedllm
caps max_model_len at an active window and refuses more; past the window it would silently
compute something else. Checked here:

* the rule of pagedllm/hf_config.py on config dicts (Mistral, Qwen2's flag, layer_types, nesting);
* the engine's resolution on a FakeRunner (default capped with a log line, explicit <= window
  kept, explicit > window refused naming the window);
* end to end on a tiny random Mistral with sliding_window 8 against transformers (eager
  attention): greedy ids equal within the window, longer requests rejected while the engine
  keeps serving, an explicit max_model_len=64 refused;
* a Qwen2 config carrying sliding_window with use_sliding_window false is not capped, and still
  matches transformers past the would-be window.
"""
from __future__ import annotations

import json
import logging
import random

import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import ValidationError
from pagedllm.hf_config import sliding_window, usable_context
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
    max_pos = config.get("text_config", config)["max_position_embeddings"]
    assert usable_context(config) == (max_pos if window is None else window)


# -- the engine's max_model_len, on a FakeRunner ------------------------------------------------
def _fake_engine(max_model_len: int | None, window: int | None) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=max_model_len),
                          CacheConfig(block_size=4, num_gpu_blocks_override=16))
    info = ModelInfo(vocab_size=50, max_position_embeddings=64, eos_token_ids=frozenset({7}),
                     sliding_window=window)
    return LLMEngine(config, runner=FakeRunner(vocab_size=50), model_info=info,
                     load_tokenizer=False)


def test_default_is_capped_at_the_window_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = _fake_engine(None, WINDOW)
    assert engine.max_model_len == WINDOW
    lines = [r.getMessage() for r in caplog.records if "sliding_window" in r.getMessage()]
    assert len(lines) == 1 and "capped at 8" in lines[0] and "not implemented" in lines[0], lines


def test_explicit_len_within_the_window_is_kept():
    assert _fake_engine(6, WINDOW).max_model_len == 6
    assert _fake_engine(WINDOW, WINDOW).max_model_len == WINDOW
    assert _fake_engine(None, None).max_model_len == 64  # no window: max_position_embeddings


def test_explicit_len_past_the_window_is_refused():
    with pytest.raises(ValidationError) as info:
        _fake_engine(9, WINDOW)
    assert info.value.param == "max_model_len"
    for fragment in ("max_model_len=9", "sliding_window (8)", "not implemented"):
        assert fragment in str(info.value), str(info.value)


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


def _prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [[1] + [rng.randrange(3, 32000) for _ in range(n - 1)] for n in range(2, WINDOW)]


def test_mistral_context_is_the_window_and_greedy_matches_transformers(mistral, e2e):
    from pagedllm import SamplingParams

    _, hf, llm = mistral
    assert llm.llm_engine.max_model_len == WINDOW
    prompts = _prompts()  # 2..7 tokens, each generating up to the window: the whole context
    params = [SamplingParams(temperature=0.0, max_tokens=WINDOW - len(p)) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        want = e2e.hf_greedy(hf, p, WINDOW - len(p), eos_ids=EOS)
        assert out.outputs[0].token_ids == want, (p, out.outputs[0].token_ids, want)
    e2e.assert_engine_idle(llm)


@pytest.mark.parametrize("num_prompt, max_tokens", [(43, 4), (WINDOW, 1), (5, 10)])
def test_mistral_request_past_the_window_is_rejected(mistral, e2e, num_prompt, max_tokens):
    from pagedllm import SamplingParams

    _, hf, llm = mistral
    ids = [1] + [300 + i for i in range(num_prompt - 1)]
    with pytest.raises(ValidationError) as info:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    assert "max_model_len" in str(info.value) or "maximum context length" in str(info.value)
    assert str(WINDOW) in str(info.value), str(info.value)
    # Nothing left behind, and the engine still serves.
    e2e.assert_engine_idle(llm)
    p = _prompts()[-1]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=1))
    assert out[0].outputs[0].token_ids == e2e.hf_greedy(hf, p, 1, eos_ids=EOS)
    e2e.assert_engine_idle(llm)


def test_mistral_explicit_max_model_len_past_the_window_is_refused(mistral):
    from pagedllm import LLM

    folder, _, _ = mistral
    with pytest.raises(ValidationError) as info:
        LLM(str(folder), device="cpu", dtype="float32", max_model_len=64)
    assert info.value.param == "max_model_len"
    for fragment in ("max_model_len=64", "sliding_window (8)", "not implemented"):
        assert fragment in str(info.value), str(info.value)


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
