"""Llama (2/3/3.1) and Mistral: the plain decoder of models/decoder.py, nothing changed.

Mistral's sliding window arrives through the layer specs (``DecoderArgs.from_hf`` gives every
layer the config's ``sliding_window`` when it is active). ``DecoderArgs`` is re-exported here for
the callers that know it by its old home.
"""
from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.decoder_args import DecoderArgs, LayerSpec

__all__ = ["DecoderArgs", "LayerSpec", "LlamaForCausalLM"]


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama as transformers defines it; the base class is exactly this model."""
