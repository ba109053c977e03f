"""Qwen2: the Llama decoder with biases on q/k/v (always) and none on o_proj."""
from __future__ import annotations

from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config, qkv_bias=True, o_bias=False)
