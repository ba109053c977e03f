"""llama.cpp tensor names -> Hugging Face checkpoint names, and the row order llama.cpp's
converter gives Llama's q/k projections.

llama.cpp computes rope on interleaved pairs (dims 2i, 2i+1) while HF Llama rotates halves (dims
i, i + D/2), so ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj`` and ``k_proj`` (weight
and bias) of every head from HF order ``(two halves, D/2)`` to ``(D/2, pairs)``. Loading undoes
it: HF row ``h*D + t*D/2 + i`` is file row ``h*D + 2i + t``. Only the ``llama`` architecture is
permuted (llama.cpp runs Qwen2/Qwen3 with NEOX rope, which is the half layout). A permutation
of whole rows applies to block-quantized rows unchanged (a row's blocks move together).
"""
from __future__ import annotations

import re

import numpy as np

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that configure rather than weigh: read by config.py, not loaded.
CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor, None for one pagedllm does not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match is None or match[2] not in _LAYER:
        return None
    return f"model.layers.{match[1]}.{_LAYER[match[2]]}.{match[3]}"


def is_permuted(gguf_name: str, architecture: str) -> bool:
    """Whether the rows of this tensor are in llama.cpp's rope-pair order."""
    return architecture == "llama" and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name) is not None


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Index array ``perm`` with ``hf_rows = file_rows[perm]`` for a permuted q or k projection of
    ``num_heads`` heads (the KV heads for k)."""
    half = num_rows // num_heads // 2
    # file row of (head h, pair i, member t) is h*D + 2i + t; read it at HF position (h, t, i)
    return np.arange(num_rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)
