"""The GGUF stream (``LLM("model.gguf")``): the file's tensors into a model of the class a Hugging
Face folder of that architecture gets.

The GGUF tensors are renamed to HF names (names.py), Llama's q/k rows put back in HF order,
Gemma's norm shift taken off, stacked experts split into the per-expert names, and each is placed
where the safetensors stream would place it (checkpoint/placement.py: fused q/k/v and gate/up
parts, this rank's rows under tensor parallelism). A parameter no tensor fills is an error.

Block-quantized linear weights stay quantized (checkpoint/quantized_layers.py: the layer's float
weight is never allocated; its ``QuantizedWeight`` is built from the unpacked parts), the lm_head
too, tied or not: a tied embedding then reads its rows from the head's quantized weight (most
small models tie them, and the head is read whole every decode step). So do stacked experts: each
expert's slice of the stack is a ``QuantizedWeight`` handed to its FusedMoE, which stacks them for
its grouped kernel; and a fused tensor holding one layer's parts (Phi-3's qkv and gate/up): this
rank's rows of each part. Routers stay float. Everything else is loaded as float in the model's
dtype, one tensor at a time: norms (small) and an untied token embedding, dequantized when the
file holds it quantized (a lookup reads a few rows). On a device where the quantized kernels do
not run, every weight is dequantized instead.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedllm.checkpoint.gguf.encoders import encoder_model_prefix
from pagedllm.checkpoint.gguf.names import (
    CONFIG_TENSORS,
    expert_names,
    hf_name,
    is_expert_stack,
    is_permuted,
    norm_shift,
    unpermute_rows,
)
from pagedllm.checkpoint.gguf.quant_types import FLOAT_TYPES, GroupQuant, unpack
from pagedllm.checkpoint.gguf.reader import GGUFCheckpoint, GGUFTensor
from pagedllm.checkpoint.quantized_layers import Part, QuantizedParts, plan_quantized_layers
from pagedllm.errors import ModelLoadError
from pagedllm.layers import WeightSlice
from pagedllm.weight_plan.plan import keeps_checkpoint_blocks

logger = logging.getLogger(__name__)


class GGUFWeights:
    """A GGUF file's weights. ``plan``: its block-quantized matrices of the layers the planning
    pass names stay quantized; ``stream``: float tensors first, then the block types."""

    def __init__(self, ckpt: GGUFCheckpoint, config: dict, dtype: torch.dtype, device: torch.device) -> None:
        self.ckpt, self.config, self.dtype, self.device = ckpt, config, dtype, device

    def plan(self, model: nn.Module, expected: dict) -> dict[str, list[Part]]:
        ckpt = self.ckpt
        keep = keeps_checkpoint_blocks(model, self.device, only_form=False)
        if keep:
            quantized = {name for t in ckpt.tensors.values() if t.type_id not in FLOAT_TYPES
                         for name in _hf_names(model, t, ckpt.architecture, encoder_model_prefix(self.config))}
            return plan_quantized_layers(model, expected, quantized, keep)
        if any(t.type_id not in FLOAT_TYPES for t in ckpt.tensors.values()):
            logger.warning("%s: quantized weights dequantized to %s (the quantized kernels run on "
                           "CPU only, and need the C++ extension)", ckpt.path.name, self.dtype)
        return {}

    @torch.no_grad()
    def stream(self, model: nn.Module, expected: dict, plan: dict[str, list[Part]]) -> None:
        stream_gguf(model, self.ckpt, self.config, dict(plan), expected)


@torch.no_grad()
def stream_gguf(model: nn.Module, ckpt: GGUFCheckpoint, config: dict,
                plan: dict[str, list[Part]], expected: dict) -> None:
    quantized = QuantizedParts(model)
    unexpected: list[str] = []
    arch, prefix = ckpt.architecture, encoder_model_prefix(config)
    # Float tensors first (norms, biases: the quantized layers' kernel check adds the bias),
    # then the block types, each quantized layer built as soon as its parts are read.
    for tensor in sorted(ckpt.tensors.values(), key=lambda t: t.type_id not in FLOAT_TYPES):
        if tensor.name in CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, arch, prefix)
        if name is not None and is_expert_stack(tensor.name):
            pieces = _experts(model, tensor, name, _read(tensor, arch, config))
        elif name in expected or name in plan:
            pieces = [(name, None)]  # read once it is known to be wanted
        else:
            unexpected.append(tensor.name)
            continue
        for piece_name, value in pieces:
            if piece_name in plan:  # stays quantized: part(s) of a QuantizedWeight
                value = _read(tensor, arch, config) if value is None else value
                assert isinstance(value, GroupQuant)  # planned from the file's types
                quantized.add(value, plan.pop(piece_name), f"GGUF tensor {tensor.name} ({piece_name})")
                continue
            targets = expected.pop(piece_name, None)
            if targets is None:
                unexpected.append(f"{tensor.name} ({piece_name})")
                continue
            if value is None:
                value = _read(tensor, arch, config)
            for piece, param_name in targets:
                if tuple(value.shape) != piece.checkpoint_shape():
                    raise ModelLoadError(f"GGUF tensor {tensor.name} has shape {tuple(value.shape)}, "
                                         f"the model expects {piece.checkpoint_shape()} (for {param_name})")
                _copy(value, piece)
    missing = sorted(expected) + sorted(plan)
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ModelLoadError(f"{ckpt.path.name} is missing {len(missing)} tensors: "
                             f"{', '.join(missing[:10])}{more}")
    quantized.finish()
    if unexpected:
        logger.warning("ignoring %d GGUF tensors the model does not use: %s",
                       len(unexpected), ", ".join(unexpected[:10]))


def _read(tensor: GGUFTensor, architecture: str, config: dict) -> GroupQuant | np.ndarray:
    """The tensor unpacked (GroupQuant or a float array), in HF's row order and values. A stack
    of experts ``[E, out, in]`` in a block type comes back as ``[E * out, in]`` (block types are
    rows of groups)."""
    shape = tensor.shape
    if len(shape) == 3 and tensor.type_id not in FLOAT_TYPES:
        shape = (shape[0] * shape[1], shape[2])
    try:
        value = unpack(tensor.type_id, tensor.read(), shape)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: {e}") from e
    if is_permuted(tensor.name, architecture):
        heads = config["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
        perm = unpermute_rows(tensor.shape[0], heads)
        value = value.rows(perm) if isinstance(value, GroupQuant) else value[perm]
    shift = norm_shift(tensor.name, architecture)
    if shift:
        value = value.astype(np.float32) - np.float32(shift)
    return value


def _hf_names(model: nn.Module, tensor: GGUFTensor, architecture: str, model_prefix: str) -> list[str]:
    """The HF checkpoint names a GGUF tensor provides: one, or one per expert of a stack."""
    name = hf_name(tensor.name, architecture, model_prefix)
    if name is None:
        return []
    moe_args = getattr(model, "moe_args", None)
    if is_expert_stack(tensor.name) and moe_args is not None and len(tensor.shape) == 3:
        return expert_names(name, tensor.shape[0], moe_args.expert_names)
    return [name]


def _experts(model: nn.Module, tensor: GGUFTensor, stacked_name: str,
             value: GroupQuant | np.ndarray) -> list[tuple[str, GroupQuant | np.ndarray]]:
    """A stacked-experts tensor as (per-expert HF name, that expert's ``[out, in]``) pairs."""
    moe_args = getattr(model, "moe_args", None)
    if moe_args is None or len(tensor.shape) != 3:
        raise ModelLoadError(f"GGUF tensor {tensor.name} (shape {tensor.shape}) stacks experts, "
                             "but the model built from the file's metadata has none")
    num_experts, rows = tensor.shape[0], tensor.shape[1]
    names = expert_names(stacked_name, num_experts, moe_args.expert_names)
    if isinstance(value, GroupQuant):
        return [(n, value.rows(slice(e * rows, (e + 1) * rows))) for e, n in enumerate(names)]
    return [(n, value[e]) for e, n in enumerate(names)]


def _copy(value: GroupQuant | np.ndarray, piece: WeightSlice) -> None:
    """This rank's rows (or columns) of ``value`` into ``piece.dest``, dequantized."""
    if isinstance(value, GroupQuant):
        value = value.dequantize()  # one tensor in float32 at a time
    if piece.dim is not None:
        index = [slice(None)] * value.ndim
        index[piece.dim] = slice(piece.start, piece.start + piece.dest.shape[piece.dim])
        value = value[tuple(index)]
    value = np.ascontiguousarray(value)
    if not value.flags.writeable:  # a view of the read-only file map: torch wants its own copy
        value = value.copy()
    piece.dest.copy_(torch.from_numpy(value))  # casts to the model dtype
