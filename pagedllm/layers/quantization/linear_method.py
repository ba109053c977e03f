"""Binding a weight held in another format than float32 to a layer: a loader that reads
quantized tensors (GGUF, AWQ, GPTQ) builds a ``QuantizedWeight`` (``from_q8`` / ``from_q4`` /
``from_q5`` / ``from_q6``) and calls ``set_quantized_weight(layer, qweight)``, which gives the
layer the ``WeightFormat`` that multiplies by it (layers/weight_format.py: ``Blocks`` or
``Half``). For a stacked layer (qkv_proj, gate_up_proj) the loader concatenates the parts'
codes, scales and offsets along the rows first (groups run along the input, so every part's
rows stay whole); a tensor-parallel slice of the input must cut at group boundaries.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import load_cpu_ops
from pagedllm.layers.quantization.quantized_weight import QuantizedWeight


def quantized_kernels_available(device: torch.device) -> bool:
    """The formats other than float32 run on pagedllm's CPU kernels only."""
    return device.type == "cpu" and load_cpu_ops() is not None


def set_quantized_weight(layer: nn.Module, qweight: QuantizedWeight, check: bool = True) -> None:
    """Make ``layer`` hold ``qweight`` only (its ``weight`` becomes None) and multiply through
    its format (``Quantized.of``). ``check``: first compare the kernel with float64 on the dequantized
    weight (see ``kernel_matches_float64``); a mismatch raises ModelLoadError."""
    # [out, in] of the layer: its allocated weight's (an lm_head has no in_features)
    weight = getattr(layer, "weight", None)
    shape = tuple(weight.shape) if weight is not None else (layer.out_features, layer.in_features)
    if (qweight.out_features, qweight.in_features) != shape:
        raise ModelLoadError(f"a {qweight.out_features}x{qweight.in_features} weight does not fit "
                             f"a {shape[0]}x{shape[1]} layer")
    from pagedllm.layers.weight_format import Quantized  # builds on this package's weights

    if check:
        check_kernel(qweight, getattr(layer, "bias", None))
    layer.weight_format, layer.weight = Quantized.of(qweight), None


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
