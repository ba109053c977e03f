"""Gemma 2: the Llama decoder with Gemma's habits, shared by Gemma 3 (models/gemma3.py):

* embeddings multiplied by sqrt(hidden_size), rounded to the model dtype first (as transformers);
* every norm is ``(1 + weight) * x`` (``GemmaRMSNorm``), and each block has one before and one
  after it: four per layer;
* a gelu-tanh gated MLP (``hidden_activation``), attention scale ``query_pre_attn_scalar ** -0.5``;
* soft-capped attention scores and final logits (``cap * tanh(x / cap)``);
* sliding-window and global layers interleaved (``layer_types``; older configs: every other).
"""
from __future__ import annotations

import torch

from pagedllm.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel, Rope, make_norm
from pagedllm.models.decoder_args import DecoderArgs


def gemma_args(config: dict, default_pattern: int, **overrides) -> DecoderArgs:
    """What Gemma 2 and 3 read alike; ``default_pattern``: the sliding-window period of configs
    written before transformers listed ``layer_types``."""
    hidden = int(config["hidden_size"]) if "hidden_size" in config else None
    scalar = config.get("query_pre_attn_scalar")
    overrides = dict(
        norm_kind="gemma",
        hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh",
        attn_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_logits_soft_cap=config.get("attn_logit_softcapping"),
        final_logits_soft_cap=config.get("final_logit_softcapping"),
        embedding_multiplier=1.0 if hidden is None else hidden ** 0.5,
        # Gemma ties its head to the embedding; configs leave the default out.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        **overrides)
    return DecoderArgs.from_hf(config, default_pattern=default_pattern, **overrides)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)  # input_layernorm, post_attention_layernorm, ...
        self.pre_feedforward_layernorm = make_norm(args, args.hidden_size)
        self.post_feedforward_layernorm = make_norm(args, args.hidden_size)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(DecoderModel):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The multiplier rounded to the model dtype before the product, as transformers does.
        return x * torch.tensor(self.embedding_multiplier, dtype=x.dtype, device=x.device)


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_cls = GemmaDecoderLayer
    model_cls = GemmaModel

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return gemma_args(config, default_pattern=2)
