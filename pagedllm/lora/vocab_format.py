"""Adapters' trained embedding and head (PEFT's ``modules_to_save``): a whole copy of the
vocabulary matrix per adapter that has one, used for that adapter's rows in place of the base's.

``LoRAEmbeddingFormat`` wraps the embedding's lookup (``rows``), reading the forward pass's
mapping (one row per token); ``LoRAHeadFormat`` wraps the head's ``apply``, reading the mapping
the runner sets around ``compute_logits`` (one row per logits row). A row of the base, or of an
adapter without one, keeps the base's matrix. Both hold this rank's vocabulary rows only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.weight_format import WeightFormat
from pagedllm.lora.mapping import LoRAMapping, get_lora_mapping


def slot_rows(mapping: LoRAMapping, slot: int) -> torch.Tensor | None | bool:
    """The rows that use ``slot``: an index tensor, True for every row, False for none."""
    if mapping.row_slots is not None:
        rows = (mapping.row_slots == slot).nonzero().squeeze(1)
        return rows if rows.numel() else False
    for group_slot, rows in mapping.groups:
        if group_slot == slot:
            return True if rows is None else rows
    return False


class _VocabSlots:
    def __init__(self, base: WeightFormat | None, weight: torch.Tensor | None, num_slots: int) -> None:
        self.base, self.weight = base, weight
        self.slots: list[torch.Tensor | None] = [None] * num_slots

    def set_slot(self, slot: int, weight: torch.Tensor | None) -> None:
        self.slots[slot] = weight

    def lora_tensors(self) -> list[torch.Tensor]:
        return [w for w in self.slots if w is not None]

    @property
    def in_use(self) -> bool:
        return any(w is not None for w in self.slots)

    def _replace(self, out: torch.Tensor, inputs: torch.Tensor, product) -> torch.Tensor:
        """``out`` with each adapter's rows recomputed from ``inputs`` by ``product(inputs, weight)``."""
        if torch.compiler.is_compiling():
            return out  # an adapter's embedding runs the forward eagerly (runner/model_runner.py)
        mapping = get_lora_mapping()
        if mapping is None:
            return out
        for slot, weight in enumerate(self.slots):
            rows = False if weight is None else slot_rows(mapping, slot)
            if rows is True:
                return product(inputs, weight).to(out.dtype)
            if rows is not False:
                out.index_copy_(0, rows, product(inputs.index_select(0, rows), weight).to(out.dtype))
        return out

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the base format's.
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)


class LoRAEmbeddingFormat(_VocabSlots):
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight) if self.base is None else self.base.rows(ids)
        return self._replace(out, ids, F.embedding)


class LoRAHeadFormat(_VocabSlots):
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x, self.weight, bias) if self.base is None else self.base.apply(x, bias)
        return self._replace(out, x, F.linear)
