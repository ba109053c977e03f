"""The table of how every layer holds its weight, once the planning pass (weight_plan/plan.py)
has given each its format: layer name -> format, bytes. The startup log prints its summary (and the whole
table at DEBUG); ``pagedllm bench memory`` counts the weights' bytes from it."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear
from pagedllm.layers.weight_format import Dense

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class WeightRow:
    name: str       # the layer's module name; an MoE projection: "<layer>.<projection>"
    format: str     # WeightFormat.describe(): a Dense layer's is its dtype (torch's matmul)
    nbytes: int     # 0 for a tied embedding: its head's row counts the shared weight


def weight_table(model: nn.Module) -> list[WeightRow]:
    """One row per linear layer, vocabulary embedding and head, and MoE projection, each as the
    planning pass left it (weight_plan/plan.py: every one holds a format)."""
    rows: list[WeightRow] = []
    seen: set[int] = set()  # a tied embedding holds its head's format
    modules = list(model.named_modules())
    # Heads first: a tied embedding's bytes are its head's.
    modules.sort(key=lambda item: not isinstance(item[1], ParallelLMHead))
    for name, module in modules:
        if isinstance(module, FusedMoE):
            held = [(f"{name}.{projection}", fmt) for projection, fmt in module.expert_formats.items()]
        elif isinstance(module, (Linear, ParallelLMHead, VocabParallelEmbedding)):
            held = [(name, module.weight_format)]
        else:
            continue
        for row_name, fmt in held:
            if fmt is None:
                continue
            shared = id(fmt) in seen
            seen.add(id(fmt))
            rows.append(WeightRow(row_name, fmt.describe(), 0 if shared else fmt.nbytes))
    return rows


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every weight format in ``model`` but ``Dense`` (what its state_dict does
    not list)."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        formats = (list(module.expert_formats.values()) if isinstance(module, FusedMoE)
                   else [getattr(module, "weight_format", None)])
        tensors += [t for fmt in formats if fmt is not None and not isinstance(fmt, Dense)
                    for t in fmt.tensors()]
    return tensors


def log_weight_table(rows: list[WeightRow]) -> None:
    """One INFO line: layers and MiB per format; the table itself at DEBUG."""
    by_format: dict[str, list[int]] = {}
    for row in rows:
        count_bytes = by_format.setdefault(row.format, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += row.nbytes
    logger.info("weights: %s", ", ".join(f"{n} layers {fmt} ({b / 2**20:.1f} MiB)"
                                         for fmt, (n, b) in by_format.items()))
    for row in rows:
        logger.debug("  %-48s %-20s %12d bytes", row.name, row.format, row.nbytes)
