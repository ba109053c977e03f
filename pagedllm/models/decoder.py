"""The decoder every dense family builds on (Llama's), assembled from ``DecoderArgs`` and its
per-layer ``LayerSpec``s: a family overrides a class (its layer, its attention's q/k norm) or a
knob, never a branch in ``forward``.

Module names follow HF checkpoints (``model.layers.N.self_attn...``) so the loader maps tensor
names one to one; q/k/v and gate/up are fused (``QKVParallelLinear``, ``MergedColumnParallelLinear``)
and loaded part by part.

Tensor parallelism is in the layers (see layers/linear.py): built inside a tensor-parallel group,
each rank holds ``num_heads / tp`` query heads, its KV heads, ``intermediate_size / tp`` MLP units
and ``vocab / tp`` vocabulary rows; the model code is the same at every size.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.hf_config import text_config
from pagedllm.layers import (
    Attention,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
)
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.models.decoder_args import DecoderArgs

Rope = tuple[torch.Tensor, torch.Tensor] | None  # one layer's (cos, sin), or None: no rotary


def make_norm(args: DecoderArgs, size: int) -> nn.Module:
    if args.norm_kind == "gemma":
        return GemmaRMSNorm(size, args.rms_norm_eps)
    return RMSNorm(size, args.rms_norm_eps, scale_in_float32=args.norm_kind == "olmo2")


class DecoderAttention(nn.Module):
    qkv_cls = QKVParallelLinear  # Phi-3 swaps in one that reads its fused checkpoint tensor

    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__()
        spec = args.layers[layer_idx]
        head_dim = args.layer_head_dim(layer_idx)
        self.qkv_proj = self.qkv_cls(args.hidden_size, head_dim, args.num_heads,
                                     args.layer_num_kv_heads(layer_idx), bias=args.qkv_bias)
        # This rank's heads (all of them at world size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[0], self.qkv_proj.output_sizes[1]
        self.o_proj = RowParallelLinear(args.num_heads * head_dim, args.hidden_size,
                                        bias=args.o_bias)
        self.init_qk_norm(args)
        scale = head_dim ** -0.5 if args.attn_scale is None else args.attn_scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=scale,
                              layer_idx=layer_idx, sliding_window=spec.sliding_window,
                              logits_soft_cap=args.attn_logits_soft_cap)

    def init_qk_norm(self, args: DecoderArgs) -> None:
        if args.qk_norm:
            self.q_norm = make_norm(args, self.head_dim)
            self.k_norm = make_norm(args, self.head_dim)

    def forward(self, hidden_states: torch.Tensor, rope: Rope) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        # q and k heads side by side, normed and rotated together (half the small ops):
        # [T, (H + Hkv) * D] -> [T, H + Hkv, D], a view of the projection output.
        qk = self.norm_qk(qkv[:, :self.q_size + self.kv_size])
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if rope is not None:
            qk = apply_rotary(qk, *rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, H, D], [T, Hkv, D]
        return self.o_proj(self.attn(q, k, v))

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """``[T, (H + Hkv) * D]`` -> the same, q and k normed (per head when the model says so)."""
        if not hasattr(self, "q_norm"):
            return qk
        heads = qk.view(qk.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)
        if (isinstance(self.q_norm, RMSNorm) and qk.dtype == torch.float32
                and self.q_norm.weight.dtype == torch.float32):
            weight = torch.cat((self.q_norm.weight.expand(self.num_heads, -1),
                                self.k_norm.weight.expand(self.num_kv_heads, -1)))  # [H + Hkv, D]
            normed = torch.rms_norm(heads, (self.head_dim,), None, self.q_norm.eps) * weight
        else:
            normed = torch.cat((self.q_norm(heads[:, :self.num_heads]),
                                self.k_norm(heads[:, self.num_heads:])), dim=1)
        return normed.view(qk.shape[0], -1)


class DecoderMLP(nn.Module):
    gate_up_cls = MergedColumnParallelLinear

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.gate_up_proj = self.gate_up_cls(args.hidden_size, [args.intermediate_size] * 2,
                                             ["gate_proj", "up_proj"], bias=args.mlp_bias)
        self.act = GatedActivation(args.hidden_act)
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size,
                                           bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Llama's pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    attention_cls = DecoderAttention
    mlp_cls = DecoderMLP

    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(args, args.hidden_size)
        self.self_attn = self.attention_cls(args, layer_idx)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self.mlp = self.mlp_cls(args)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_cls(args, i) for i in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.embedding_multiplier = args.embedding_multiplier
        # One rotary table per distinct rope and head size (Gemma 3: local and global),
        # computed once a step.
        keys = [None if spec.rope is None else (spec.rope, args.layer_head_dim(i))
                for i, spec in enumerate(args.layers)]
        ropes = list(dict.fromkeys(key for key in keys if key is not None))
        self.rotary_embs = nn.ModuleList(RotaryEmbedding(head_dim, rope) for rope, head_dim in ropes)
        self.rotary_emb = self.rotary_embs[0] if ropes else None  # the first (Llama's only) one
        self._layer_rope = [None if key is None else ropes.index(key) for key in keys]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        tables = [emb(positions, x.dtype) for emb in self.rotary_embs]  # [T, rotary_dim] each
        for layer, rope_idx in zip(self.layers, self._layer_rope):
            x = layer(x, None if rope_idx is None else tables[rope_idx])
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` on a flat batch (the
    attention metadata comes from the forward context); ``compute_logits`` -> float32 logits.

    Attributes the runner reads: num_layers, vocab_size, max_position_embeddings (and
    hidden_size, num_heads: this rank's). The KV cache's geometry is each attention layer's own
    (``Attention.kv_cache_spec``); vocab_size is the whole vocabulary (the logits are gathered).
    """

    layer_cls: type[nn.Module] = DecoderLayer
    model_cls: type[DecoderModel] = DecoderModel

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        """``config``: the language model's fields."""
        return DecoderArgs.from_hf(config)

    def __init__(self, config: dict) -> None:
        super().__init__()
        args = self.args_from_hf(text_config(config))
        self.args = args
        self.build_model(args)
        self.num_layers, self.num_heads = args.num_layers, self.decoder.layers[0].self_attn.num_heads
        self.hidden_size, self.vocab_size = args.hidden_size, args.vocab_size
        self.max_position_embeddings = args.max_position_embeddings
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size)
        self.tie_weights()

    def build_model(self, args: DecoderArgs) -> None:
        """Where the decoder sits decides its checkpoint names (``model.layers...``)."""
        self.model = self.model_cls(args, self.layer_cls)

    @property
    def decoder(self) -> DecoderModel:
        return self.model

    def tie_weights(self) -> None:
        """Share the embedding with the lm_head if the config says so. The loader calls it
        again after moving the model: ``to_empty``/``to`` give each module its own new tensor."""
        if self.args.tie_word_embeddings:
            self.lm_head.tie_to(self.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32."""
        logits = self.lm_head(hidden_states)
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        cap = self.args.final_logits_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
