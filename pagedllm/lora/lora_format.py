"""LoRAFormat: a layer's weight format with the adapters' updates added to its product.

The base product runs once for the whole batch through the format the layer already had (any
of layers/weight_format.py, or the plain ``weight``); then each adapter slot in use this step
adds ``(x A^T) B^T`` to its own rows: one shrink over every projection the adapter trains in
this layer (A's stacked), then one expand into the columns they span (the B's laid block-diagonal:
a fused qkv or gate_up layer gets each projection's update in its own columns, an untrained one
exact zeros), so a decode step pays two products per layer whatever the projections.
A row's result depends on its own adapter only, never on which others share the step.

A step of few rows with several adapters (decode) takes one grouped pass instead: every resident
adapter held in one layout (lora/graph_weights.py's ``SlotWeights``, at the highest resident
rank) and one op that groups the rows by adapter and reads each used adapter's A and B once.

In the compiled forward the layer reads ``graph`` instead (the same layout at ``max_lora_rank``,
static shapes, the rows' slots a graph input), never the step's Python mapping.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.weight_format import WeightFormat
from pagedllm.lora.graph_weights import SlotWeights
from pagedllm.lora.mapping import get_lora_mapping
from pagedllm.lora.peft_loader import LoRAProjection

# A slot's weights: A^T stacked [in, sum r], the first output column its projections span, and
# B^T [sum r, span] (each projection's rows and columns only; zeros between them).
HeldSlot = tuple[torch.Tensor, int, torch.Tensor]


class LoRAFormat:
    """Wraps ``base`` (None: ``weight`` with ``F.linear``); anything but ``apply`` is the base's."""

    def __init__(self, base: WeightFormat | None, weight: torch.Tensor | None, num_slots: int) -> None:
        self.base, self.weight = base, weight
        self.slots: list[HeldSlot | None] = [None] * num_slots
        self._projections: list[list[LoRAProjection] | None] = [None] * num_slots
        self._stacked: SlotWeights | None = None  # built at the first grouped pass after a change
        self.graph: SlotWeights | None = None  # set when the forward is compiled

    def set_slot(self, slot: int, projections: list[LoRAProjection] | None) -> None:
        """Hold an adapter's projections of this layer in ``slot`` (None: the slot adds nothing)."""
        self._projections[slot], self._stacked = projections or None, None
        if self.graph is not None:
            self.graph.set_slot(slot, projections)
        if not projections:
            self.slots[slot] = None
            return
        start = min(p.target.out_offset for p in projections)
        span = max(p.target.out_offset + p.target.out_size for p in projections) - start
        ranks = [p.lora_a.shape[0] for p in projections]
        lora_b_t = projections[0].lora_b.new_zeros(sum(ranks), span)
        first = 0
        for p, rank in zip(projections, ranks):
            offset = p.target.out_offset - start
            lora_b_t[first:first + rank, offset:offset + p.target.out_size] = p.lora_b.T
            first += rank
        lora_a = projections[0].lora_a if len(projections) == 1 else torch.cat(
            [p.lora_a for p in projections])
        self.slots[slot] = (lora_a.T, start, lora_b_t)

    def lora_tensors(self) -> list[torch.Tensor]:
        """What the slots and the grouped pass's stacked copy hold (the memory report)."""
        held = [t for slot in self.slots if slot is not None for t in (slot[0], slot[2])]
        if self._stacked is not None:
            held += self._stacked.tensors()
        if self.graph is not None:
            held += self.graph.tensors()
        return held

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, self.weight, bias) if self.base is None else self.base.apply(x, bias)
        if torch.compiler.is_compiling():
            return y if self.graph is None or not self.graph.inputs.traced else self.graph.apply(x, y)
        mapping = get_lora_mapping()
        if mapping is None:
            return y
        if mapping.row_slots is not None:
            stacked = self._stack()
            return y if stacked is None else stacked.apply(x, y, mapping.row_slots)
        for slot, rows in mapping.groups:
            held = self.slots[slot]
            if held is None:
                continue
            lora_a_t, start, lora_b_t = held
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = torch.matmul(xs if xs.dtype == lora_a_t.dtype else xs.to(lora_a_t.dtype), lora_a_t)
            out = y if start == 0 and lora_b_t.shape[1] == y.shape[1] else \
                y[:, start:start + lora_b_t.shape[1]]
            if rows is None and y.dtype == lora_b_t.dtype:
                out.addmm_(shrunk, lora_b_t)  # the expand and the add in one op
            elif rows is None:
                out += torch.matmul(shrunk, lora_b_t).to(y.dtype)
            else:
                out.index_add_(0, rows, torch.matmul(shrunk, lora_b_t).to(y.dtype))
        return y

    def _stack(self) -> SlotWeights | None:
        if self._stacked is None:
            resident = [(slot, p) for slot, projections in enumerate(self._projections)
                        for p in projections or ()]
            if not resident:
                return None
            first = resident[0][1]
            self._stacked = SlotWeights(None, sorted({(p.target.out_offset, p.target.out_size) for _, p in resident}),
                                        first.lora_a.shape[1], len(self.slots),
                                        max(p.lora_a.shape[0] for _, p in resident), first.lora_a.dtype,
                                        first.lora_a.device)
            for slot, projections in enumerate(self._projections):
                if projections:
                    self._stacked.set_slot(slot, projections)
        return self._stacked

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the base's name, sizes, tensors.
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)
