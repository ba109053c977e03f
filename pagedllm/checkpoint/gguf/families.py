"""What each GGUF architecture's own metadata means, as the config.json fields of the
transformers model pagedllm runs it as (config.py reads what every architecture shares).

Where llama.cpp writes no key and hardcodes a value instead, the value is llama.cpp's:
* Gemma 2/3 attention scale: ``1/sqrt(head_dim)``, except the 27B models (46 and 62 layers),
  which use ``1/sqrt(hidden_size / heads)``; windows on every 2nd (Gemma 2) / 6th-but-global
  (Gemma 3) layer unless the file lists ``attention.sliding_window_pattern``; Gemma 3's local
  rope base 10000 unless ``rope.freq_base_swa`` is written.
* Expert weights renormalised over the top k: Qwen3-MoE and Mixtral yes, Qwen2-MoE and OLMoE
  no, unless the file says ``expert_weights_norm``.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pagedllm.checkpoint.gguf.quant_types import F32, unpack
from pagedllm.checkpoint.gguf.reader import GGUFCheckpoint
from pagedllm.errors import ModelLoadError, UnsupportedModelError

Key = Callable[..., Any]  # key(name, default=None): the ``<arch>.<name>`` metadata value

# llama.cpp's 27B Gemma models, by layer count: their attention scale is hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_RENORMALIZE_DEFAULT = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}


def family_fields(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    """The config fields the architecture adds to (or overrides in) ``config``."""
    arch = ckpt.architecture
    fields: dict = {}
    if key("expert_count"):
        fields.update(_experts(ckpt, key, config))
    reader = _FAMILIES.get(arch)
    if reader is not None:
        fields.update(reader(ckpt, key, {**config, **fields}))
    return fields


def _experts(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    arch = ckpt.architecture
    if arch not in _RENORMALIZE_DEFAULT:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported; "
                                    f"supported: {', '.join(sorted(_RENORMALIZE_DEFAULT))}", "model")
    renormalize = key("expert_weights_norm")
    fields = {"num_experts": int(key("expert_count")),
              "num_experts_per_tok": int(key("expert_used_count", required=True)),
              "moe_intermediate_size": int(key("expert_feed_forward_length")
                                           or config["intermediate_size"]),
              "norm_topk_prob": bool(_RENORMALIZE_DEFAULT[arch] if renormalize is None
                                     else renormalize)}
    if arch == "llama":  # Mixtral: llama.cpp writes it as Llama with experts
        fields.update(architectures=["MixtralForCausalLM"], num_local_experts=fields["num_experts"])
    shared = key("expert_shared_feed_forward_length")
    if shared:
        fields["shared_expert_intermediate_size"] = int(shared)
    if arch == "qwen2moe":
        fields["qkv_bias"] = "blk.0.attn_q.bias" in ckpt.tensors
    return fields


def _window_layers(key: Key, num_layers: int) -> dict:
    """``layer_types`` from the per-layer sliding flags, when the file lists them."""
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list):
        return {}
    if len(pattern) != num_layers:
        raise ModelLoadError(f"attention.sliding_window_pattern lists {len(pattern)} layers, "
                             f"the model has {num_layers}")
    return {"layer_types": ["sliding_attention" if swa else "full_attention" for swa in pattern]}


def _gemma(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    arch = ckpt.architecture
    head_dim, layers = config["head_dim"], config["num_hidden_layers"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    scale = key("attention.scale")
    fields = {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        # transformers' spelling of the scale: query_pre_attn_scalar ** -0.5
        "query_pre_attn_scalar": (float(scale) ** -2 if scale else
                                  config["hidden_size"] // config["num_attention_heads"] if big
                                  else head_dim),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "sliding_window": key("attention.sliding_window"),
        **_window_layers(key, layers),
    }
    if arch == "gemma3":
        fields["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    return fields


def _phi3(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    head_dim = config["hidden_size"] // config["num_attention_heads"]  # no key_length for Phi-3
    rope_dims = int(key("rope.dimension_count") or head_dim)
    fields = {"head_dim": head_dim, "partial_rotary_factor": rope_dims / head_dim,
              "sliding_window": key("attention.sliding_window") or None}
    long, short = (ckpt.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short"))
    if (long is None) != (short is None):
        raise ModelLoadError(f"{ckpt.path.name} has only one of rope_factors_long/short")
    if long is not None:
        original = key("rope.scaling.original_context_length", required=True)
        fields["rope_scaling"] = {"rope_type": "longrope", "long_factor": _factors(long),
                                  "short_factor": _factors(short),
                                  "original_max_position_embeddings": int(original)}
        fields["original_max_position_embeddings"] = int(original)
    return fields


def _factors(tensor) -> list[float]:
    if tensor.type_id != F32:
        raise ModelLoadError(f"{tensor.name} must be F32, got {tensor.type_name}")
    return [float(f) for f in np.asarray(unpack(F32, tensor.data, tensor.shape)).reshape(-1)]


def _granite(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    return {"attention_multiplier": float(key("attention.scale", 1.0)),
            "embedding_multiplier": float(key("embedding_scale", 1.0)),
            "residual_multiplier": float(key("residual_scale", 1.0)),
            "logits_scaling": float(key("logit_scale", 1.0))}


def _olmo2(ckpt: GGUFCheckpoint, key: Key, config: dict) -> dict:
    if key("attention.sliding_window"):
        raise UnsupportedModelError("GGUF olmo2 files with a sliding window are OLMo 3, which "
                                    "pagedllm does not run; supported: OLMo 2", "model")
    return {}


_FAMILIES: dict[str, Callable[[GGUFCheckpoint, Key, dict], dict]] = {
    "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3, "granite": _granite, "olmo2": _olmo2}
