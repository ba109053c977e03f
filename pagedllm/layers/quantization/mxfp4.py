"""MXFP4 (OCP microscaling FP4), as the openai/gpt-oss checkpoints ship their experts.

Each weight row is cut into blocks of 32 values along the input dimension. A block is 16 bytes
of FP4 (e2m1: 1 sign, 2 exponent, 1 mantissa bit), two values a byte, the low nibble first, and
one shared scale byte, e8m0: the power of two ``2 ** (scale - 127)``. The checkpoint holds
``*_blocks`` ``[..., rows, in / 32, 16]`` uint8 and ``*_scales`` ``[..., rows, in / 32]`` uint8;
rows are the output dimension (nn.Linear's orientation). pagedllm dequantizes at load to the
model dtype: every e2m1 value times a power of two is exact in bf16, fp16 (within its range)
and fp32, so the float weights equal the quantized ones.
"""
from __future__ import annotations

import torch

from pagedllm.errors import ModelLoadError

BLOCK_SIZE = 32  # values per scale
SCALE_BIAS = 127  # e8m0: the byte is the exponent plus 127

# The 16 e2m1 codes: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa;
# exponent 0 is subnormal (0 and 0.5).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` ``dtype``.
    Chunked over the leading rows so the int64 indices never cost more than a few MB."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                             f"{scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                             f"{tuple(scales.shape)}; expected [..., G, 16] and [..., G]")
    *lead, groups, nbytes = blocks.shape
    flat_blocks = blocks.reshape(-1, groups, nbytes)  # [R, G, 16]
    flat_scales = scales.reshape(-1, groups)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], groups, 2 * nbytes, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat_blocks.shape[0], rows_per_chunk):
        rows = slice(r0, r0 + rows_per_chunk)
        packed = flat_blocks[rows]
        values = torch.empty(*packed.shape[:-1], 2 * nbytes, dtype=torch.float32,
                             device=blocks.device)
        values[..., 0::2] = table[(packed & 0x0F).long()]  # the low nibble is the earlier value
        values[..., 1::2] = table[(packed >> 4).long()]
        exponents = flat_scales[rows].to(torch.int32) - SCALE_BIAS
        # ldexp in float32: 2 ** e is exact for every e in [-127, 127] (subnormal at -127).
        out[rows] = torch.ldexp(values, exponents.unsqueeze(-1).float()).to(dtype)
    return out.view(*lead, groups * 2 * nbytes)
