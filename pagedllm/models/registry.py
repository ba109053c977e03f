"""Architecture name (``config.json["architectures"]``) -> model class."""
from __future__ import annotations

from torch import nn

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama with a sliding window; hf_config.usable_context caps the context (the
    # engine's max_model_len included) at the window until sliding-window attention exists.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: dict) -> type[nn.Module]:
    """The class of the first architecture in ``config`` that pagedllm supports."""
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in _MODELS:
            return _MODELS[name]
    raise UnsupportedModelError(
        f"model architecture {architectures or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}", "model")
