"""An adapter's pairs on a MoE layer's experts, read into one update per projection of the fused
layer (layers/fused_moe.py: ``gate_up_proj`` [E, 2I, H], gate rows then up rows; ``down_proj``
[E, H, I]).

Two spellings. PEFT's ``target_parameters`` on transformers 5's fused experts: one pair per fused
tensor, ``lora_A`` [E * r, in] (expert e's rows ``e*r .. e*r + r``) and ``lora_B`` [out, E * r]
(expert e's columns ``e, e + E, ...``: PEFT reshapes it to [out, r, E]); a second targeted tensor
nests as ``experts.base_layer``, so which pair is which follows from the shapes, never the name.
Or one pair per expert and projection (``experts.N.gate_proj``, Mixtral's ``w1``/``w3``/``w2``), as
adapters trained on per-expert modules hold them: gate and up are stacked (B block-diagonal).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.fused_moe import ExpertLayout, FusedMoE
from pagedllm.lora.request import LoRARequest

# PEFT's fused spelling nests one wrapper per targeted tensor: experts[.base_layer]*.
_NESTED = re.compile(r"(\.base_layer)+$")
_PER_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")


@dataclass(frozen=True)
class ExpertTarget:
    """A FusedMoE layer's experts on this rank (a rank holds I / tp of each expert's units)."""
    layer_name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int  # this rank's
    full_intermediate_size: int
    inter_start: int  # this rank's first unit
    expert_names: tuple[str, str, str]  # gate, up, down in the per-expert spelling


# One projection's update for every expert: A [E, R, in] and B^T [E, R, out] (scaled), zeros for
# an expert the adapter does not train.
ExpertPair = tuple[torch.Tensor, torch.Tensor]


def expert_targets(model: nn.Module) -> dict[str, ExpertTarget]:
    """Checkpoint module name -> target for every FusedMoE layer in the stacked layout (the
    per-expert spelling's names follow ``checkpoint_renames`` back, e.g. Mixtral's
    ``block_sparse_moe``)."""
    renames = getattr(model, "checkpoint_renames", None) or {}
    targets: dict[str, ExpertTarget] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE) or module.layout != ExpertLayout.STACKED:
            continue
        target = ExpertTarget(name, module.num_experts, module.hidden_size, module.intermediate_size,
                              module.full_intermediate_size, module.tp.rank * module.intermediate_size,
                              module.expert_names)
        targets[name] = target
        for checkpoint, ours in renames.items():
            if ours in name:
                targets[name.replace(ours, checkpoint)] = target
    return targets


def split_expert_pairs(pairs: dict[str, dict[str, torch.Tensor]], targets: dict[str, ExpertTarget]
                       ) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Remove the pairs on experts from ``pairs``: target layer name -> {module: pair}."""
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for module in list(pairs):
        per_expert = _PER_EXPERT.match(module)
        layer = per_expert["layer"] if per_expert else _NESTED.sub("", module)
        target = targets.get(layer)
        if target is not None:
            found.setdefault(target.layer_name, {})[module] = pairs.pop(module)
    return found


def read_expert_update(fail, request: LoRARequest, rank: int, scaling: float,
                       pairs: dict[str, dict[str, torch.Tensor]], target: ExpertTarget,
                       dtype: torch.dtype) -> dict[str, ExpertPair]:
    """Projection (``gate_up_proj``/``down_proj``) -> its update, this rank's part; ``fail``
    makes the one-line refusal."""
    t = target
    full, inter, start, num = t.full_intermediate_size, t.intermediate_size, t.inter_start, t.num_experts
    gate, up, down = t.expert_names
    # Per projection: (A columns kept, B rows kept) of this rank, as index ranges of the full tensors.
    gate_up_rows = torch.cat((torch.arange(start, start + inter), torch.arange(full + start, full + start + inter)))
    shapes = {"gate_up_proj": (t.hidden_size, 2 * full), "down_proj": (full, t.hidden_size)}
    update: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def add(name: str, expert: int, a: torch.Tensor, b: torch.Tensor) -> None:
        update.setdefault(name, [[] for _ in range(num)])[expert].append((a, b))

    for module, pair in sorted(pairs.items()):
        a, b = pair["A"], pair["B"]
        per_expert = _PER_EXPERT.match(module)
        if per_expert is None:  # fused: which tensor it trains from the shapes
            name = next((n for n, (n_in, n_out) in shapes.items()
                         if tuple(a.shape) == (num * rank, n_in) and tuple(b.shape) == (n_out, num * rank)), None)
            if name is None:
                raise fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither "
                                    f"fused expert tensor of the base ({num} experts, hidden {t.hidden_size}, "
                                    f"intermediate {full}) at rank {rank}")
            b_by_expert = b.reshape(b.shape[0], rank, num)
            for e in range(num):
                add(name, e, a[e * rank:(e + 1) * rank], b_by_expert[:, :, e])
            continue
        expert, proj = int(per_expert["expert"]), per_expert["proj"]
        want = {gate: (t.hidden_size, full), up: (t.hidden_size, full), down: (full, t.hidden_size)}.get(proj)
        if want is None or expert >= num:
            raise fail(request, f"{module}: the base's experts are 0..{num - 1} with projections "
                                f"{gate}, {up}, {down}")
        if tuple(a.shape) != (rank, want[0]) or tuple(b.shape) != (want[1], rank):
            raise fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                                f"base's {want[1]}x{want[0]} expert weight at rank {rank} (expected "
                                f"{(rank, want[0])} and {(want[1], rank)})")
        if proj == down:
            add("down_proj", expert, a, b)
        else:  # its rows of the fused gate_up: B padded with zeros over the other half
            padded = b.new_zeros(2 * full, rank)
            padded[(0 if proj == gate else full):(full if proj == gate else 2 * full)] = b
            add("gate_up_proj", expert, a, padded)
    return {name: _stack(experts, name, rank, scaling, gate_up_rows, slice(start, start + inter), dtype)
            for name, experts in update.items()}


def _stack(experts: list[list[tuple[torch.Tensor, torch.Tensor]]], name: str, rank: int, scaling: float,
           gate_up_rows: torch.Tensor, down_cols: slice, dtype: torch.dtype) -> ExpertPair:
    """Every expert's pairs of one projection as (A [E, R, in], B^T [E, R, out]) on this rank."""
    width = rank * max(len(pairs) for pairs in experts)
    parts = [p for pairs in experts for p in pairs]
    in_size = parts[0][0][:, down_cols].shape[1] if name == "down_proj" else parts[0][0].shape[1]
    out_size = len(gate_up_rows) if name == "gate_up_proj" else parts[0][1].shape[0]
    lora_a = torch.zeros(len(experts), width, in_size, dtype=dtype)
    lora_b_t = torch.zeros(len(experts), width, out_size, dtype=dtype)
    for e, pairs in enumerate(experts):
        for j, (a, b) in enumerate(pairs):
            cols = slice(j * rank, (j + 1) * rank)
            lora_a[e, cols] = (a[:, down_cols] if name == "down_proj" else a).to(dtype)
            b_rank = b[gate_up_rows] if name == "gate_up_proj" else b
            lora_b_t[e, cols] = (b_rank.float() * scaling).T.to(dtype)
    return lora_a, lora_b_t
