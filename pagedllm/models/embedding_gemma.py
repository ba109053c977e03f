"""EmbeddingGemma: Gemma 3's text model (``Gemma3TextModel``: no language-model head) with
``use_bidirectional_attention``. Every attention layer is then the shared layer with
``causal=False`` (no KV), and a local layer sees the tokens within half its configured window on
either side: transformers keeps ``sliding_window // 2 + 1`` as an exclusive distance.
"""
from __future__ import annotations

from dataclasses import replace

from pagedllm.hf_config import text_config
from pagedllm.layers.attention import Attention
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.gemma2 import GemmaModel
from pagedllm.models.gemma3 import Gemma3ForCausalLM


def _bidirectional_windows(args: DecoderArgs) -> DecoderArgs:
    layers = tuple(spec if spec.sliding_window is None else replace(spec, sliding_window=spec.sliding_window // 2 + 1)
                   for spec in args.layers)
    return replace(args, layers=layers)


class Gemma3TextModel(GemmaModel):
    """``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` (the final norm applied);
    checkpoint names without a prefix (``embed_tokens``, ``layers.N``, ``norm``)."""

    def __init__(self, config: dict) -> None:
        text = text_config(config)
        args = Gemma3ForCausalLM.args_from_hf(text)
        bidirectional = bool(text.get("use_bidirectional_attention", False))
        if bidirectional:
            args = _bidirectional_windows(args)
        super().__init__(args, Gemma3ForCausalLM.layer_cls)
        if bidirectional:
            for module in self.modules():
                if isinstance(module, Attention):
                    module.causal = False
        self.args = args
        self.num_layers, self.num_heads = args.num_layers, self.layers[0].self_attn.num_heads
        self.hidden_size, self.vocab_size = args.hidden_size, args.vocab_size
        self.max_position_embeddings = args.max_position_embeddings
