"""ModernBERT: a pre-norm encoder with rotary positions, a GeGLU MLP, no biases, and local
attention (each token sees those within half the window on either side) on all but every
n-th layer, whose attention is global. Like BERT, its attention is the shared layer with
``causal=False`` (no KV). ``ModernBertForSequenceClassification`` adds transformers' head
(dense, activation, norm) and a linear classifier over the CLS row or the mean of the rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear
from pagedllm.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def _layer_types(config: dict) -> list[str]:
    """transformers 5 writes layer_types; older configs a period (global_attn_every_n_layers)."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    every = config.get("global_attn_every_n_layers", 3)
    return ["sliding_attention" if i % every else "full_attention" for i in range(config["num_hidden_layers"])]


def _rope_theta(config: dict, layer_type: str) -> float:
    params = (config.get("rope_parameters") or {}).get(layer_type) or {}
    legacy = config.get("global_rope_theta", 160000.0) if layer_type == "full_attention" else \
        config.get("local_rope_theta", 10000.0)
    return float(params.get("rope_theta", legacy))


class ModernBertAttention(nn.Module):
    def __init__(self, config: dict, window: int | None, theta: float, layer_idx: int) -> None:
        super().__init__()
        hidden, bias = config["hidden_size"], config.get("attention_bias", False)
        self.num_heads = config["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.Wqkv = Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = Linear(hidden, hidden, bias=bias)
        # window: the largest distance a token sees; the layer's sliding_window excludes its own.
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5, layer_idx,
                              sliding_window=None if window is None else window + 1, causal=False)
        # The shared rope (its inv_freq a real float32 tensor even though the loader builds on meta).
        self.rotary_emb = RotaryEmbedding(self.head_dim, RopeConfig(theta=theta))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions, x.dtype)
        q, k, v = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [T, H, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.Wo(self.attn(q, k, v))


class ModernBertMLP(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, inter, bias = config["hidden_size"], config["intermediate_size"], config.get("mlp_bias", False)
        self.Wi = Linear(hidden, 2 * inter, bias=bias)
        self.Wo = Linear(inter, hidden, bias=bias)
        self.act = _ACTIVATIONS[config.get("hidden_activation", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(up) * gate)


def _norm(config: dict) -> nn.LayerNorm:
    return nn.LayerNorm(config["hidden_size"], eps=config.get("norm_eps", 1e-5), bias=config.get("norm_bias", False))


class ModernBertLayer(nn.Module):
    def __init__(self, config: dict, i: int, layer_type: str) -> None:
        super().__init__()
        window = config.get("local_attention", 128) // 2 if layer_type == "sliding_attention" else None
        self.attn_norm = _norm(config) if i else nn.Identity()  # the embedding's norm serves layer 0
        self.attn = ModernBertAttention(config, window, _rope_theta(config, layer_type), i)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``: whole inputs only."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, t) for i, t in enumerate(_layer_types(config)))
        self.final_norm = _norm(config)
        self.vocab_size, self.hidden_size = config["vocab_size"], config["hidden_size"]
        self.num_layers, self.num_heads = config["num_hidden_layers"], config["num_attention_heads"]
        self.max_position_embeddings = config.get("max_position_embeddings", 8192)
        # The masked-LM head a checkpoint may carry is not an embedder's.
        self.skipped_checkpoint_prefixes = ("head.", "decoder.")
        self.checkpoint_renames = {"model.": ""}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.dense = Linear(config["hidden_size"], config["hidden_size"], bias=config.get("classifier_bias", False))
        self.act = _ACTIVATIONS[config.get("classifier_activation", "gelu")]
        self.norm = _norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(nn.Module):
    """The encoder, then ``classify`` on each request's pooled row (CLS or mean, the config's
    ``classifier_pooling``, which the pooler config reads)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        self.classifier = Linear(config["hidden_size"], num_labels)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            setattr(self, name, getattr(self.model, name))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` pooled rows -> ``[B, num_labels]`` logits."""
        return self.classifier(self.head(pooled))
