"""Quantizing a float32 weight at load time (``--quantization q8_0|q4_0``), round-to-nearest per
block of 32 inputs as llama.cpp's reference quantizers do (ggml-quants.c,
quantize_row_q8_0_ref / quantize_row_q4_0_ref), so a model quantized here computes what the same
model converted to a GGUF of that type computes:

- q8_0: ``d = max|w| / 127``, codes ``round(w / d)`` (halves away from zero), d kept as fp16;
- q4_0: ``d = m / -8`` for the block's value ``m`` of largest magnitude (sign included, so
  that value maps to code 0 exactly), codes ``min(15, trunc(w / d + 8.5))``, value
  ``(code - 8) * d``: scale d, offset -8 d.
"""
from __future__ import annotations

import torch

from pagedllm.errors import ValidationError
from pagedllm.layers.quantization.quantized_weight import QuantizedWeight

SCHEMES = ("q8_0", "q4_0")
BLOCK = 32  # inputs per block (QK8_0 = QK4_0 = 32)


def quantize_linear(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """``weight`` [out, in] (any float dtype) quantized by ``scheme``, "q8_0" or "q4_0"."""
    if scheme not in SCHEMES:
        raise ValidationError(f"quantization {scheme!r} is not supported; supported: "
                              f"{', '.join(SCHEMES)}", "quantization")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValidationError(f"{scheme} quantizes blocks of {BLOCK} inputs; a weight of shape "
                              f"{tuple(weight.shape)} has no whole blocks", "quantization")
    out_features, in_features = weight.shape
    blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
    if scheme == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        scaled = blocks * inv
        codes = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)  # roundf
        scale = d.half().float().squeeze(-1)
        return QuantizedWeight.from_q8(codes.reshape(out_features, in_features), scale, None, BLOCK)
    # q4_0: the signed value of largest magnitude (the first, on a tie), as llama.cpp's loop.
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = extreme / -8
    inv = torch.where(d == 0, 0.0, 1 / d)
    codes = (blocks * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    scale = d.half().float().squeeze(-1)
    return QuantizedWeight.from_q4(codes.reshape(out_features, in_features), scale, -8 * scale, BLOCK)
