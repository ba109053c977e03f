"""OLMoE: sparse expert MLPs on every layer (softmax then top-k, renormalised when
``norm_topk_prob``) and an RMSNorm over the whole q projection and the whole k projection (not
per head, unlike Qwen3), then optionally ``clip_qkv``: q, k and v clamped to +-clip.

Under tensor parallelism a rank holds only some heads, so each norm gathers the whole projection
from the ranks first (one copy of each head: ranks that replicate a KV head send the same one),
normalises it with the whole weight (replicated) and keeps this rank's heads (vLLM does the same).
"""
from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers import RMSNorm, apply_rotary
from pagedllm.models.decoder import DecoderAttention, Rope
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.moe import MoEArgs, MoEForCausalLM


class OlmoeAttention(DecoderAttention):
    def __init__(self, args: DecoderArgs, layer_idx: int, clip_qkv: float | None) -> None:
        super().__init__(args, layer_idx)
        self.q_norm = RMSNorm(args.num_heads * args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.num_kv_heads * args.head_dim, args.rms_norm_eps)
        self.clip_qkv = clip_qkv
        self.tp = get_tp_group()
        self.num_total_heads, self.num_total_kv_heads = args.num_heads, args.num_kv_heads

    def init_qk_norm(self, args: DecoderArgs) -> None:
        pass  # the whole-projection norms are built in __init__ (sizes differ from per head)

    def forward(self, hidden_states: torch.Tensor, rope: Rope) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        q = self._norm_all_heads(self.q_norm, q, self.num_heads, self.num_total_heads,
                                 self.tp.rank * self.num_heads)
        k = self._norm_all_heads(self.k_norm, k, self.num_kv_heads, self.num_total_kv_heads,
                                 self.tp.rank * self.num_total_kv_heads // self.tp.world_size)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        # q and k heads side by side, rotated together: [T, H + Hkv, D].
        qk = torch.cat((q, k), dim=-1).view(num_tokens, self.num_heads + self.num_kv_heads,
                                            self.head_dim)
        if rope is not None:
            qk = apply_rotary(qk, *rope)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v))

    def _norm_all_heads(self, norm: RMSNorm, x: torch.Tensor, num_heads: int, num_total_heads: int,
                        first_head: int) -> torch.Tensor:
        """``norm`` over all ``num_total_heads`` heads of a projection of which ``x`` [T, heads
        * D] holds this rank's ``num_heads``, starting at head ``first_head``."""
        if self.tp.world_size == 1:
            return norm(x)
        num_tokens = x.shape[0]
        full = self.tp.all_gather(x, dim=-1).view(num_tokens, self.tp.world_size, -1)
        holders = self.tp.world_size * num_heads // num_total_heads  # ranks per head (replicas)
        full = full[:, ::holders].reshape(num_tokens, -1)  # [T, total heads * D]
        return norm(full)[:, first_head * self.head_dim:(first_head + num_heads) * self.head_dim]


class OlmoeForCausalLM(MoEForCausalLM):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        clip = config.get("clip_qkv")
        for i, layer in enumerate(self.decoder.layers):
            layer.self_attn = OlmoeAttention(self.args, i, None if clip is None else float(clip))

    @classmethod
    def moe_args_from_hf(cls, config: dict) -> MoEArgs:
        return MoEArgs.from_hf(config, decoder_sparse_step=1, mlp_only_layers=())
