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
from pagedllm.layers.quantization import quantized_kernels_available, set_quantization_activations

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


def held_activations(model: nn.Module) -> dict[str, str]:
    """Weight format -> the activations its layers take (bf16_vnni reads as bf16: the layout
    bfloat16 activations convert bf16 weights to)."""
    chosen: dict[str, str] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        for name in ("qweight", "qweight_gate_up", "qweight_down"):
            qweight = getattr(module, name, None)
            if qweight is not None:
                chosen[qweight.format.removesuffix("_vnni")] = method.activations
    return chosen
