"""The table of how every layer holds its weight, once the load-time choices are made (the
loader's formats, runner/linear_choice.py's kernels, runner/activation_choice.py's
activations): layer name -> format, bytes. The startup log prints its summary (and the whole
table at DEBUG); ``pagedllm bench memory`` counts the weights' bytes from it."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear
from pagedllm.layers.weight_format import WeightFormat

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class WeightRow:
    name: str       # the layer's module name; an MoE projection: "<layer>.<projection>"
    format: str     # WeightFormat.describe(), or the dtype of a plain ``weight`` (torch's matmul)
    nbytes: int     # 0 for a tied embedding: its head's row counts the shared weight


def weight_table(model: nn.Module) -> list[WeightRow]:
    """One row per linear layer, vocabulary embedding and head, and MoE projection."""
    rows: list[WeightRow] = []
    seen: set[int] = set()  # a tied embedding holds its head's format or Parameter
    modules = list(model.named_modules())
    # Heads first: a tied embedding's bytes are its head's.
    modules.sort(key=lambda item: not isinstance(item[1], ParallelLMHead))
    for name, module in modules:
        if isinstance(module, FusedMoE):
            for projection, fmt in module.expert_formats.items():
                rows.append(WeightRow(f"{name}.{projection}", fmt.describe(), fmt.nbytes))
            for projection in FusedMoE.PROJECTIONS:
                weight = getattr(module, projection, None)
                if weight is not None and projection not in module.expert_formats:
                    rows.append(WeightRow(f"{name}.{projection}",
                                          _DTYPE_NAMES.get(weight.dtype, str(weight.dtype)),
                                          weight.nbytes))
            continue
        if not isinstance(module, (Linear, ParallelLMHead, VocabParallelEmbedding)):
            continue
        held: WeightFormat | torch.Tensor | None = module.weight_format
        if held is None:
            held = module.weight
        if held is None:
            continue
        shared = id(held) in seen
        seen.add(id(held))
        if isinstance(held, WeightFormat):
            rows.append(WeightRow(name, held.describe(), 0 if shared else held.nbytes))
        else:
            rows.append(WeightRow(name, _DTYPE_NAMES.get(held.dtype, str(held.dtype)),
                                  0 if shared else held.nbytes))
    return rows


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every weight format in ``model`` (what its state_dict does not list)."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        formats = (list(module.expert_formats.values()) if isinstance(module, FusedMoE)
                   else [getattr(module, "weight_format", None)])
        tensors += [t for fmt in formats if fmt is not None for t in fmt.tensors()]
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
