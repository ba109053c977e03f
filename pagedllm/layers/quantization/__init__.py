"""Weight formats of linear layers other than float32: bf16/fp16 and block-quantized (q8, q4),
kept in that format in memory and multiplied by pagedllm's CPU kernel (csrc/quant_gemm.cpp).

- quantized_weight.py  ``QuantizedWeight``: the packed weight, built from plain arrays
                       (``from_half``, ``from_q8``, ``from_q4``), ``dequantize()``, ``nbytes``;
                       the table of GGUF/AWQ/GPTQ types and the layout each maps to
- linear_method.py     one ``LinearMethod`` per format, ``set_quantized_weight(layer, qweight)``
- round_to_nearest.py  ``quantize_linear(weight, "q8_0" | "q4_0")``: quantization at load
"""
from __future__ import annotations

from pagedllm.layers.quantization.linear_method import (HalfLinearMethod, LinearMethod,
                                                        Q4LinearMethod, Q8LinearMethod,
                                                        kernel_matches_float64,
                                                        set_quantized_weight)
from pagedllm.layers.quantization.quantized_weight import FORMATS, QuantizedWeight
from pagedllm.layers.quantization.round_to_nearest import SCHEMES, quantize_linear

__all__ = ["FORMATS", "SCHEMES", "HalfLinearMethod", "LinearMethod", "Q4LinearMethod",
           "Q8LinearMethod", "QuantizedWeight", "kernel_matches_float64", "quantize_linear",
           "set_quantized_weight"]
