"""RMSNorm, computed in float32 like the reference implementation (matters for bf16/fp16)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Used for the hidden state (size ``hidden_size``) and, in Qwen3, per attention head (size
    ``head_dim``): the input may have any number of leading dimensions.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; in float32 it gives the very same bits as the steps below.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        # Normalise in float32, cast back, then scale: the same order as transformers, so low
        # precision dtypes round the same way.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
