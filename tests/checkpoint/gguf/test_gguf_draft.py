"""Issue 57: a GGUF file as the draft model of a safetensors target (runner/draft_model.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T
from gguf_helpers import write_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

TOKENIZER = Path(__file__).resolve().parents[3].parent / "shared" / "models" / "synthetic-tokenizer-32k"


def test_a_q8_0_gguf_of_the_target_drafts_for_it(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=63)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
    hf.save_pretrained(tmp_path / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, tmp_path / "target" / name)
    draft = write_gguf(tmp_path / "draft.gguf", hf, "llama", lambda g, shape: T.Q8_0 if len(shape) == 2 else T.F32,
                       with_tokenizer=False)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3, 4, 5], [9, 8, 7, 6], list(range(10, 25)))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = LLM(str(tmp_path / "target"), enforce_eager=True).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path / "target"), enforce_eager=True,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_accepted_tokens"] > 0.8 * m["pagedllm:spec_decode_num_draft_tokens"] > 0
