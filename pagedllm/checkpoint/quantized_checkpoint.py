"""Quantized linears of a Hugging Face folder: AWQ/GPTQ checkpoints read into the q4 layout,
and full-precision checkpoints quantized at load (``quantization="q8_0" | "q4_0"``).

AWQ/GPTQ use the GGUF stream's mechanism (checkpoint/quantized_layers.py): plan
which layers every part of which is quantized, drop their float parameter on the meta device before the
model is materialised (the float matrix is never allocated), then build each layer's
``QuantizedWeight`` from its parts (q, k, v stacked for ``qkv_proj``) and bind it after the
rest of the weights (biases included) are loaded.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.checkpoint.quantized_layers import (
    GroupQuant,
    Part,
    QuantizedParts,
    plan_quantized_layers,
    quantized_kernels_available,
)
from pagedllm.checkpoint.renames import renamed
from pagedllm.checkpoint.weights import stream_safetensors
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.layers import FusedMoE, Linear, hold
from pagedllm.layers.quantization import QuantizedWeight, check_kernel, quantize_linear
from pagedllm.layers.quantization.checkpoint_formats import checkpoint_quant
from pagedllm.layers.quantization.round_to_nearest import BLOCK
from pagedllm.layers.weight_format import Quantized

logger = logging.getLogger(__name__)

_PACKED = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors


class QuantizedFolderWeights:
    """An AWQ/GPTQ folder's weights: ``plan`` (on the still-meta model) finds the linears its
    packed tensors fill; ``stream`` loads the float tensors, then builds each planned layer's
    QuantizedWeight from its packed tensors."""

    def __init__(self, config: dict, files: list[Path], device: torch.device) -> None:
        self.quant = checkpoint_quant(config)
        if not quantized_kernels_available(device):
            raise UnsupportedModelError(
                f"{self.quant.method} checkpoints run on pagedllm's CPU kernels; device "
                f"{device.type} (or a CPU without the C++ extension) is not supported; "
                "supported: device cpu")
        self.files = files
        self.where: dict[str, Path] = {}  # checkpoint name -> its file
        for path in files:
            with safe_open(str(path), framework="np") as f:
                self.where.update({name: path for name in f.keys()})
        self.bases: dict[str, str] = {}
        self.ignored: set[str] = set()  # the packed tensors, which the float stream skips

    def plan(self, model: nn.Module, expected: dict) -> dict[str, list[Part]]:
        bases = [name[:-len(".qweight")] for name in self.where if name.endswith(".qweight")]
        renames = getattr(model, "checkpoint_renames", {})
        self.bases = {renamed(base, renames) + ".weight": base for base in bases}
        plan = plan_quantized_layers(model, expected, set(self.bases))
        unplanned = sorted(set(self.bases) - set(plan))
        if unplanned:
            raise UnsupportedModelError(
                f"{self.quant.method} tensors for {', '.join(unplanned[:3])} fill no whole "
                "linear layer of this model (a fused or unknown layer); supported: quantized "
                "linears the model holds as separate or stacked parts")
        self.ignored = {f"{base}.{suffix}" for base in bases for suffix in _PACKED}
        return plan

    @torch.no_grad()
    def stream(self, model: nn.Module, expected: dict, plan: dict[str, list[Part]]) -> None:
        stream_safetensors(model, self.files, expected, self.ignored)
        quantized = QuantizedParts(model)  # after the biases: the kernel check adds them
        for name, parts in plan.items():
            base = self.bases[name]
            tensors = {}
            for suffix in _PACKED:
                path = self.where.get(f"{base}.{suffix}")
                if path is None:
                    if suffix == "g_idx":
                        continue
                    raise ModelLoadError(f"checkpoint is missing {base}.{suffix}")
                with safe_open(str(path), framework="np") as f:
                    tensors[suffix] = f.get_tensor(f"{base}.{suffix}")
            codes, scales, offsets = self.quant.unpack(base, tensors)
            value = GroupQuant("q4", codes, scales, offsets, self.quant.group_size)
            quantized.add(value, parts, f"{self.quant.method} layer {base}")
        quantized.finish()


@torch.no_grad()
def quantize_linears(model: nn.Module, scheme: str) -> None:
    """Step 2 of the planning pass (runner/weight_plan.py): every linear of the decoder layers
    (not the embedding, norms or lm_head), and every expert of a MoE layer's projections,
    quantized by ``scheme`` ("q8_0" | "q4_0", llama.cpp's
    round-to-nearest); the float weight is freed as each layer is converted. Layers whose input
    is not whole blocks of 32 stay float (as llama.cpp keeps them), with a log line. A MoE
    block's routers stay float, as llama.cpp keeps them (the planning pass packs routers for
    the batch-independent kernel: runner/weight_plan.py)."""
    if not quantized_kernels_available(next(model.parameters()).device):
        raise UnsupportedModelError(f"quantization {scheme} runs on pagedllm's CPU kernels; "
                                    "supported: device cpu with the C++ extension built")
    routers = {id(getattr(block, name)) for block in model.modules()
               if isinstance(getattr(block, "experts", None), FusedMoE)
               for name in ("gate", "shared_expert_gate") if hasattr(block, name)}
    checked: set[tuple] = set()
    kept: list[str] = []
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.weight is None or id(layer) in routers:
            continue
        if layer.in_features % BLOCK:
            kept.append(name)
            continue
        qweight = quantize_linear(layer.weight, scheme)
        key = (*layer.weight.shape, layer.bias is None)
        if key not in checked:  # once per shape
            check_kernel(qweight, layer.bias)
        hold(layer, Quantized.of(qweight))
        checked.add(key)
        count += 1
    for name, layer in model.named_modules():
        # GPT-OSS's MXFP4 experts keep the checkpoint's values (dequantized exactly).
        if not isinstance(layer, FusedMoE) or layer.weight_format == "mxfp4":
            continue
        for attr in list(layer.float_weights()):
            if layer.float_weights()[attr].shape[-1] % BLOCK:
                kept.append(f"{name}.{attr}")
                continue
            qweights = [quantize_linear(w, scheme) for w in layer.float_weights()[attr]]
            check_kernel(qweights[0], None)  # one check per projection: every expert has its shape
            layer.hold(attr, Quantized.of(QuantizedWeight.stack(qweights)))
            count += 1
    why = f"; kept float (input not a multiple of {BLOCK}): {', '.join(kept)}" if kept else ""
    logger.info("quantization %s: %d linear layers (an MoE layer's experts: one per projection) "
                "quantized at load%s", scheme, count, why)

