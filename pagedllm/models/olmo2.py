"""OLMo 2: the Llama decoder with norms after attention and after the MLP (before each residual
add, none before), and q/k norms over the whole q and k projections rather than per head.

A norm over the whole q projection needs every head's values; split over ranks it would need
an all-reduce of the squares that transformers does not do (different rounding), so OLMo 2 runs
unsplit (tensor_parallel_size 1)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.errors import ValidationError
from pagedllm.models.decoder import (DecoderAttention, DecoderForCausalLM, DecoderMLP, Rope,
                                     make_norm)
from pagedllm.models.decoder_args import DecoderArgs


class Olmo2Attention(DecoderAttention):
    def init_qk_norm(self, args: DecoderArgs) -> None:
        self.q_norm = make_norm(args, args.num_heads * args.head_dim)
        self.k_norm = make_norm(args, args.num_kv_heads * args.head_dim)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.q_norm(qk[:, :self.q_size]), self.k_norm(qk[:, self.q_size:])), dim=1)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(args, layer_idx)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self.mlp = DecoderMLP(args)
        self.post_feedforward_layernorm = make_norm(args, args.hidden_size)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_cls = Olmo2DecoderLayer

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config, norm_kind="olmo2")

    def __init__(self, config: dict) -> None:
        tp = get_tp_group().world_size
        if tp > 1:
            raise ValidationError(
                f"tensor_parallel_size={tp} is not supported for OLMo 2: its q/k norms span "
                "every head of the projection and cannot be split exactly; use 1",
                "tensor_parallel_size")
        super().__init__(config)
