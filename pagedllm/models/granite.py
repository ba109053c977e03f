"""Granite 3: the Llama decoder with four scalars: embeddings multiplied by
``embedding_multiplier``, each block's output by ``residual_multiplier`` before the residual
add, ``attention_multiplier`` as the attention scale, and logits divided by ``logits_scaling``."""
from __future__ import annotations

import torch

from pagedllm.models.decoder import DecoderForCausalLM, DecoderLayer, Rope
from pagedllm.models.decoder_args import DecoderArgs


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteForCausalLM(DecoderForCausalLM):
    layer_cls = GraniteDecoderLayer

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(
            config, attn_scale=float(config.get("attention_multiplier", 1.0)),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            logits_scaling=float(config.get("logits_scaling", 1.0)))
