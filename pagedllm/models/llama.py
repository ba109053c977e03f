"""Llama-family decoder (Llama 2/3, Mistral without sliding window), and the building blocks
Qwen2 and Qwen3 reuse: they differ only in the flags of ``DecoderArgs``.

Module names follow HF checkpoints (``model.layers.N.self_attn...``) so the loader maps tensor
names one to one; q/k/v and gate/up are fused (``QKVParallelLinear``, ``MergedColumnParallelLinear``)
and loaded part by part.

Tensor parallelism is in the layers (see layers/linear.py): built inside a tensor-parallel group,
each rank holds ``num_heads / tp`` query heads, its KV heads, ``intermediate_size / tp`` MLP units
and ``vocab / tp`` vocabulary rows; the model code is the same at every size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.distributed.tp_sizes import check_tensor_parallel_size
from pagedllm.errors import ModelLoadError
from pagedllm.hf_config import usable_context
from pagedllm.layers import (Attention, GatedActivation, MergedColumnParallelLinear,
                             ParallelLMHead, QKVParallelLinear, RMSNorm, RopeConfig,
                             RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
                             apply_rotary)


@dataclass(frozen=True)
class DecoderArgs:
    """The model dimensions and variant flags, read once from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False     # Qwen2: always; Llama/Qwen3: attention_bias
    o_bias: bool = False       # Llama/Qwen3: attention_bias; Qwen2: never
    mlp_bias: bool = False
    qk_norm: bool = False      # Qwen3: RMSNorm over each head of q and k before rope

    @classmethod
    def from_hf(cls, config: dict, **overrides) -> DecoderArgs:
        def need(key: str):
            if config.get(key) is None:
                raise ModelLoadError(f"config.json lacks required field {key!r}")
            return config[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        attention_bias = bool(config.get("attention_bias", False))
        args = dict(
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=usable_context(config),  # capped at an active window
            rope=RopeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=config.get("hidden_act", "silu"),
            qkv_bias=attention_bias, o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)))
        args.update(overrides)
        return cls(**args)


class LlamaAttention(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(args.hidden_size, args.head_dim, args.num_heads,
                                          args.num_kv_heads, bias=args.qkv_bias)
        # This rank's heads (all of them at world size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size,
                                        bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, args.head_dim,
                              scale=args.head_dim ** -0.5, layer_idx=layer_idx)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_size, kv_size = self.qkv_proj.output_sizes[0], self.qkv_proj.output_sizes[1]
        qkv = self.qkv_proj(hidden_states)
        # q and k heads side by side, normed and rotated together (half the small ops):
        # [T, (H + Hkv) * D] -> [T, H + Hkv, D], a view of the projection output.
        qk = qkv[:, :q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = self._qk_norm(qk)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, H, D], [T, Hkv, D]
        return self.o_proj(self.attn(q, k, v))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """RMSNorm of every head; q heads scaled by q_norm's weight, k heads by k_norm's."""
        if qk.dtype != torch.float32 or self.q_norm.weight.dtype != torch.float32:
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                            self.k_norm.weight.expand(self.num_kv_heads, -1)))  # [H + Hkv, D]
        return torch.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps) * weight


class LlamaMLP(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [args.intermediate_size] * 2,
                                                       ["gate_proj", "up_proj"], bias=args.mlp_bias)
        self.act = GatedActivation(args.hidden_act)
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size,
                                           bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, head_dim] each, shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` on a flat batch (the
    attention metadata comes from the forward context); ``compute_logits`` -> float32 logits.

    Attributes the runner reads: num_layers, num_kv_heads, head_dim, vocab_size,
    max_position_embeddings (and hidden_size, num_heads). Head counts are this rank's (its KV
    cache holds only its KV heads); vocab_size is the whole vocabulary (the logits are gathered).
    """

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config)

    def __init__(self, config: dict) -> None:
        super().__init__()
        args = self.args_from_hf(config)
        check_tensor_parallel_size(config, get_tp_group().world_size)
        self.args = args
        self.model = LlamaModel(args)
        attn = self.model.layers[0].self_attn
        self.num_layers, self.num_heads = args.num_layers, attn.num_heads
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, args.head_dim
        self.hidden_size, self.vocab_size = args.hidden_size, args.vocab_size
        self.max_position_embeddings = args.max_position_embeddings
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the lm_head if the config says so. The loader calls it
        again after moving the model: ``to_empty``/``to`` give each module its own new tensor."""
        if self.args.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32."""
        return self.lm_head(hidden_states)
