"""Model building blocks: paged attention, norms, rotary embedding, linear layers."""
from __future__ import annotations

from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.attention import ATTENTION_BACKENDS, Attention, AttentionBackend, KVCacheSpec, get_attn_backend
from pagedllm.layers.attention_metadata import AttentionMetadata, DecodeBatch, PrefillChunk, build_attention_metadata
from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.forward_context import get_attn_metadata, set_forward_context
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.kv_cache import attention_layers, bind_kv_caches, copy_blocks, kv_cache_layers, kv_cache_shape
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (
                                       ColumnParallelLinear,
                                       Linear,
                                       MergedColumnParallelLinear,
                                       QKVParallelLinear,
                                       RowParallelLinear,
                                       WeightSlice,
                                       hold,
)
from pagedllm.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

__all__ = [
    "ATTENTION_BACKENDS", "Attention", "AttentionBackend", "AttentionMetadata", "ColumnParallelLinear",
    "DecodeBatch", "FusedMoE", "GatedActivation", "KVCacheSpec", "Linear", "MergedColumnParallelLinear",
    "ParallelLMHead",
    "PrefillChunk", "QKVParallelLinear", "RMSNorm", "RopeConfig", "RotaryEmbedding",
    "RowParallelLinear", "VocabParallelEmbedding", "WeightSlice",
    "apply_rotary", "attention_layers", "bind_kv_caches", "build_attention_metadata",
    "copy_blocks", "get_attn_backend", "get_attn_metadata", "kv_cache_layers", "kv_cache_shape",
    "hold", "set_forward_context",
]
