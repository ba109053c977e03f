"""The adapters in the compiled forward: every tensor the graph reads has a shape fixed at startup,
so one graph serves every batch and every set of resident adapters.

``LoRAGraphInputs.token_lora_indices`` holds each token row's slot (-1: the base) for the step,
and ``slot_mask`` the same as one row of ones and zeros per token, both written in place by the
runner before the forward pass when the batch's adapters change; the graph reads their first ``T``
rows. ``GraphLoRAWeights`` holds one layer's slots at ``max_lora_rank`` each (zeros past an
adapter's rank and for a projection it does not train), grouped by projection: A^T [in,
projections * slots * rank] and per projection B^T [slots * rank, its columns]. Filling a slot
copies into them in place. The graph shrinks every row by every slot's A, zeroes each row's
columns of other slots (one multiply by the mask, shared by every layer), and expands once per
projection into its columns in place: a fixed number of products per layer, whatever the batch's
adapters.
"""
from __future__ import annotations

import torch

from pagedllm.lora.peft_loader import LoRAProjection


class LoRAGraphInputs:
    """The step's per-row slots, one tensor for the whole model (a graph input)."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        # [tokens, 1, slots, 1]: 1 at the row's slot; shaped to multiply a layer's shrunk columns
        # viewed [tokens, projections, slots, rank]. Made by the first layer (slots, dtype).
        self.slot_mask: torch.Tensor | None = None
        self._key: tuple | None = None  # the (slot, rows) per request of what the tensors hold
        self.traced = True  # read while tracing: False traces the base-only graph (no adapter term)

    def without_adapters(self, compile_fn):
        """``compile_fn()`` with the layers traced as without adapters (a graph for base-only steps)."""
        self.traced = False
        try:
            return compile_fn()
        finally:
            self.traced = True

    def mask(self, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        if self.slot_mask is None:
            rows = self.token_lora_indices
            self.slot_mask = torch.zeros(rows.shape[0], 1, num_slots, 1, dtype=dtype, device=rows.device)
        return self.slot_mask

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
        if self.slot_mask is not None:
            one_hot = slots[:, None] == torch.arange(self.slot_mask.shape[2])
            self.slot_mask[:total].copy_(one_hot.view(total, 1, -1, 1))
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
        self.lora_a_t = torch.zeros(in_features, len(projections) * width, dtype=dtype, device=device)
        self.mask = inputs.mask(num_slots, dtype)
        self.out_features = sum(size for _, size in projections)
        self.expands = [(offset, size, torch.zeros(width, size, dtype=dtype, device=device))
                        for offset, size in projections]

    def set_slot(self, slot: int, projections: list[LoRAProjection] | None) -> None:
        width = self.num_slots * self.max_rank
        for j, (_, _, lora_b_t) in enumerate(self.expands):
            first = j * width + slot * self.max_rank
            self.lora_a_t[:, first:first + self.max_rank].zero_()
            lora_b_t[slot * self.max_rank:(slot + 1) * self.max_rank].zero_()
        for p in projections or ():
            j, rank = self.index[p.target.out_offset], p.lora_a.shape[0]
            first = j * width + slot * self.max_rank
            self.lora_a_t[:, first:first + rank].copy_(p.lora_a.T)
            self.expands[j][2][slot * self.max_rank:slot * self.max_rank + rank].copy_(p.lora_b.T)

    def tensors(self) -> list[torch.Tensor]:
        return [self.lora_a_t, *(e[2] for e in self.expands)]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        shrunk = x.to(self.lora_a_t.dtype) @ self.lora_a_t
        # Each row keeps its own slot's columns (exact zeros elsewhere), in place through the view.
        shrunk.view(rows, len(self.expands), self.num_slots, self.max_rank).mul_(self.mask[:rows])
        if len(self.expands) == 1 and self.out_features == y.shape[1] and y.dtype == shrunk.dtype:
            return y.addmm_(shrunk, self.expands[0][2])  # the expand and the add in one op
        width = self.num_slots * self.max_rank
        for j, (offset, size, lora_b_t) in enumerate(self.expands):
            if y.dtype == shrunk.dtype:
                y.narrow(1, offset, size).addmm_(shrunk.narrow(1, j * width, width), lora_b_t)
            else:
                y.narrow(1, offset, size).add_((shrunk.narrow(1, j * width, width) @ lora_b_t).to(y.dtype))
        return y
