"""Qwen2-MoE: Qwen2's attention (q/k/v bias, none on o_proj) with sparse expert MLPs plus a
shared expert every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``."""
from __future__ import annotations

from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.moe import MoEArgs, MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config, qkv_bias=bool(config.get("qkv_bias", True)),
                                   o_bias=False)

    @classmethod
    def moe_args_from_hf(cls, config: dict) -> MoEArgs:
        return MoEArgs.from_hf(config, shared_expert_intermediate_size=int(
            config.get("shared_expert_intermediate_size") or 0))
