"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse expert MLPs (softmax then
top-k, renormalised when ``norm_topk_prob``); ``mlp_only_layers``/``decoder_sparse_step`` keep
some layers dense."""
from __future__ import annotations

from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.moe import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config, qk_norm=True)
