"""Architecture name (``config.json["architectures"]``) -> model class."""
from __future__ import annotations

from torch import nn

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from pagedllm.models.embedding_gemma import Gemma3TextModel
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedllm.models.gpt_oss import GptOssForCausalLM
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mimo import MiMoForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.modernbert import ModernBertForSequenceClassification, ModernBertModel
from pagedllm.models.nomic_bert import NomicBertModel
from pagedllm.models.olmo2 import Olmo2ForCausalLM
from pagedllm.models.olmoe import OlmoeForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedllm.models.smollm3 import SmolLM3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral and Ministral are Llama with a sliding window (a window per layer: layer specs).
    "MinistralForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MiMoForCausalLM": MiMoForCausalLM,  # Qwen2 with MTP layers (speculative method "mtp")
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,  # mixture-of-experts families (models/moe.py)
    "GptOssForCausalLM": GptOssForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Encoders: pooling models only (embeddings, cross-encoders; models/bert.py).
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaModel": XLMRobertaModel,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "NomicBertModel": NomicBertModel,
    "Gemma3TextModel": Gemma3TextModel,  # EmbeddingGemma (models/embedding_gemma.py)
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
