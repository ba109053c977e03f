"""GGUF metadata -> the Hugging Face style config dict pagedllm's models and engine read.

llama.cpp names its hyperparameters ``<arch>.<key>`` (``llama.block_count``,
``qwen2.attention.head_count_kv``...); the vocabulary size is the embedding's row count (the
token list can be shorter or longer by padding); the head is tied when the file has no
``output.weight``. What one architecture adds (experts, Gemma's soft-caps and windows,
Granite's multipliers, Phi-3's partial and long rope) is families.py's. Rope scaling:
``<arch>.rope.scaling.*`` keys for linear scaling; Llama 3.1+ files carry their llama3 scaling
as a ``rope_freqs.weight`` tensor of per-frequency divisors, from which the llama3 parameters
are recovered (and checked to reproduce it exactly).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pagedllm.checkpoint.gguf.encoders import ENCODER_ARCHITECTURES, encoder_config
from pagedllm.checkpoint.gguf.families import family_fields
from pagedllm.checkpoint.gguf.quant_types import F32, unpack
from pagedllm.checkpoint.gguf.reader import ARCHITECTURES, GGUFCheckpoint, open_gguf
from pagedllm.errors import ModelLoadError, UnsupportedModelError

# The candidate llama3 parameters: Llama 3.1/3.2/3.3 all use low 1, high 4, original 8192.
_LLAMA3_LOW_HIGH = ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0))
_LLAMA3_ORIGINAL = (8192, 4096, 16384, 32768, 131072)


def read_gguf_config(path: str | Path) -> dict:
    """The config dict of the GGUF checkpoint at ``path`` (metadata and tensor shapes only)."""
    return hf_config(open_gguf(path))


def hf_config(ckpt: GGUFCheckpoint) -> dict:
    arch = ckpt.architecture

    def key(name: str, default=None, required: bool = False):
        value = ckpt.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelLoadError(f"{ckpt.path.name} lacks the metadata field {arch}.{name}")
        return value

    if arch in ENCODER_ARCHITECTURES:  # bert, nomic-bert: an embedder's own fields
        return encoder_config(ckpt, key)
    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    embed = ckpt.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{ckpt.path.name} has no token_embd.weight tensor")
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads)
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embed.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        # Llama with biases on q/k/v/o (llama.cpp keeps them as attn_*.bias)
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in ckpt.tensors,
        "mlp_bias": False,
        "bos_token_id": ckpt.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(ckpt),
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(ckpt, arch, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    config.update(family_fields(ckpt, key, config))  # experts, soft-caps, windows, multipliers
    return config


def _eos_token_ids(ckpt: GGUFCheckpoint) -> int | list[int] | None:
    """The end-of-generation ids: llama.cpp stops on EOS and on the end-of-turn / end-of-message
    tokens a chat model declares (Llama 3's <|eot_id|>, <|eom_id|>), as generation_config.json's
    list does for HF folders."""
    ids = [ckpt.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope_scaling(ckpt: GGUFCheckpoint, arch: str, config: dict) -> dict | None:
    kind = ckpt.get(f"{arch}.rope.scaling.type")
    factor = ckpt.get(f"{arch}.rope.scaling.factor")
    freqs = ckpt.tensors.get("rope_freqs.weight")
    if freqs is not None:
        if freqs.type_id != F32:
            raise ModelLoadError(f"rope_freqs.weight must be F32, got {freqs.type_name}")
        return _llama3_from_factors(np.asarray(unpack(F32, freqs.data, freqs.shape), dtype=np.float64),
                                    config)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported; supported: none, "
                                "linear, llama3 (rope_freqs)", "model")


def _llama3_from_factors(factors: np.ndarray, config: dict) -> dict | None:
    """The llama3 rope parameters that give these per-frequency divisors (llama.cpp's converter
    computes them from factor, low/high_freq_factor and the original context); raise
    UnsupportedModelError when no candidate reproduces them."""
    head_dim, theta = config["head_dim"], config["rope_theta"]
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"rope_freqs.weight has shape {factors.shape}, expected ({head_dim // 2},)")
    factor = float(factors.max())
    if factor == 1.0:
        return None  # no frequency is scaled
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    for low, high in _LLAMA3_LOW_HIGH:
        for original in _LLAMA3_ORIGINAL:
            smooth = (original / wavelen - low) / (high - low)
            expected = np.where(wavelen < original / high, 1.0,
                                np.where(wavelen > original / low, factor,
                                         1.0 / ((1 - smooth) / factor + smooth)))
            if np.allclose(factors, expected, rtol=1e-5, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    raise UnsupportedModelError("rope_freqs.weight holds frequency divisors that no llama3 rope "
                                "scaling reproduces; supported: llama3 scaling, linear, none", "model")
