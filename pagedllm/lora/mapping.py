"""The step's rows grouped by adapter slot, reachable from every wrapped layer the way the
attention metadata is (layers/forward_context.py): the runner builds it from the input batch
each step and sets it around the forward pass; outside any mapping no adapter applies."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Up to this many rows, a step with adapters runs one grouped op over the resident adapters
# (lora/graph_weights.py, each row its own) instead of torch's products per adapter: a decode
# step's few rows make the per-adapter passes' fixed costs dominate, a long prefill's rows
# favour torch's matmuls over the op's dot products.
DENSE_MAX_ROWS = 256


@dataclass
class LoRAMapping:
    """``groups``: (slot, the rows that use it) per slot in use this step; rows are None when
    the slot's rows are the whole batch (one adapter alone: no gather, no scatter).
    ``row_slots``: each row's slot (-1: the base), set when the step takes the one grouped pass."""
    groups: list[tuple[int, torch.Tensor | None]]
    row_slots: torch.Tensor | None = None


def build_lora_mapping(row_slots: list[tuple[int | None, int]], device: torch.device
                       ) -> LoRAMapping | None:
    """From each request's (slot or None, number of rows) in batch order; None when no row of
    the step uses an adapter."""
    rows_of: dict[int, list[int]] = {}
    row = 0
    for slot, count in row_slots:
        if slot is not None:
            rows_of.setdefault(slot, []).extend(range(row, row + count))
        row += count
    if not rows_of:
        return None
    if row <= DENSE_MAX_ROWS:
        slots = [-1] * row
        for slot, rows in rows_of.items():
            for r in rows:
                slots[r] = slot
        return LoRAMapping([], torch.tensor(slots, dtype=torch.long, device=device))
    return LoRAMapping([(slot, None if len(rows) == row else
                         torch.tensor(rows, dtype=torch.long, device=device))
                        for slot, rows in rows_of.items()])


# A module-level value, as the attention metadata: one forward pass at a time per process.
_mapping: LoRAMapping | None = None


@contextmanager
def set_lora_mapping(mapping: LoRAMapping | None) -> Iterator[None]:
    global _mapping
    previous = _mapping
    _mapping = mapping
    try:
        yield
    finally:
        _mapping = previous


def get_lora_mapping() -> LoRAMapping | None:
    return _mapping
