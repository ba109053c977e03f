"""NomicBERT (nomic-embed-text v1/v1.5): a post-norm BERT whose positions are rotary (no position
table), with a fused qkv projection, a SwiGLU MLP and no biases.

The checkpoint ships remote code (``NomicBertModel``, a GPT-2-style config: ``n_embd``,
``n_head``, ``n_layer``, ``n_inner``, ``n_positions``); its layout is read here by hand:
``embeddings.{word,token_type}_embeddings``, ``emb_ln``, then per layer ``attn.Wqkv``,
``attn.out_proj``, ``norm1``, ``mlp.fc11`` (up), ``mlp.fc12`` (gate), ``mlp.fc2``, ``norm2``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear
from pagedllm.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from pagedllm.layers.token_type_ids import step_token_type_ids

_GATES = {"swiglu": F.silu, "geglu": F.gelu}


def _intermediate(config: dict) -> int:
    """The gated MLP's width: ``n_inner`` (default 8/3 of hidden) rounded up to 256, as the
    remote code sizes it."""
    width = config.get("n_inner") or int(8 * config["n_embd"] / 3)
    return -(-width // 256) * 256


def _vocab_size(config: dict) -> int:
    """The embedding table's rows: the vocabulary padded to ``pad_vocab_size_multiple``."""
    multiple = config.get("pad_vocab_size_multiple") or 1
    return -(-config["vocab_size"] // multiple) * multiple


def _check(config: dict) -> None:
    unsupported = {"prenorm": True, "rotary_emb_interleaved": True, "causal": True}
    for key, bad in unsupported.items():
        if config.get(key, False) == bad:
            raise ModelLoadError(f"NomicBERT with {key}={bad} is not supported")
    if config.get("rotary_scaling_factor") or config.get("rotary_emb_scale_base"):
        raise ModelLoadError("NomicBERT with rotary scaling is not supported")
    if config.get("activation_function", "swiglu") not in _GATES:
        raise ModelLoadError(f"NomicBERT activation {config.get('activation_function')!r} is not supported; "
                             f"expected one of {sorted(_GATES)}")


class NomicBertAttention(nn.Module):
    def __init__(self, config: dict, layer_idx: int) -> None:
        super().__init__()
        hidden, self.num_heads = config["n_embd"], config["n_head"]
        self.head_dim = hidden // self.num_heads
        bias = config.get("qkv_proj_bias", False)
        self.Wqkv = Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5, layer_idx,
                              causal=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        return self.out_proj(self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v))


class NomicBertGatedMLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, inter = config["n_embd"], _intermediate(config)
        self.fc11 = Linear(hidden, inter, bias=config.get("mlp_fc1_bias", False))
        self.fc12 = Linear(hidden, inter, bias=config.get("mlp_fc1_bias", False))
        self.fc2 = Linear(inter, hidden, bias=config.get("mlp_fc2_bias", False))
        self.gate = _GATES[config.get("activation_function", "swiglu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc11(x) * self.gate(self.fc12(x)))


class NomicBertBlock(nn.Module):
    def __init__(self, config: dict, layer_idx: int) -> None:
        super().__init__()
        eps = config.get("layer_norm_epsilon", 1e-12)
        self.attn = NomicBertAttention(config, layer_idx)
        self.mlp = NomicBertGatedMLP(config)
        self.norm1 = nn.LayerNorm(config["n_embd"], eps=eps)
        self.norm2 = nn.LayerNorm(config["n_embd"], eps=eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.attn(x, cos, sin) + x)
        return self.norm2(self.mlp(x) + x)


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(_vocab_size(config), config["n_embd"])
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), config["n_embd"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        token_types = step_token_type_ids(input_ids)
        if token_types is None:
            return self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.word_embeddings(input_ids) + self.token_type_embeddings(token_types)


class NomicBertEncoder(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NomicBertBlock(config, i) for i in range(config["n_layer"]))


class NomicBertModel(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, n_embd]``: whole inputs only."""

    supports_token_types = True

    def __init__(self, config: dict) -> None:
        super().__init__()
        _check(config)
        if config["n_embd"] % config["n_head"]:
            raise ModelLoadError("NomicBERT's n_embd must be a multiple of n_head")
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_ln = nn.LayerNorm(config["n_embd"], eps=config.get("layer_norm_epsilon", 1e-12))
        self.encoder = NomicBertEncoder(config)
        head_dim = config["n_embd"] // config["n_head"]
        self.rotary_emb = RotaryEmbedding(head_dim, RopeConfig(
            theta=float(config.get("rotary_emb_base", 10000.0)),
            partial_rotary_factor=float(config.get("rotary_emb_fraction", 1.0))))
        self.vocab_size, self.hidden_size = _vocab_size(config), config["n_embd"]
        self.num_layers, self.num_heads = config["n_layer"], config["n_head"]
        self.max_position_embeddings = config.get("n_positions", 2048)
        # A checkpoint saved with its pretraining head prefixes the encoder's names with bert.
        self.checkpoint_renames = {"bert.": ""}
        self.skipped_checkpoint_prefixes = ("cls.", "pooler.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.emb_ln(self.embeddings(input_ids))
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        return x
