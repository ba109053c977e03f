"""LoRA on a MoE layer's experts: each token's routed experts get its adapter's low-rank update.

An expert's gate/up update must join its product before the activation, which the CPU kernel
(``pagedllm::fused_experts``) runs inside one op. So the rows of an adapter that trained this
layer's experts take the per-expert path instead: each active expert's base product through the
format the layer holds it in (float panels, stacked half or quantized codes, or the float tensor:
that expert's slice, the weights untouched), plus ``(x A_e^T) B_e^T`` of the row's adapter, the
activation, the down product plus its update, and the router's weighted sum. Every other row (the
base's, or an adapter's that left these experts alone) runs the layer as without adapters, so its
result never depends on which adapters share the step. A step with such an adapter resident runs
eagerly (the runner asks ``LoRAManager.eager_only``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.weight_format import Dense, Panels, Quantized
from pagedllm.lora.expert_loader import ExpertPair
from pagedllm.lora.mapping import get_lora_mapping


def expert_product(layer: FusedMoE, name: str, expert: int, x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Expert ``expert``'s base product of projection ``name`` through the format it is held in."""
    fmt = layer.expert_formats.get(name)
    if fmt is None or isinstance(fmt, Dense):
        return F.linear(x, getattr(layer, name)[expert], bias)
    if isinstance(fmt, Panels):
        return Panels(fmt.packed[expert], fmt.out_features).apply(x.float(), bias).to(x.dtype)
    if isinstance(fmt, Quantized):
        return type(fmt)(fmt.qweight.expert(expert), fmt.activations).apply(x, bias)
    raise NotImplementedError(f"LoRA on experts held as {fmt.describe()}")


class LoRAExperts:
    """A FusedMoE layer's adapter slots (``layer.lora``): per slot, projection -> ExpertPair."""

    def __init__(self, layer: FusedMoE, num_slots: int) -> None:
        self.layer = layer
        self.slots: list[dict[str, ExpertPair] | None] = [None] * num_slots
        self._trained = torch.zeros(num_slots + 1, dtype=torch.bool)  # last entry: the base's -1
        self._last: tuple[object, torch.Tensor | None] | None = None  # (mapping, its token slots)

    def set_slot(self, slot: int, update: dict[str, ExpertPair] | None) -> None:
        self.slots[slot] = update or None
        self._trained[slot] = bool(update)
        self._last = None

    def lora_tensors(self) -> list[torch.Tensor]:
        return [t for update in self.slots if update for pair in update.values() for t in pair]

    def token_slots(self, num_tokens: int) -> torch.Tensor | None:
        """Each token's slot where its adapter trained these experts, else -1; None when no token's did."""
        mapping = get_lora_mapping()
        if mapping is None or not self._trained.any():
            return None
        if self._last is not None and self._last[0] is mapping:
            return self._last[1]
        if mapping.row_slots is not None:
            slots = torch.where(self._trained[mapping.row_slots], mapping.row_slots, -1)
        else:
            slots = torch.full((num_tokens,), -1, dtype=torch.long)
            for slot, rows in mapping.groups:
                if self._trained[slot]:
                    slots[slice(None) if rows is None else rows] = slot
        result = slots if bool((slots >= 0).any()) else None
        self._last = (mapping, result)
        return result

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                base) -> torch.Tensor:
        """The layer's output; ``base(x, weights, ids)`` is the layer without adapters."""
        slots = self.token_slots(x.shape[0])
        if slots is None:
            return base(x, topk_weights, topk_ids)
        adapted = (slots >= 0).nonzero().squeeze(1)
        if adapted.numel() == x.shape[0]:
            return self._adapted(x, topk_weights, topk_ids, slots)
        rest = (slots < 0).nonzero().squeeze(1)
        out = x.new_empty(x.shape[0], self.layer.hidden_size)
        out.index_copy_(0, rest, base(x[rest], topk_weights[rest], topk_ids[rest]))
        return out.index_copy_(0, adapted, self._adapted(x[adapted], topk_weights[adapted], topk_ids[adapted],
                                                         slots[adapted]))

    def _adapted(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        used = slots.unique().tolist()

        def expert(e: int, xs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            row_slots = None if len(used) == 1 else slots[tokens]
            bias_1 = None if layer.gate_up_proj_bias is None else layer.gate_up_proj_bias[e]
            bias_2 = (layer.down_proj_bias[e]
                      if layer.down_proj_bias is not None and layer.tp.rank == 0 else None)
            h = self._add(expert_product(layer, "gate_up_proj", e, xs, bias_1), "gate_up_proj", e, xs,
                          used, row_slots)
            a = layer.act(h)
            return self._add(expert_product(layer, "down_proj", e, a, bias_2), "down_proj", e, a, used, row_slots)

        return layer.apply_experts(x, topk_weights, topk_ids, expert)

    def _add(self, y: torch.Tensor, name: str, e: int, x: torch.Tensor, used: list[int],
             row_slots: torch.Tensor | None) -> torch.Tensor:
        """``y`` plus each row's update of expert ``e``'s projection ``name``."""
        for slot in used:
            pair = self.slots[slot].get(name)
            if pair is None:
                continue
            lora_a, lora_b_t = pair[0][e], pair[1][e]
            if row_slots is None:  # one adapter: every row
                y = y + ((x.to(lora_a.dtype) @ lora_a.T) @ lora_b_t).to(y.dtype)
                continue
            rows = (row_slots == slot).nonzero().squeeze(1)
            if rows.numel():
                y = y.index_add(0, rows, ((x[rows].to(lora_a.dtype) @ lora_a.T) @ lora_b_t).to(y.dtype))
        return y
