"""RMSNorm, computed in float32 like the reference implementation (matters for bf16/fp16), in
the two flavours checkpoints use: ``weight * x`` (Llama) and ``(1 + weight) * x`` (Gemma)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Used for the hidden state (size ``hidden_size``) and, in Qwen3, per attention head (size
    ``head_dim``): the input may have any number of leading dimensions. ``scale_in_float32``:
    multiply by the weight before casting back (OLMo 2) instead of after (Llama).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; in float32 it gives the very same bits as the steps below.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        # Normalise in float32, then scale and cast in the reference's order, so low precision
        # dtypes round the same way.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight * x32).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)``, all in float32, cast back last (Gemma
    checkpoints store the weight as an offset from 1)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
