"""Every resident adapter slot of one layer in one layout, and the updates that read it: the
compiled forward's adapter term and every eager step's (lora/lora_format.py).

``SlotWeights`` holds one layer's slots at one rank each (zeros past an adapter's rank and for a
projection it does not train, the scaling folded into B): A [slots, projections * rank, in] and
B^T [slots, rank, columns], each projection's B in its own columns of the layer's output. Filling
a slot copies into them in place, so the shapes never change (a compiled graph reads them).
``apply`` adds each row's own slot's update to the base product in one op,
``pagedllm::lora_shrink_expand`` (kernels/csrc/lora_sgmv.cpp): the rows grouped by slot, each
used slot's A and B read once, the others not at all (vLLM's punica shrink and expand, the SGMV
idea). On a CPU without the C++ kernels, ``_masked_shrink_expand`` computes the same with torch's
ops: every slot's shrink, each row's other slots zeroed, one expand per projection.
``apply_slot`` adds one slot's update to its rows with torch's matmuls on that slot's tensors
(an eager long prefill's many rows per adapter, where a GEMM beats the op's dot products).

In the compiled forward, ``LoRAGraphInputs.token_lora_indices`` holds each token row's slot (-1:
the base), a graph input written in place by the runner before the forward pass when the batch's
adapters change; the graph reads its first ``T`` rows.
"""
from __future__ import annotations

import torch

from pagedllm.kernels.cpu_extension import load_cpu_ops
from pagedllm.lora.peft_loader import LoRAProjection


class LoRAGraphInputs:
    """The step's per-row slots, one tensor for the whole model (a graph input)."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.token_lora_indices = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        self._key: tuple | None = None  # the (slot, rows) per request of what the tensor holds
        self.traced = True  # read while tracing: False traces the base-only graph (no adapter term)

    def without_adapters(self, compile_fn):
        """``compile_fn()`` with the layers traced as without adapters (a graph for base-only steps)."""
        self.traced = False
        try:
            return compile_fn()
        finally:
            self.traced = True

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


class SlotWeights:
    """One layer's slots in static shapes. ``projections``: (first output column, columns) of each
    projection of the layer an adapter may train. ``inputs``: the compiled forward's row slots
    (None: the caller passes each step's)."""

    def __init__(self, inputs: LoRAGraphInputs | None, projections: list[tuple[int, int]], in_features: int,
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.inputs = inputs
        self.max_rank = max_rank
        self.index = {offset: j for j, (offset, _) in enumerate(projections)}
        self.offsets, self.sizes = [o for o, _ in projections], [n for _, n in projections]
        columns = max(o + n for o, n in projections)
        self.lora_a = torch.zeros(num_slots, len(projections) * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, max_rank, columns, dtype=dtype, device=device)
        ops = load_cpu_ops() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
        self._op = None if ops is None else ops.lora_shrink_expand

    def set_slot(self, slot: int, projections: list[LoRAProjection] | None) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for p in projections or ():
            j, rank = self.index[p.target.out_offset], p.lora_a.shape[0]
            self.lora_a[slot, j * self.max_rank:j * self.max_rank + rank].copy_(p.lora_a)
            self.lora_b[slot, :rank, p.target.out_offset:p.target.out_offset + p.target.out_size].copy_(p.lora_b.T)

    def fits(self, projections: list[LoRAProjection]) -> bool:
        """Whether ``projections`` fit these shapes (the rank, the projections)."""
        return all(p.target.out_offset in self.index and p.lora_a.shape[0] <= self.max_rank for p in projections)

    def tensors(self) -> list[torch.Tensor]:
        return [self.lora_a, self.lora_b]

    def apply_slot(self, x: torch.Tensor, y: torch.Tensor, slot: int, rows: torch.Tensor | None) -> torch.Tensor:
        """y plus slot ``slot``'s update on ``rows`` of x and y (None: every row), in place."""
        xs = x if rows is None else x.index_select(0, rows)
        shrunk = (xs if xs.dtype == self.lora_a.dtype else xs.to(self.lora_a.dtype)) @ self.lora_a[slot].T
        rank = self.max_rank
        for j, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            out = y.narrow(1, offset, size)
            part, lora_b = shrunk[:, j * rank:(j + 1) * rank], self.lora_b[slot, :, offset:offset + size]
            if rows is None and y.dtype == lora_b.dtype:
                out.addmm_(part, lora_b)  # the expand and the add in one op, into y's columns
            elif rows is None:
                out.add_((part @ lora_b).to(y.dtype))
            else:
                out.index_add_(0, rows, (part @ lora_b).to(y.dtype))
        return y

    def apply(self, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """y (the base product, [T, out]) plus each row's own slot's update, in place;
        ``token_slots``: each row's slot (default: the compiled forward's)."""
        slots = self.inputs.token_lora_indices if token_slots is None else token_slots
        if self._op is not None and y.stride(1) == 1:
            self._op(x, y, self.lora_a, self.lora_b, slots, self.offsets, self.sizes)
            return y
        return _masked_shrink_expand(x, y, self.lora_a, self.lora_b, slots, self.offsets, self.sizes)


def _masked_shrink_expand(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                          token_slots: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """What ``pagedllm::lora_shrink_expand`` computes, in torch's ops (a CPU without the kernels)."""
    rows, (slots, width, _), rank = x.shape[0], lora_a.shape, lora_b.shape[1]
    shrunk = (x.to(lora_a.dtype) @ lora_a.flatten(0, 1).T).view(rows, slots, width // rank, rank)
    shrunk = shrunk * (token_slots[:rows, None] == torch.arange(slots, device=x.device))[:, :, None, None]
    expand = lora_b.flatten(0, 1)  # [slots * rank, columns]
    for j, (offset, size) in enumerate(zip(offsets, sizes)):
        update = shrunk[:, :, j].flatten(1) @ expand[:, offset:offset + size]
        y.narrow(1, offset, size).add_(update.to(y.dtype))
    return y
