"""The CPU default: a C++ kernel (csrc/paged_attention.cpp) that reads K/V in place from the
paged cache through the block tables, for the whole flat batch in one call per layer: decodes,
prefill chunks over a cached prefix, and fresh prompts alike. No gather, no second copy of the
cache, no per-step masks: causality comes from each request's query and sequence lengths.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.cpu_kernel import load_paged_attention_op

if TYPE_CHECKING:
    from pagedllm.layers.attention.layer import Attention
    from pagedllm.layers.attention_metadata import AttentionMetadata

__all__ = ["CpuPagedBackend", "load_paged_attention_op"]


class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"
    needs_gather_plan = False

    def __init__(self) -> None:
        op = load_paged_attention_op()
        if op is None:
            raise RuntimeError("the cpu_paged attention kernel is not available")
        self._op = op

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        return self._op(q, layer.kv_cache, md.block_tables, md.query_start_loc_tensor,
                        md.seq_lens_tensor, layer.scale)
