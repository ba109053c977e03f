"""BERT and XLM-RoBERTa encoders: absolute positions, token types, post-norm, GELU, attention
over the whole input in both directions (the shared attention layer with ``causal=False``: it
keeps no KV, a pooling request runs its whole input in one step).

Token types (a text pair's second segment) come from the step's forward context, beside the
positions (layers/forward_context.py; compiled, through the op in layers/token_type_ids.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear
from pagedllm.layers.token_type_ids import step_token_type_ids

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertEmbeddings(nn.Module):
    def __init__(self, config: dict, position_offset: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset  # XLM-R counts positions from padding_idx + 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        token_types = step_token_type_ids(input_ids)
        if token_types is None:  # every row type 0: one row of the table for all
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.query, self.key, self.value = Linear(hidden, hidden), Linear(hidden, hidden), Linear(hidden, hidden)
        self.attn = Attention(num_heads, num_heads, self.head_dim, self.head_dim ** -0.5, layer_idx, causal=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).view(-1, self.num_heads, self.head_dim) for p in (self.query, self.key, self.value))
        return self.attn(q, k, v)  # [T, hidden]


class BertOutput(nn.Module):
    """A projection, the residual, then LayerNorm (post-norm)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, eps: float, layer_idx: int) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, num_heads, layer_idx)
        self.output = BertOutput(hidden, hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.dense = Linear(hidden, intermediate)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.attention = BertAttention(hidden, config["num_attention_heads"], eps, layer_idx)
        self.intermediate = BertIntermediate(hidden, config["intermediate_size"], config.get("hidden_act", "gelu"))
        self.output = BertOutput(config["intermediate_size"], hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config["num_hidden_layers"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    """BERT's own pooler (dense + tanh over the CLS row), which its classifier reads."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertModel(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` on a flat batch of whole
    inputs (the attention metadata's ``query_start_loc`` says where each starts)."""

    supports_token_types = True
    position_offset = 0

    def __init__(self, config: dict, add_pooling_layer: bool = False) -> None:
        super().__init__()
        if config["hidden_size"] % config["num_attention_heads"]:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        self.embeddings = BertEmbeddings(config, self.position_offset_for(config))
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config["hidden_size"]) if add_pooling_layer else None
        self.vocab_size, self.hidden_size = config["vocab_size"], config["hidden_size"]
        self.num_layers, self.num_heads = config["num_hidden_layers"], config["num_attention_heads"]
        self.max_position_embeddings = config["max_position_embeddings"] - self.position_offset_for(config)
        # sentence-transformers saves BertModel's pooler too; only a classifier reads it.
        self.skipped_checkpoint_prefixes = () if add_pooling_layer else ("pooler.",)

    @classmethod
    def position_offset_for(cls, config: dict) -> int:
        return cls.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions))


class BertForSequenceClassification(nn.Module):
    """BERT, its pooler, then a linear classifier (a cross-encoder's relevance with one label)."""

    supports_token_types = True

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.bert = BertModel(config, add_pooling_layer=True)
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        self.classifier = Linear(config["hidden_size"], num_labels)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            setattr(self, name, getattr(self.bert, name))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids, positions)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` CLS rows -> ``[B, num_labels]`` logits."""
        return self.classifier(self.bert.pooler(cls_rows))


class XLMRobertaModel(BertModel):
    """BERT with positions counted from ``pad_token_id + 1`` and one token type."""

    supports_token_types = False

    @classmethod
    def position_offset_for(cls, config: dict) -> int:
        # position_offset: a table already cut to the positions read (llama.cpp's GGUF)
        return config.get("position_offset", config.get("pad_token_id", 1) + 1)


class XLMRobertaClassificationHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden)
        self.out_proj = Linear(hidden, num_labels)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


class XLMRobertaForSequenceClassification(nn.Module):
    """XLM-R, then RoBERTa's classification head (dense, tanh, projection) on the CLS row:
    bge-reranker-v2-m3."""

    supports_token_types = False

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.roberta = XLMRobertaModel(config)
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        self.classifier = XLMRobertaClassificationHead(config["hidden_size"], num_labels)
        self.skipped_checkpoint_prefixes = ("roberta.pooler.",)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            setattr(self, name, getattr(self.roberta, name))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.roberta(input_ids, positions)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(cls_rows)
