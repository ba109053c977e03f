"""Weight formats of linear layers other than float32: bf16/fp16 and block-quantized (q8, q4, q5,
q6),
kept in that format in memory and multiplied by pagedllm's CPU kernel (csrc/quant_gemm.cpp).

- quantized_weight.py  ``QuantizedWeight``: the packed weight, built from plain arrays
                       (``from_half``, ``from_q8/q4/q5/q6``), ``dequantize()``, ``nbytes``;
                       the table of GGUF/AWQ/GPTQ types and the layout each maps to
- linear_method.py     ``check_kernel(qweight, bias)``: the kernel against float64 on a
                       loader's weight, before a layer holds it (Blocks, Half)
- round_to_nearest.py  ``quantize_linear(weight, "q8_0" | "q4_0")``: quantization at load
- checkpoint_formats.py  AWQ / GPTQ checkpoints: ``quantization_config`` checked, packed
                       tensors unpacked to q4; ``resolve_quantization`` (the flag vs the
                       checkpoint). The loading itself: pagedllm/checkpoint/
"""
from __future__ import annotations

from pagedllm.layers.quantization.linear_method import (
                                                        check_kernel,
                                                        kernel_matches_float64,
                                                        quantized_kernels_available,
)
from pagedllm.layers.quantization.quantized_weight import FORMATS, QuantizedWeight
from pagedllm.layers.quantization.round_to_nearest import SCHEMES, quantize_linear

__all__ = ["FORMATS", "SCHEMES", "QuantizedWeight", "check_kernel", "kernel_matches_float64",
           "quantize_linear", "quantized_kernels_available"]
