"""Linear layers that hold their checkpoint's quantized weights (GGUF block types, AWQ, GPTQ):
``GroupQuant``, the unpacked form every loader reads a quantized tensor into; which layers can
stay quantized; and the ``QuantizedWeight`` each gets from its checkpoint parts.

A layer holds its weight quantized when every checkpoint tensor it is built from (q, k and v
for ``qkv_proj``; gate and up for ``gate_up_proj``) is quantized, and the planning pass names
it (weight_plan/plan.py, ``keeps_checkpoint_blocks``: where the kernels run, routers aside).
Its float parameter is dropped on the meta device before the
model is materialised, so the float32 matrix is never allocated. The same holds per expert for
a MoE layer's projections (the checkpoint's per-expert spelling; the FusedMoE stacks them), and
for a fused checkpoint tensor whose every piece fills one layer (Phi-3's qkv_proj).

The parts of a fused layer may come in different formats: GGUF Q4_K_M files hold ``attn_v``
(and some ``ffn_down``) as Q6_K beside Q4_K for the rest. The layer then takes the smallest
format that holds every part exactly: the widest of the parts' formats, each one's codes
fitting the next's (q4 0..15, q5 -16..15, q6 -32..31, q8 int8); groups split to the smallest
group size (a scale repeated), a missing offset is zero. Those layers cost more memory than
their parts did (a q4 part held as q6 takes 6 bits a code); the values are the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers import Linear, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.quantization import QuantizedWeight, kernel_matches_float64
from pagedllm.layers.quantization.quantized_weight import GroupScales
from pagedllm.weight_plan.plan import hold_checkpoint_blocks, hold_checkpoint_experts

_WIDER = ("q4", "q5", "q6", "q8")  # each format's codes fit the next's
_PANEL = 64  # output rows per panel of the quantized kernel (QuantizedWeight's PANEL)
_CHECK_ROWS = 3 * _PANEL  # layers up to this size are checked whole


@dataclass
class GroupQuant:
    """Codes of a ``[rows, cols]`` matrix with a scale (and optional offset) per group of
    ``group_size`` columns: ``value[r, c] = codes[r, c] * scales[r, c // G] + offsets[r, c // G]``.

    ``kind`` "q4": uint8 codes 0..15; "q5": int8 codes -16..15; "q6": int8 codes -32..31;
    "q8": int8 codes. ``scales``
    and ``offsets`` are GroupScales (plain float arrays [rows, cols // G] are taken as such):
    GGUF's K-quants keep their fp16 d per super-block and integer multipliers per group."""

    kind: str
    codes: np.ndarray                 # [rows, cols] uint8 (q4) or int8 (q5, q6, q8)
    scales: GroupScales
    offsets: GroupScales | None       # None: zero
    group_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.scales, GroupScales):
            self.scales = GroupScales(self.scales)
        if self.offsets is not None and not isinstance(self.offsets, GroupScales):
            self.offsets = GroupScales(self.offsets)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]`` (reference and fallback path; never the whole model at once)."""
        rows, cols = self.codes.shape
        groups = cols // self.group_size
        # [rows, groups, G]: one scale broadcast over each group
        out = self.codes.reshape(rows, groups, self.group_size).astype(np.float32)
        out *= self.scales.values()[:, :, None]
        if self.offsets is not None:
            out += self.offsets.values()[:, :, None]
        return out.reshape(rows, cols)

    def rows(self, index: np.ndarray | slice) -> GroupQuant:
        """The same format for a subset (or reordering) of the rows."""
        offsets = None if self.offsets is None else self.offsets.rows(index)
        return GroupQuant(self.kind, self.codes[index], self.scales.rows(index), offsets,
                          self.group_size)


@dataclass(frozen=True)
class Part:
    """Where one checkpoint tensor goes in a quantized weight: part ``index`` of ``num_parts``
    (rows stacked in that order), this rank's rows or columns ``start:start + size`` along
    ``dim`` (None: the whole tensor). The weight is a linear's (``expert`` None) or expert
    ``expert``'s of a FusedMoE's projection ``attr`` ("gate_up_proj", "down_proj")."""

    module_name: str
    index: int
    num_parts: int
    dim: int | None
    start: int
    size: int
    checkpoint_shape: tuple[int, ...]
    attr: str = "weight"
    expert: int | None = None

    @property
    def weight_key(self) -> tuple[str, str, int | None]:
        """Which quantized weight this part is a piece of (the parts of one are combined)."""
        return self.module_name, self.attr, self.expert


def plan_quantized_layers(model: nn.Module, expected: dict, quantized_names: set[str],
                          keep: set[str]) -> dict[str, list[Part]]:
    """Checkpoint name -> its Parts (one, or several where a fused tensor holds a layer's
    parts: Phi-3's qkv_proj) for the weights of the linear layers (and the untied lm_head),
    and of each expert of a FusedMoE's projections, of the modules in ``keep`` (the planning
    pass's ``keeps_checkpoint_blocks``) whose every part is in ``quantized_names``;
    ``expected`` is the loader's placement of the still-meta model (name -> [(WeightSlice,
    parameter name)])."""

    modules = dict(model.named_modules())
    tied = tied_heads(model)
    by_weight: dict[tuple[str, str, int | None], list[tuple[str, object]]] = {}
    for name, targets in expected.items():
        for piece, param_name in targets:
            module_name, _, attr = param_name.rpartition(".")
            # A tied embedding's tensor is the head's weight: the head holds it quantized and
            # the embedding reads its rows from there (its head's weight_format).
            module_name = tied.get(module_name, module_name)
            module = modules[module_name]
            if attr == "weight" and isinstance(module, (Linear, ParallelLMHead)):
                by_weight.setdefault((module_name, attr, None), []).append((name, piece))
            elif attr in FusedMoE.PROJECTIONS and isinstance(module, FusedMoE):
                # The per-expert spelling, "<module>.<e>.<projection>.weight" (a fused
                # checkpoint tensor of every expert stays float).
                expert = name[len(module_name) + 1:].split(".")[0]
                if expert.isdigit():
                    by_weight.setdefault((module_name, attr, int(expert)), []).append((name, piece))
    # A tensor whose pieces go elsewhere too (to another layer, or to a parameter that is not
    # a weight) stays float; one whose every piece fills one weight (Phi-3's fused qkv_proj:
    # this rank's q, k and v rows of one layer) is that weight's parts.
    weights_of: dict[str, list[tuple]] = {}
    for key, parts in by_weight.items():
        for name, _ in parts:
            weights_of.setdefault(name, []).append(key)
    whole = {name for name, keys in weights_of.items()
             if len(set(keys)) == 1 and len(keys) == len(expected[name])}
    plan: dict[str, list[Part]] = {}
    for (module_name, attr, expert), parts in by_weight.items():
        if module_name not in keep or not all(name in quantized_names and name in whole for name, _ in parts):
            continue
        for index, (name, piece) in enumerate(parts):
            size = piece.dest.shape[piece.dim] if piece.dim is not None else 0
            plan.setdefault(name, []).append(Part(module_name, index, len(parts), piece.dim,
                                                  piece.start, size, piece.checkpoint_shape(),
                                                  attr, expert))
    return plan


def tied_heads(model: nn.Module) -> dict[str, str]:
    """Embedding module name -> the name of the lm_head sharing its weight (tied)."""
    modules = dict(model.named_modules())
    heads = {id(m.weight): name for name, m in modules.items()
             if isinstance(m, ParallelLMHead) and m.weight is not None}
    return {name: heads[id(m.weight)] for name, m in modules.items()
            if isinstance(m, VocabParallelEmbedding) and m.weight is not None
            and id(m.weight) in heads}


def drop_float_weights(model: nn.Module, plan: dict[str, list[Part]]) -> None:
    """Remove the float parameter of every planned layer, and of the embedding tied to a
    planned head (call on the meta model)."""
    modules = dict(model.named_modules())
    parts = [part for name_parts in plan.values() for part in name_parts]
    planned = {part.module_name for part in parts if part.expert is None}
    for embedding, head in tied_heads(model).items():
        if head in planned:
            modules[embedding].weight = None
    for module_name in planned:
        modules[module_name].weight = None
    experts = {(part.module_name, part.attr) for part in parts if part.expert is not None}
    for module_name, attr in experts:
        modules[module_name].drop_float_projection(attr)


def this_rank(value: GroupQuant, part: Part) -> GroupQuant:
    if part.dim is None:
        return value
    if part.dim == 0:
        return value.rows(slice(part.start, part.start + part.size))
    g = value.group_size
    if part.start % g or part.size % g:
        raise ModelLoadError(f"a tensor-parallel split at input column {part.start} cuts a "
                             f"quantization group of {g}; use a tensor-parallel size that "
                             "keeps whole groups")
    groups = (part.start // g, (part.start + part.size) // g)
    offsets = None if value.offsets is None else value.offsets.groups(*groups)
    return GroupQuant(value.kind, value.codes[:, part.start:part.start + part.size],
                      value.scales.groups(*groups), offsets, g)


def combine(parts: list[GroupQuant]) -> GroupQuant:
    """The parts stacked by rows in one format that holds each exactly (module docstring)."""
    kinds = {p.kind for p in parts}
    kind = max(kinds, key=_WIDER.index)
    group = math.gcd(*(p.group_size for p in parts))
    with_offsets = any(p.offsets is not None for p in parts)
    codes, scales, offsets = [], [], []
    for p in parts:
        repeat = p.group_size // group
        codes.append(p.codes if p.kind == kind else p.codes.astype(np.int8))
        scales.append(p.scales.split(repeat))
        if with_offsets:
            off = p.offsets if p.offsets is not None else p.scales.zeros(p.codes.shape[0])
            offsets.append(off.split(repeat))
    if len(parts) == 1:
        return GroupQuant(kind, codes[0], scales[0], offsets[0] if with_offsets else None, group)
    return GroupQuant(kind, np.concatenate(codes), GroupScales.concat(scales),
                      GroupScales.concat(offsets) if with_offsets else None, group)


class QuantizedParts:
    """The parts of quantized weights, as a loader reads them (``add``): each weight is built
    from its parts (``combine``) and bound to its layer as soon as its last part arrives, so
    the unpacked parts of one layer are alive at a time, not the whole model's (a MoE
    projection's experts are stacked once every one is in). Call after the float tensors (the
    biases: the kernel check adds them) are loaded; ``finish`` at the end."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = dict(model.named_modules())
        self._attacher = QuantizedAttacher()
        self._parts: dict[tuple[str, str, int | None], dict[int, GroupQuant]] = {}
        self._experts: dict[tuple[str, str], dict[int, QuantizedWeight]] = {}

    def add(self, value: GroupQuant, parts: list[Part], source: str) -> None:
        """Checkpoint tensor ``value`` (named ``source`` in errors) as each of its planned
        ``parts``: this rank's rows or columns, by weight and index."""
        for part in parts:
            if value.shape != part.checkpoint_shape:
                raise ModelLoadError(f"{source} has shape {value.shape}, the model expects "
                                     f"{part.checkpoint_shape}")
            have = self._parts.setdefault(part.weight_key, {})
            have[part.index] = this_rank(value, part)
            if len(have) == part.num_parts:
                self._attach(part.weight_key, self._parts.pop(part.weight_key))

    def finish(self) -> None:
        if self._parts:
            module_name, attr, _ = next(iter(self._parts))
            raise ModelLoadError(f"the checkpoint holds only some parts of {len(self._parts)} "
                                 f"quantized weights (the first: {module_name}.{attr})")
        for (module_name, attr), experts in self._experts.items():
            hold_checkpoint_experts(self._modules[module_name], attr, experts)
        self._experts = {}

    def _attach(self, key: tuple[str, str, int | None], parts: dict[int, GroupQuant]) -> None:
        module_name, attr, expert = key
        value = combine([parts[i] for i in sorted(parts)])
        if expert is None:
            self._attacher.attach(self._modules[module_name], value)
        else:
            self._experts.setdefault((module_name, attr), {})[expert] = self._attacher.build(value, None)


