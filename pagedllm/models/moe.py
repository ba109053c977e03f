"""What the mixture-of-experts families share: the sparse MLP block (router, experts, an
optional shared expert) and a Llama-style decoder whose MLP is that block on its sparse layers.

A family file says only how it routes and what else differs from Llama (Qwen2-MoE's shared
expert and qkv bias, Qwen3-MoE's per-head q/k norm, OLMoE's whole-projection q/k norm,
Mixtral's checkpoint names); module names follow the HF checkpoints (``mlp.gate``,
``mlp.experts``, ``mlp.shared_expert``, ``mlp.shared_expert_gate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.hf_config import text_config
from pagedllm.layers import Linear, MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.fused_moe import ExpertLayout, FusedMoE
from pagedllm.layers.moe_router import RoutingOrder
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class MoEArgs:
    """The experts of a model, read once from config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int               # one expert's
    renormalize: bool                    # norm_topk_prob: the k weights sum to 1
    order: RoutingOrder = RoutingOrder.SOFTMAX_TOPK
    router_bias: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, sigmoid-gated
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    decoder_sparse_step: int = 1         # Qwen-MoE: every n-th layer is sparse...
    mlp_only_layers: tuple[int, ...] = ()  # ...except these, which keep a dense MLP
    expert_bias: bool = False            # GPT-OSS: biases on every expert's projections
    expert_layout: ExpertLayout = ExpertLayout.STACKED  # how the fused checkpoint tensors lie
    weight_format: str | None = None     # "mxfp4": the experts ship quantized (dequantized at load)
    # A module ``[..., 2I] -> [..., I]`` (gate half, up half); None: SwiGLU with hidden_act.
    make_activation: Callable[[], nn.Module] | None = None

    @classmethod
    def from_hf(cls, config: dict, **overrides) -> MoEArgs:
        # transformers writes Qwen3-MoE's expert count as num_local_experts (Mixtral's name).
        num_experts = config.get("num_experts") or config.get("num_local_experts")
        if not num_experts or config.get("num_experts_per_tok") is None:
            raise ModelLoadError("config.json lacks num_experts (or num_local_experts) or "
                                 "num_experts_per_tok for a mixture-of-experts model")
        args = dict(
            num_experts=int(num_experts), top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config.get("moe_intermediate_size")
                                  or config["intermediate_size"]),
            renormalize=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()))
        args.update(overrides)
        return cls(**args)

    def is_sparse(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through; ``forward`` returns this rank's partial sum
    (the block all-reduces it together with the routed experts' partial sum)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       ["gate_proj", "up_proj"], bias=False)
        self.act = GatedActivation(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act(self.gate_up_proj(x)), None)


class SparseMoeBlock(nn.Module):
    """``[T, H] -> [T, H]``: the router's top-k experts per token (plus the gated shared expert)."""

    def __init__(self, args: DecoderArgs, moe: MoEArgs) -> None:
        super().__init__()
        self.gate = Linear(args.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.gate.batch_invariant = True  # on the skinny kernel (weight_plan/plan.py)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, args.hidden_size,
                                moe.intermediate_size, args.hidden_act, moe.renormalize,
                                moe.order, moe.expert_names, reduce_results=False,
                                activation=moe.make_activation() if moe.make_activation else None,
                                bias=moe.expert_bias, layout=moe.expert_layout,
                                weight_format=moe.weight_format)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(args.hidden_size, moe.shared_expert_intermediate_size,
                                              args.hidden_act)
            self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)
        self.tp = self.experts.tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            # sigmoid(gate) scales each token's whole vector, so it commutes with the all-reduce.
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder with ``SparseMoeBlock`` as the MLP of its sparse layers. A family
    overrides ``moe_args_from_hf`` (and ``args_from_hf`` for its attention flags)."""

    # Substrings of checkpoint names replaced before they are looked up (Mixtral's block name).
    checkpoint_renames: dict[str, str] = {}

    @classmethod
    def moe_args_from_hf(cls, config: dict) -> MoEArgs:
        return MoEArgs.from_hf(config)

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.moe_args = self.moe_args_from_hf(text_config(config))
        for i, layer in enumerate(self.decoder.layers):
            if self.moe_args.is_sparse(i):
                # Replaces the dense MLP the Llama layer built (free on the meta device, where
                # the loader builds models).
                layer.mlp = SparseMoeBlock(self.args, self.moe_args)
