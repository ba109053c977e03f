"""Gemma 3 (text): Gemma 2 (models/gemma2.py) plus per-head q/k norms and a rope per layer
type: local (sliding-window) layers rotate with ``rope_local_base_freq`` and no scaling, global
layers with the config's rope and its scaling. Attention soft-capping is gone (null in configs).

``Gemma3ForConditionalGeneration`` checkpoints hold the same language model under
``language_model.model``, its config under ``text_config``; only it is loaded (the vision tower's
tensors are skipped: pagedllm takes text input only).
"""
from __future__ import annotations

from torch import nn

from pagedllm.hf_config import layer_types
from pagedllm.layers.rotary import RopeConfig
from pagedllm.models.decoder import DecoderModel
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.gemma2 import Gemma2ForCausalLM, gemma_args

_DEFAULT_PATTERN = 6  # five local layers, then a global one


def _local_rope(config: dict) -> RopeConfig:
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get("sliding_attention"), dict):
        return RopeConfig.from_hf(config, "sliding_attention")
    # transformers 4.x: the local theta is its own field; local layers never scale.
    return RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)),
                      max_position_embeddings=int(config.get("max_position_embeddings", 8192)))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        args = gemma_args(config, default_pattern=_DEFAULT_PATTERN, qk_norm=True)
        local, full = _local_rope(config), RopeConfig.from_hf(config, "full_attention")
        kinds = layer_types(config, _DEFAULT_PATTERN)
        return args.with_layer_ropes([local if kind == "sliding_attention" else full
                                      for kind in kinds])


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    skipped_checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.")

    def build_model(self, args: DecoderArgs) -> None:
        # Checkpoint names: language_model.model.layers... (what transformers writes, 5.x too);
        # the head is tied to the embedding, as in every Gemma 3 checkpoint.
        self.language_model = nn.Module()
        self.language_model.model = self.model_cls(args, self.layer_cls)

    @property
    def decoder(self) -> DecoderModel:
        return self.language_model.model