class QuantizedAttacher:
    """Builds each layer's QuantizedWeight and hands it to the planning pass, checking the kernel against float64
    once per (format, shape, group, offsets) rather than per layer."""

    def __init__(self) -> None:
        self._checked: dict[tuple, bool] = {}

    def attach(self, layer: nn.Module, value: GroupQuant) -> None:
        missing = layer.out_features - value.codes.shape[0]
        if missing > 0:  # the last rank's vocabulary rows past the end: zero weights
            value = _pad_rows(value, missing)
        qweight = self.build(value, getattr(layer, "bias", None))
        if isinstance(layer, ParallelLMHead) and qweight.out_features != layer.out_features:
            raise ModelLoadError(f"lm_head weight has {qweight.out_features} rows, the layer "
                                 f"{layer.out_features}")
        hold_checkpoint_blocks(layer, qweight)

    def build(self, value: GroupQuant, bias: torch.Tensor | None) -> QuantizedWeight:
        """``value`` as a QuantizedWeight, the kernel checked on its (format, shape) first."""
        build = {"q4": QuantizedWeight.from_q4, "q5": QuantizedWeight.from_q5,
                 "q6": QuantizedWeight.from_q6, "q8": QuantizedWeight.from_q8}[value.kind]
        qweight = build(value.codes, value.scales, value.offsets, value.group_size)
        rows = value.codes.shape[0]
        key = (qweight.format, qweight.in_features, qweight.group_size,
               *((t.dtype, t.shape[-1]) if t is not None else None
                 for t in (qweight.scales, qweight.offsets)),
               bias is None, rows % _PANEL, rows > _CHECK_ROWS)
        if key not in self._checked:
            # The kernel's paths depend on the input size, the format and whether the last
            # panel is partial, not on the number of full panels: check two full panels and
            # the last one (kernel_matches_float64 dequantizes its whole weight in float64,
            # 8 bytes a weight: a 150k-row head would cost gigabytes).
            sample = np.arange(rows)
            if rows > _CHECK_ROWS:
                sample = np.concatenate((sample[:2 * _PANEL], sample[-(rows % _PANEL or _PANEL):]))
            small = value.rows(sample)
            self._checked[key] = kernel_matches_float64(
                build(small.codes, small.scales, small.offsets, small.group_size),
                None if bias is None else bias.detach()[torch.from_numpy(sample)])
        if not self._checked[key]:
            raise ModelLoadError(f"the {qweight.format} CPU kernel disagrees with float64 on a "
                                 f"{qweight.out_features}x{qweight.in_features} layer (or cannot "
                                 "be built here)")
        return qweight


def _pad_rows(value: GroupQuant, rows: int) -> GroupQuant:
    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate((a, np.zeros((rows, a.shape[1]), a.dtype)))

    def pad_groups(g: GroupScales) -> GroupScales:
        return GroupScales.concat([g, g.zeros(rows)])

    return GroupQuant(value.kind, pad(value.codes), pad_groups(value.scales),
                      None if value.offsets is None else pad_groups(value.offsets),
                      value.group_size)

