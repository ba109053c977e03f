"""Phi-3 / 3.5 / 4-mini: the Llama decoder whose checkpoint fuses q/k/v into one ``qkv_proj``
tensor and gate/up into one ``gate_up_proj``; rope may be longrope and partial (both read by
``RopeConfig``), and some configs set a sliding window (a layer spec)."""
from __future__ import annotations

import torch

from pagedllm.layers import MergedColumnParallelLinear, QKVParallelLinear, WeightSlice
from pagedllm.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer, DecoderMLP


class _FusedCheckpointSlices:
    """A fused layer whose parts come from one checkpoint tensor stacking them whole (q rows,
    then k, then v): part ``i`` of this rank takes its rows from that part's block of the
    tensor, so under tensor parallelism each rank still reads only its own rows."""

    fused_name: str

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        total, offset, slices = sum(self.full_sizes), 0, []
        for i, full_size in enumerate(self.full_sizes):
            slices.append(WeightSlice(self.shard(param, i), self.fused_name, 0,
                                      offset + self.shard_starts[i], total))
            offset += full_size
        return slices


class Phi3QKVParallelLinear(_FusedCheckpointSlices, QKVParallelLinear):
    fused_name = "qkv_proj"


class Phi3GateUpParallelLinear(_FusedCheckpointSlices, MergedColumnParallelLinear):
    fused_name = "gate_up_proj"


class Phi3Attention(DecoderAttention):
    qkv_cls = Phi3QKVParallelLinear


class Phi3MLP(DecoderMLP):
    gate_up_cls = Phi3GateUpParallelLinear


class Phi3DecoderLayer(DecoderLayer):
    attention_cls = Phi3Attention
    mlp_cls = Phi3MLP


class Phi3ForCausalLM(DecoderForCausalLM):
    layer_cls = Phi3DecoderLayer
