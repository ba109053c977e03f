"""LoRAFormat: a layer's weight format with the adapters' updates added to its product.

The base product runs once for the whole batch through the format the layer already had (any
of layers/weight_format.py, or the plain ``weight``); then the rows that use an adapter get its
update ``(x A^T) B^T``. Every resident adapter of the layer is held once, in one layout
(lora/graph_weights.py's ``SlotWeights``: the compiled forward's, at ``max_lora_rank``, or, in an
eager engine, one at the highest resident rank), which serves every step:

- up to ``DENSE_MAX_ROWS`` rows (decode, short prefills; one adapter or several): one grouped op
  that groups the rows by adapter and reads each used adapter's A and B once;
- more rows (a long prefill): per adapter in use, torch's matmuls on its slot of the same tensors.

A row's result depends on its own adapter only, never on which others share the step. In the
compiled forward the layer reads ``graph`` itself (the rows' slots a graph input), never the
step's Python mapping.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.weight_format import WeightFormat
from pagedllm.lora.graph_weights import SlotWeights
from pagedllm.lora.mapping import get_lora_mapping
from pagedllm.lora.peft_loader import LoRAProjection


class LoRAFormat:
    """Wraps ``base`` (None: ``weight`` with ``F.linear``); anything but ``apply`` is the base's."""

    def __init__(self, base: WeightFormat | None, weight: torch.Tensor | None, num_slots: int) -> None:
        self.base, self.weight = base, weight
        self._projections: list[list[LoRAProjection] | None] = [None] * num_slots
        self._stacked: SlotWeights | None = None  # an eager engine's slots, built at the first step
        self.graph: SlotWeights | None = None  # set when the forward is compiled

    def set_slot(self, slot: int, projections: list[LoRAProjection] | None) -> None:
        """Hold an adapter's projections of this layer in ``slot`` (None: the slot adds nothing)."""
        self._projections[slot] = projections or None
        if self.graph is not None:
            self.graph.set_slot(slot, projections)
        elif self._stacked is not None:
            if projections and self._stacked.fits(projections):
                self._stacked.set_slot(slot, projections)
            else:  # laid out again at the next step, at the highest rank then resident
                self._stacked = None

    def lora_tensors(self) -> list[torch.Tensor]:
        """What the slots hold (the memory report)."""
        weights = self.graph or self._stacked
        return [] if weights is None else weights.tensors()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, self.weight, bias) if self.base is None else self.base.apply(x, bias)
        if torch.compiler.is_compiling():
            return y if self.graph is None or not self.graph.inputs.traced else self.graph.apply(x, y)
        mapping = get_lora_mapping()
        weights = None if mapping is None else self.graph or self._stack()
        if weights is None:
            return y
        if mapping.row_slots is not None:
            return weights.apply(x, y, mapping.row_slots)
        for slot, rows in mapping.groups:
            if self._projections[slot]:
                weights.apply_slot(x, y, slot, rows)
        return y

    def _stack(self) -> SlotWeights | None:
        if self._stacked is None:
            resident = [(slot, p) for slot, projections in enumerate(self._projections)
                        for p in projections or ()]
            if not resident:
                return None
            first = resident[0][1]
            projections = sorted({(p.target.out_offset, p.target.out_size) for _, p in resident})
            # Built during a forward pass, yet refilled in place when an adapter is added or removed
            # outside one: plain tensors, not inference ones.
            with torch.inference_mode(False):
                self._stacked = SlotWeights(None, projections, first.lora_a.shape[1], len(self._projections),
                                            max(p.lora_a.shape[0] for _, p in resident), first.lora_a.dtype,
                                            first.lora_a.device)
                for slot, held in enumerate(self._projections):
                    if held:
                        self._stacked.set_slot(slot, held)
        return self._stacked

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the base's name, sizes, tensors.
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)
