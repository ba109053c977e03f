"""The adapters in the compiled forward: every tensor the graph reads has a shape fixed at startup,
so one graph serves every batch and every set of resident adapters.

``LoRAGraphInputs.token_lora_indices`` holds each token row's slot (-1: the base) for the step,
written in place by the runner before the forward pass; the graph reads its first ``T`` rows.
``GraphLoRAWeights`` holds one layer's slots at ``max_lora_rank`` each (zeros past an adapter's rank
and for a projection it does not train), grouped by projection: A [projections * slots * rank, in]
and per projection B^T [slots * rank, its columns]. Filling a slot copies into them in place. The
graph shrinks every row by every slot's A, zeroes each row's columns of other slots, and expands
once per projection: a fixed number of products per layer, whatever the batch's adapters.
"""
from __future__ import annotations

import torch

from pagedllm.lora.peft_loader import LoRAProjection


class LoRAGraphInputs:
    """The step's per-row slots, one tensor for the whole model (a graph input)."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        self._key: tuple | None = None  # the (slot, rows) per request of what the tensor holds

    def write(self, key: tuple[tuple[int | None, int], ...]) -> None:
        """Each request's (slot or None, rows), in batch order; unchanged rows are not rewritten
        (decode repeats its batch)."""
        if key == self._key:
            return
        total = sum(n for _, n in key)
        if total > self.token_lora_indices.shape[0]:
            raise RuntimeError(f"a step of {total} tokens is above the {self.token_lora_indices.shape[0]} "
                               "rows the compiled adapters' mapping holds")
        slots = torch.tensor([-1 if slot is None else slot for slot, n in key for _ in range(n)],
                             dtype=torch.long)
        self.token_lora_indices[:total].copy_(slots)
        self._key = key


class GraphLoRAWeights:
    """One layer's slots in static shapes. ``projections``: (first output column, columns) of each
    projection of the layer an adapter may train."""

    def __init__(self, inputs: LoRAGraphInputs, projections: list[tuple[int, int]], in_features: int,
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.inputs = inputs
        self.num_slots, self.max_rank = num_slots, max_rank
        self.index = {offset: j for j, (offset, _) in enumerate(projections)}
        width = num_slots * max_rank  # one projection's shrunk columns
        self.lora_a = torch.zeros(len(projections) * width, in_features, dtype=dtype, device=device)
        self.col_slots = (torch.arange(len(projections) * width, device=device) // max_rank) % num_slots
        self.expands = [(offset, size, torch.zeros(width, size, dtype=dtype, device=device))
                        for offset, size in projections]

    def set_slot(self, slot: int, projections: list[LoRAProjection] | None) -> None:
        width = self.num_slots * self.max_rank
        for j, (_, _, lora_b_t) in enumerate(self.expands):
            first = j * width + slot * self.max_rank
            self.lora_a[first:first + self.max_rank].zero_()
            lora_b_t[slot * self.max_rank:(slot + 1) * self.max_rank].zero_()
        for p in projections or ():
            j, rank = self.index[p.target.out_offset], p.lora_a.shape[0]
            first = j * width + slot * self.max_rank
            self.lora_a[first:first + rank].copy_(p.lora_a)
            self.expands[j][2][slot * self.max_rank:slot * self.max_rank + rank].copy_(p.lora_b.T)

    def tensors(self) -> list[torch.Tensor]:
        return [self.lora_a, *(e[2] for e in self.expands)]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        row_slots = self.inputs.token_lora_indices[:x.shape[0]]
        # [rows, all columns]: each row keeps its own slot's columns (exact zeros elsewhere).
        shrunk = (x.to(self.lora_a.dtype) @ self.lora_a.T) * (row_slots[:, None] == self.col_slots)
        width = self.num_slots * self.max_rank
        for j, (offset, size, lora_b_t) in enumerate(self.expands):
            y[:, offset:offset + size] += (shrunk[:, j * width:(j + 1) * width] @ lora_b_t).to(y.dtype)
        return y
