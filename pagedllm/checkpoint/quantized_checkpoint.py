"""Quantized linears of a Hugging Face folder: AWQ/GPTQ checkpoints read into the q4 layout
(load-time ``quantization="q8_0" | "q4_0"`` is the planning pass's: weight_plan/plan.py).

AWQ/GPTQ use the GGUF stream's mechanism (checkpoint/quantized_layers.py): plan
which layers every part of which is quantized, drop their float parameter on the meta device before the
model is materialised (the float matrix is never allocated), then build each layer's
``QuantizedWeight`` from its parts (q, k, v stacked for ``qkv_proj``) and bind it after the
rest of the weights (biases included) are loaded.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.checkpoint.quantized_layers import GroupQuant, Part, QuantizedParts, plan_quantized_layers
from pagedllm.checkpoint.renames import renamed
from pagedllm.checkpoint.weights import stream_safetensors
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.layers.quantization import quantized_kernels_available
from pagedllm.layers.quantization.checkpoint_formats import checkpoint_quant
from pagedllm.weight_plan.plan import keeps_checkpoint_blocks

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
        self.files, self.device = files, device
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
        keep = keeps_checkpoint_blocks(model, self.device, only_form=True)
        plan = plan_quantized_layers(model, expected, set(self.bases), keep)
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
