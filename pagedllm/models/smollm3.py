"""SmolLM3: the Llama decoder where some layers use no rotary embedding at all (NoPE):
``no_rope_layers[i]`` is 1 where layer ``i`` rotates q and k, 0 where it does not."""
from __future__ import annotations

from pagedllm.errors import ModelLoadError
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.decoder_args import DecoderArgs


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        args = DecoderArgs.from_hf(config)
        uses_rope = config.get("no_rope_layers")
        if uses_rope is None:  # transformers' default: every ``no_rope_layer_interval``-th is NoPE
            interval = int(config.get("no_rope_layer_interval", 4))
            uses_rope = [int((i + 1) % interval != 0) for i in range(args.num_layers)]
        if len(uses_rope) != args.num_layers:
            raise ModelLoadError(f"no_rope_layers has {len(uses_rope)} entries for "
                                 f"{args.num_layers} layers")
        return args.with_layer_ropes([args.rope if use else None for use in uses_rope])
