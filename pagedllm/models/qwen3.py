"""Qwen3: the Llama decoder plus an RMSNorm over each head of q and k (before rope)."""
from __future__ import annotations

from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        return DecoderArgs.from_hf(config, qk_norm=True)
