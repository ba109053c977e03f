"""Linear layers. No tensor parallelism: plain ``nn.Linear`` plus a fused variant.

``MergedLinear`` stacks several projections of the same input (q/k/v, gate/up) along the output
dimension so one matmul replaces two or three. It remembers the checkpoint name of each part, so
the loader can copy ``q_proj.weight`` into the right rows of ``qkv_proj.weight``.

On CPU the runner may call ``prepack_linear_weights(model)`` once after loading: every linear
layer then also holds its weight in oneDNN's blocked layout. A plain ``F.linear`` (MKL sgemm)
re-packs the whole weight on every call, which dominates at decode batch sizes (one to a few
dozen rows): prepacked, the model's matmuls take 15-40% less time there and the same at prefill
sizes, with the same float32 results up to summation order. (MKL's own packed sgemm was faster in
isolation but 5-10% slower inside the engine, on the benchmark model.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``, through the prepacked weight when there is one (``x`` is 2-D)."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``y = x W^T + b``; a separate name so every projection in the models reads the same."""

    # A plain attribute, not a buffer: a derived copy that state_dict() and .to() must ignore.
    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedLinear(Linear):
    """Projections ``shard_names[i]`` (output size ``output_sizes[i]``) stacked in one weight."""

    def __init__(self, in_features: int, output_sizes: list[int], shard_names: list[str],
                 bias: bool) -> None:
        if len(output_sizes) != len(shard_names):
            raise ValueError("MergedLinear needs one name per output size")
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of ``param`` (weight or bias) that belong to projection ``shard_id`` (a view)."""
        start = sum(self.output_sizes[:shard_id])
        return param.narrow(0, start, self.output_sizes[shard_id])


def _prepack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's blocked copy of ``weight`` [out, in], or None if this torch build cannot make one
    or its result differs from ``F.linear`` (the ops are private to torch: check, never trust)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    gen = torch.Generator().manual_seed(0)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        for rows in (1, 5, 40):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            if not torch.allclose(linear(x, weight, bias, packed), F.linear(x, weight, bias),
                                  rtol=1e-4, atol=1e-5):
                return None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed


@torch.inference_mode()
def prepack_linear_weights(model: nn.Module) -> int:
    """Give every module with a ``packed_weight`` slot (Linear, MergedLinear, LMHead) its
    prepacked weight; returns how many were packed. Weights must not change afterwards.

    The packed copy doubles the memory of the linear weights, so the runner only calls this on
    CPU when the model is small next to RAM."""
    count = 0
    for module in model.modules():
        if hasattr(type(module), "packed_weight"):
            module.packed_weight = _prepack(module.weight, getattr(module, "bias", None))
            count += module.packed_weight is not None
    return count
