"""pagedllm: a compact, readable, vLLM-class inference engine.

The public surface is kept tiny; everything heavy (torch, transformers) is imported lazily so that
``import pagedllm`` stays cheap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "EngineConfig",
           "RequestOutput", "CompletionOutput", "LoRARequest", "PoolingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedllm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
