"""``quantization_activations="auto"`` (the default): int8 activations for the block-quantized
layers of GGUF files and load-time q8_0/q4_0, bfloat16 for bf16 weights on CPUs whose kernels
take them, float32 elsewhere; an explicit "float32" keeps the exact path."""
from __future__ import annotations

import logging

import pytest
from paged_helpers import STORIES_DIR

from pagedllm import LLM
from pagedllm.kernels.cpu_extension import has_bf16_activations
from pagedllm.layers.quantization import quantized_kernels_available
from pagedllm.layers.weight_format import Quantized

pytestmark = pytest.mark.skipif(not quantized_kernels_available(__import__("torch").device("cpu")),
                                reason="the quantized formats need pagedllm's CPU kernels")


def _llm(**kwargs) -> LLM:
    return LLM(str(STORIES_DIR / "hf"), device="cpu", enforce_eager=True,
               kv_cache_memory_bytes=1 << 20, **kwargs)


def _methods(llm: LLM) -> set[str]:
    model = llm.llm_engine.executor.runner.model
    return {m.weight_format.activations for m in model.modules()
            if isinstance(getattr(m, "weight_format", None), Quantized)}


def test_auto_runs_q8_0_layers_with_int8_activations(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.weight_plan.activation_choice"):
        llm = _llm(quantization="q8_0")
    assert llm.llm_engine.executor.runner.activations == {"q8": "int8"}
    assert _methods(llm) == {"int8"}
    assert "q8 layers int8" in caplog.text


def test_explicit_float32_keeps_the_exact_path():
    llm = _llm(quantization="q8_0", quantization_activations="float32")
    assert llm.llm_engine.executor.runner.activations == {"q8": "float32"}
    assert _methods(llm) == {"float32"}


def test_auto_leaves_a_float32_model_alone(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.weight_plan.activation_choice"):
        llm = _llm()
    assert llm.llm_engine.executor.runner.activations == {}
    assert _methods(llm) == set()
    assert "float32 (no layer in a quantized or 16-bit format)" in caplog.text


@pytest.mark.skipif(not has_bf16_activations(), reason="this CPU has no AVX512-BF16")
def test_auto_runs_bf16_layers_with_bfloat16_activations():
    llm = _llm(dtype="bfloat16")
    assert llm.llm_engine.executor.runner.activations == {"bf16": "bfloat16"}
    assert _methods(llm) == {"bfloat16"}


@pytest.mark.skipif(has_bf16_activations(), reason="this CPU has AVX512-BF16")
def test_auto_keeps_bf16_layers_on_float32_activations_without_avx512_bf16():
    llm = _llm(dtype="bfloat16")
    assert llm.llm_engine.executor.runner.activations == {"bf16": "float32"}
