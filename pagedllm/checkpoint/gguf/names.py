"""llama.cpp tensor names -> Hugging Face checkpoint names, and the ways llama.cpp's converter
changes a tensor's values on the way into the file, undone here.

* Row order: llama.cpp computes rope on interleaved pairs (dims 2i, 2i+1) while HF Llama
  rotates halves (dims i, i + D/2), so ``convert_hf_to_gguf.py`` permutes the rows of
  ``q_proj`` and ``k_proj`` (weight and bias) of every head from HF order ``(two halves, D/2)``
  to ``(D/2, pairs)`` for the architectures it converts as Llama (``llama``, Mixtral included,
  and ``granite``). Loading undoes it: HF row ``h*D + t*D/2 + i`` is file row ``h*D + 2i + t``.
  The others run with NEOX rope, the half layout, and are stored unpermuted. A permutation of
  whole rows applies to block-quantized rows unchanged (a row's blocks move together).
* Gemma's norms: HF stores ``w`` and computes ``(1 + w) * x``; the converter stores ``w + 1``
  (every ``*norm.weight`` of ``gemma2``/``gemma3``), so loading subtracts the shift again.
* Experts: one ``ffn_{gate,up,down}_exps`` tensor per layer stacks every expert's projection,
  ``[E, out, in]`` in numpy order; the loader splits it into the per-expert HF names.
* Phi-3 keeps HF's fused ``qkv_proj`` (``attn_qkv``) and ``gate_up_proj`` (written as ``ffn_up``).
* Gemma and OLMo 2 have norms after the blocks: ``post_attention_norm`` is HF's
  ``post_attention_layernorm`` there, and Gemma's ``ffn_norm`` its ``pre_feedforward_layernorm``
  (for Llama-style files ``ffn_norm`` is the ``post_attention_layernorm`` before the MLP).
"""
from __future__ import annotations

import re

import numpy as np

from pagedllm.checkpoint.gguf.encoders import ENCODER_ARCHITECTURES, encoder_hf_name

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
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, the stacked experts, Qwen2-MoE's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA_LAYER = {"ffn_norm": "pre_feedforward_layernorm"}
# What an architecture names differently from the table above.
_ARCH_LAYER = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER,
               "phi3": {"ffn_up": "mlp.gate_up_proj"}}
_PERMUTED_ARCHITECTURES = frozenset({"llama", "granite"})
_NORM_SHIFTED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that configure rather than weigh: read by config.py, not loaded.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                            "rope_factors_short.weight"})
# The stacked experts' HF projection name -> its index in a model's (gate, up, down) names.
EXPERT_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


def hf_name(gguf_name: str, architecture: str, model_prefix: str = "") -> str | None:
    """The HF checkpoint name of a llama.cpp tensor, None for one pagedllm does not know. A
    stacked-experts tensor gets the name ``model.layers.L.mlp.experts.<gate|up|down>_proj.weight``
    (the loader splits it per expert: ``expert_names``); ``model_prefix``: an encoder
    classifier's (encoders.encoder_model_prefix)."""
    if architecture in ENCODER_ARCHITECTURES:
        return encoder_hf_name(gguf_name, architecture, model_prefix)
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match is None:
        return None
    module = _ARCH_LAYER.get(architecture, {}).get(match[2]) or _LAYER.get(match[2])
    if module is None:
        return None
    return f"model.layers.{match[1]}.{module}.{match[3]}"


def is_expert_stack(gguf_name: str) -> bool:
    return re.search(r"\.ffn_(gate|up|down)_exps\.weight$", gguf_name) is not None


def expert_names(stacked_hf_name: str, num_experts: int,
                 names: tuple[str, str, str]) -> list[str]:
    """The per-expert HF names of a stacked-experts tensor, in the model's spelling of the
    (gate, up, down) projections (Mixtral's ``w1``, ``w3``, ``w2``)."""
    prefix, _, projection = stacked_hf_name.removesuffix(".weight").rpartition(".")
    name = names[EXPERT_PROJECTIONS[projection]]
    return [f"{prefix}.{e}.{name}.weight" for e in range(num_experts)]


def norm_shift(gguf_name: str, architecture: str) -> float:
    """What the converter added to this tensor's values (Gemma's norms: 1)."""
    return 1.0 if (architecture in _NORM_SHIFTED_ARCHITECTURES
                   and gguf_name.endswith("norm.weight")) else 0.0


def is_permuted(gguf_name: str, architecture: str) -> bool:
    """Whether the rows of this tensor are in llama.cpp's rope-pair order."""
    return (architecture in _PERMUTED_ARCHITECTURES
            and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name) is not None)


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Index array ``perm`` with ``hf_rows = file_rows[perm]`` for a permuted q or k projection of
    ``num_heads`` heads (the KV heads for k)."""
    half = num_rows // num_heads // 2
    # file row of (head h, pair i, member t) is h*D + 2i + t; read it at HF position (h, t, i)
    return np.arange(num_rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)
