"""Xiaomi MiMo: a Qwen2 body that ships multi-token-prediction layers (``model.mtp_layers.N``).

As a target the model is Qwen2 and its MTP layers stay in the checkpoint; with
``speculative_config={"method": "mtp"}`` they are loaded as a draft head (models/mimo_mtp.py).
"""
from __future__ import annotations

from pagedllm.models.qwen2 import Qwen2ForCausalLM

MTP_PREFIX = "model.mtp_layers."


class MiMoForCausalLM(Qwen2ForCausalLM):
    """The target: Qwen2; the MTP layers load only as a draft head."""

    skipped_checkpoint_prefixes = (MTP_PREFIX,)
