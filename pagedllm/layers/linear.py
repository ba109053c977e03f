"""Linear layers. No tensor parallelism: plain ``nn.Linear`` plus a fused variant.

``MergedLinear`` stacks several projections of the same input (q/k/v, gate/up) along the output
dimension so one matmul replaces two or three. It remembers the checkpoint name of each part, so
the loader can copy ``q_proj.weight`` into the right rows of ``qkv_proj.weight``.
"""
from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    """``y = x W^T + b``; a separate name so every projection in the models reads the same."""


class MergedLinear(nn.Linear):
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
