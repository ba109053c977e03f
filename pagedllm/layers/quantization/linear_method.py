"""Checking a weight held in another format than float32: a loader that reads quantized
tensors (GGUF, AWQ, GPTQ) builds a ``QuantizedWeight`` (``from_q8`` / ``from_q4`` / ``from_q5``
/ ``from_q6``), checks its kernel here, and the layer holds ``Quantized.of(qweight)``
(layers/weight_format.py: ``Blocks`` or ``Half``; ``layers.linear.hold``). For a stacked
layer (qkv_proj, gate_up_proj) the loader concatenates the parts' codes, scales and offsets
along the rows first (groups run along the input, so every part's rows stay whole); a
tensor-parallel slice of the input must cut at group boundaries.
"""
from __future__ import annotations

import torch

from pagedllm.kernels.cpu_extension import load_cpu_ops
from pagedllm.layers.quantization.quantized_weight import QuantizedWeight


def quantized_kernels_available(device: torch.device) -> bool:
    """The formats other than float32 run on pagedllm's CPU kernels only."""
    return device.type == "cpu" and load_cpu_ops() is not None


def check_kernel(qweight: QuantizedWeight, bias: torch.Tensor | None,
                 activations: str = "float32") -> None:
    """ModelLoadError unless ``kernel_matches_float64``, saying why."""
    from pagedllm.layers.weight_format import Quantized, check_format

    check_format(Quantized.of(qweight, activations), bias)


def kernel_matches_float64(qweight: QuantizedWeight, bias: torch.Tensor | None,
                           activations: str = "float32") -> bool:
    """``WeightFormat.check`` of ``qweight`` with ``activations`` (False when the kernels
    cannot be built here)."""
    from pagedllm.layers.weight_format import Quantized

    return Quantized.of(qweight, activations).check(bias)
