"""Gated activations: the MLP computes ``act(gate) * up`` from one fused gate/up projection."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import UnsupportedModelError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# The mixture-of-experts kernel's names for them (csrc/fused_moe.cpp: the same ATen functions).
_KERNEL_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedActivation(nn.Module):
    """``[..., 2 * I]`` (gate then up, as the fused projection stacks them) -> ``[..., I]``."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}",
                "hidden_act")
        self.hidden_act = hidden_act
        self._act = _ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up

    def kernel_activation(self) -> tuple[str, float, float]:
        """How csrc/fused_moe.cpp names this activation (with its unused alpha and limit)."""
        return _KERNEL_NAMES[self.hidden_act], 0.0, 0.0

    def extra_repr(self) -> str:
        return self.hidden_act
