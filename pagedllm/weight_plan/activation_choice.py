"""Which activations the quantized and bf16 linears take on CPU (ModelConfig's
``quantization_activations``), decided once after the weights are loaded and before the forward
compiles.

"auto" (the default) gives each format the numerics of the engine it comes from: int8
activations for block-quantized layers from GGUF files or load-time q8_0/q4_0 (llama.cpp's
integer dot products), bfloat16 activations for bf16 weights on a CPU whose kernels take them
(AVX512-BF16 or AMX: vLLM's oneDNN numerics), float32 elsewhere (float32 and fp16 weights, other
devices). AWQ/GPTQ checkpoints keep float32 under auto: their reference is the dequantized
model in the checkpoint's own dtype (the Hub's kernels are float16 GEMMs), and nobody measured
int8 activations against it. "float32" is the exact path; an explicit "int8" or "bfloat16" that
no layer takes is an error, where "auto" never is.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import has_bf16_activations
from pagedllm.layers.embed_head import VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.quantization import quantized_kernels_available
from pagedllm.layers.weight_format import ACTIVATIONS, Blocks, Quantized, WeightFormat, check_format

logger = logging.getLogger(__name__)

# Checkpoint formats whose block layers keep float32 activations under "auto" (module doc).
_EXACT_UNDER_AUTO = ("awq", "gptq")


def checkpoint_method(hf_config: dict) -> str | None:
    """The quantization a config.json names (awq, gptq, mxfp4, ...); None for a GGUF file's or
    a full-precision checkpoint's."""
    quant = hf_config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    return method or None


def choose_activations(model: nn.Module, requested: str, device: torch.device,
                       checkpoint: str | None) -> dict[str, str]:
    """Set every layer's activations for ``requested`` (float32, int8, bfloat16 or auto) and
    log the choice; returns weight format -> activations for the layers held in a format."""
    if requested == "auto":
        modes = []
        if quantized_kernels_available(device):
            if checkpoint not in _EXACT_UNDER_AUTO:
                modes.append("int8")
            if has_bf16_activations():
                modes.append("bfloat16")
        for mode in modes:
            try:
                set_quantization_activations(model, mode)
            except ModelLoadError as exc:  # a kernel that disagrees with float64 is never used
                logger.warning("activations: %s refused (%s); those layers keep float32", mode, exc)
    elif requested != "float32":
        if device.type != "cpu" or not set_quantization_activations(model, requested):
            raise ModelLoadError(
                f"quantization_activations={requested} applies to "
                + ("q8/q4 weights on CPU (GGUF, AWQ/GPTQ, quantization=q8_0/q4_0)"
                   if requested == "int8" else "bf16 weights on CPU (dtype=bfloat16)")
                + f"; this model on {device.type} has none: leave it at auto or float32")
    chosen = held_activations(model)
    by_mode: dict[str, list[str]] = {}
    for fmt, mode in sorted(chosen.items()):
        by_mode.setdefault(mode, []).append(fmt)
    described = ", ".join(f"{'/'.join(fmts)} layers {mode}" for mode, fmts in by_mode.items())
    logger.info("activations (quantization_activations=%s): %s", requested,
                described or "float32 (no layer in a quantized or 16-bit format)")
    return chosen


def set_quantization_activations(model: nn.Module, activations: str) -> int:
    """Run every layer of ``model`` (after loading and choose_linear_kernels) that takes
    ``activations`` with them: "int8", the block-quantized (q8/q4/q5/q6) layers; "bfloat16", the
    bf16 ones, dense and experts, their weights converted to that path's layout (a tied
    embedding follows its head: it holds the same format object) and each shape first checked
    against float64; "float32", the block layers back on their exact path. Returns how many
    layers (an MoE layer's experts: one) that is; the others keep float32 activations."""
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"quantization activations {activations!r} are not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
    converted: dict[int, WeightFormat] = {}  # id(format): the format with ``activations``
    checked: set[tuple[str, int, int]] = set()

    def convert(fmt: WeightFormat) -> WeightFormat:
        if id(fmt) not in converted:
            new = fmt.with_activations(activations)
            one = new
            if isinstance(new, Quantized) and new.qweight.codes.dim() == 4:  # a MoE's experts
                one = type(new)(new.qweight.expert(0), activations)
            key = (one.name, one.out_features, one.in_features)
            if activations == "bfloat16" and new is not fmt and key not in checked:
                check_format(one)
                checked.add(key)
            converted[id(fmt)] = new
        return converted[id(fmt)]

    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            formats = module.expert_formats
            if _takes(_lead(list(formats.values())), activations):
                for name, fmt in formats.items():
                    if _takes(fmt, activations):
                        formats[name] = convert(fmt)
                count += 1
            continue
        fmt = getattr(module, "weight_format", None)  # a Linear, the head or an embedding
        if fmt is None or not _takes(fmt, activations):
            continue
        module.weight_format = convert(fmt)
        # A tied embedding holds its head's format: converted with it, not counted again.
        count += not isinstance(module, VocabParallelEmbedding)
    return count


def _lead(formats: list[WeightFormat]) -> WeightFormat | None:
    """The format whose activations an MoE layer's experts take (the kernel's one flag serves
    both projections): the block-quantized projection's, else the first one."""
    return next((f for f in formats if isinstance(f, Blocks)), formats[0] if formats else None)


def _takes(fmt: WeightFormat | None, activations: str) -> bool:
    """Whether ``fmt`` is set by ``activations``: float32 resets every quantized or 16-bit
    format, int8 the block formats, bfloat16 the bf16 ones (fp16 weights take none)."""
    if not isinstance(fmt, Quantized):
        return False
    if activations == "float32":
        return True
    return activations == fmt.narrow_activations and fmt.name != "fp16"


def held_activations(model: nn.Module) -> dict[str, str]:
    """Weight format -> the activations its layers take (bf16_vnni reads as bf16: the layout
    bfloat16 activations convert bf16 weights to)."""
    chosen: dict[str, str] = {}
    for module in model.modules():
        formats = (list(module.expert_formats.values()) if isinstance(module, FusedMoE)
                   else [getattr(module, "weight_format", None)])
        for fmt in formats:
            if isinstance(fmt, Quantized):
                chosen[fmt.name.removesuffix("_vnni")] = fmt.activations
    return chosen
