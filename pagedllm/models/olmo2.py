"""OLMo 2: the Llama decoder with norms after attention and after the MLP (before each residual
add, none before), and q/k norms over the whole q and k projections rather than per head.

Under tensor parallelism a rank holds only its heads of q and k, so a whole-projection norm
needs the sum of squares over every rank: each rank sums its slice's squares (q and k side by
side, ``[T, 2]``), one all-reduce adds them up, and each rank scales its own slice with its
part of the (replicated) weight. A KV head held by several ranks (fewer KV heads than ranks)
is counted once: each holder contributes its sum divided by the number of holders.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderMLP, Rope, make_norm
from pagedllm.models.decoder_args import DecoderArgs


class Olmo2Attention(DecoderAttention):
    def init_qk_norm(self, args: DecoderArgs) -> None:
        # The whole projection's weights on every rank (small); a rank applies its slice.
        self.q_norm = make_norm(args, args.num_heads * args.head_dim)
        self.k_norm = make_norm(args, args.num_kv_heads * args.head_dim)
        self.tp = get_tp_group()
        rank, world = self.tp.rank, self.tp.world_size
        self.q_start = rank * self.q_size  # this rank's first q column of the whole projection
        self.k_start = rank * args.num_kv_heads // world * args.head_dim
        self.kv_holders = world * self.num_kv_heads // args.num_kv_heads  # ranks per KV head

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        q, k = qk[:, :self.q_size], qk[:, self.q_size:]
        if self.tp.world_size == 1:
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q32, k32 = q.to(torch.float32), k.to(torch.float32)
        squares = torch.stack((q32.pow(2).sum(-1), k32.pow(2).sum(-1) / self.kv_holders), dim=-1)
        squares = self.tp.all_reduce(squares)  # [T, 2]: the whole projections' sums of squares
        return torch.cat((_scaled(self.q_norm, q32, squares[:, :1], self.q_start, q.dtype),
                          _scaled(self.k_norm, k32, squares[:, 1:], self.k_start, k.dtype)), dim=1)


def _scaled(norm: nn.Module, x32: torch.Tensor, sum_squares: torch.Tensor, start: int,
            dtype: torch.dtype) -> torch.Tensor:
    """``norm`` of the whole projection restricted to this rank's columns ``[start, start +
    width)``, given the whole projection's sum of squares ``[T, 1]`` (OLMo 2's order: scaled by
    the weight in float32, then cast back)."""
    size = norm.weight.shape[0]
    x32 = x32 * torch.rsqrt(sum_squares / size + norm.eps)
    return (norm.weight[start:start + x32.shape[-1]].to(torch.float32) * x32).to(dtype)


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
