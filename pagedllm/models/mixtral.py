"""Mixtral: Llama's attention with sparse expert MLPs on every layer, routed top-k then softmax
over the k (the renormalised top-k probabilities). Hub checkpoints name the block
``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up), ``w2`` (down);
transformers 5 keeps it as ``mlp`` in memory (its fused spelling)."""
from __future__ import annotations

from pagedllm.layers.moe_router import RoutingOrder
from pagedllm.models.moe import MoEArgs, MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def moe_args_from_hf(cls, config: dict) -> MoEArgs:
        return MoEArgs.from_hf(config, renormalize=True, order=RoutingOrder.TOPK_SOFTMAX,
                               expert_names=("w1", "w3", "w2"), decoder_sparse_step=1,
                               mlp_only_layers=())
