"""Where each projection an adapter may train sits in pagedllm's layers.

PEFT names a checkpoint module (``model.layers.0.self_attn.q_proj``); pagedllm may have fused it
with its siblings into one layer (``qkv_proj``: q, k and v stacked along the outputs; ``gate_up_proj``)
and split it across tensor-parallel ranks. A ``LoRATarget`` says which columns of which layer the
projection's outputs are on this rank, and which of its rows (B) and columns (A) this rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pagedllm.layers.embed_head import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear


@dataclass(frozen=True)
class LoRATarget:
    layer_name: str  # the pagedllm layer whose ``apply`` the update joins
    out_offset: int  # the projection's first output column in that layer
    out_size: int  # its output columns on this rank
    out_start: int  # the first row of the full B this rank holds
    full_out: int  # the checkpoint projection's outputs (B's rows)
    in_start: int  # the first column of the full A this rank holds (a row-parallel layer's shard)
    in_size: int
    full_in: int  # the checkpoint projection's inputs (A's columns)


@dataclass(frozen=True)
class VocabTarget:
    """The base's vocabulary, for an adapter's trained embedding or head (modules_to_save)."""
    vocab_size: int
    hidden_size: int
    start: int  # this rank's first vocabulary row
    end: int


def vocab_target(model: nn.Module) -> VocabTarget | None:
    """From the token embedding (the head, when the model has one, splits the vocabulary alike)."""
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            return VocabTarget(module.vocab_size, module.embedding_dim, module.vocab_start, module.vocab_end)
    return None


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Checkpoint module name -> its target, for every linear layer of ``model`` (the vocabulary
    head and embedding are no ``Linear``: an adapter replaces them whole, ``vocab_target``)."""
    targets: dict[str, LoRATarget] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parent, _, _ = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        if isinstance(module, ColumnParallelLinear):
            offset = 0
            for shard, size, start, full in zip(module.shard_names, module.output_sizes,
                                                module.shard_starts, module.full_sizes):
                targets[prefix + shard] = LoRATarget(name, offset, size, start, full, 0,
                                                     module.in_features, module.in_features)
                offset += size
        elif isinstance(module, RowParallelLinear):
            targets[name] = LoRATarget(name, 0, module.out_features, 0, module.out_features,
                                       module.tp.rank * module.in_features, module.in_features,
                                       module.full_in_features)
        else:
            targets[name] = LoRATarget(name, 0, module.out_features, 0, module.out_features, 0,
                                       module.in_features, module.in_features)
    return targets
