"""quantization="q8_0" | "q4_0": a full-precision checkpoint's decoder linears quantized at
load (layers/quantization/round_to_nearest.py), on the demo model: q8_0 keeps its golden
greedy stories; both match transformers running the round-to-nearest weights dequantized."""
from __future__ import annotations

import json

import pytest
import torch
from paged_helpers import STORIES_DIR, check_greedy_logprobs
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.layers import Linear
from pagedllm.layers.quantization import quantize_linear, quantized_kernels_available
from pagedllm.layers.weight_format import Quantized

MODEL_DIR = STORIES_DIR / "hf"
CASES = json.loads((STORIES_DIR / "golden_greedy.json").read_text())["cases"] \
    if (STORIES_DIR / "golden_greedy.json").is_file() else []

pytestmark = [
    pytest.mark.skipif(not MODEL_DIR.is_dir(), reason=f"demo model not found at {MODEL_DIR}"),
    pytest.mark.skipif(not quantized_kernels_available(torch.device("cpu")),
                       reason="the quantized formats need pagedllm's CPU kernels"),
]


def _llm(scheme: str) -> LLM:
    # float32 activations: the exact path these tests compare with the dequantized weights
    return LLM(str(MODEL_DIR), device="cpu", enforce_eager=True, kv_cache_memory_bytes=1 << 22,
               quantization=scheme, quantization_activations="float32")


def test_q8_0_reproduces_the_golden_stories():
    llm = _llm("q8_0")
    model = llm.llm_engine.executor.runner.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    # hidden 64 -> quantized; down_proj's 172 inputs are not whole blocks of 32: kept float
    assert all((not isinstance(m.weight_format, Quantized)) == name.endswith("down_proj")
               for name, m in layers.items())
    assert all(m.weight_format.qweight.format == "q8" for m in layers.values()
               if isinstance(m.weight_format, Quantized))
    params = [SamplingParams(temperature=0.0, max_tokens=len(c["greedy_ids"]), stop_token_ids=[1])
              for c in CASES]
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in CASES], params,
                           use_tqdm=False)
    for case, out in zip(CASES, outputs):
        assert list(out.outputs[0].token_ids) == case["greedy_ids"], case["prompt"]


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_matches_transformers_on_the_dequantized_weights(scheme):
    hf_model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear) \
                    and module.in_features % 32 == 0:
                module.weight.copy_(quantize_linear(module.weight, scheme).dequantize())
    llm = _llm(scheme)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_greedy_logprobs(hf_model, prompts, outputs)
