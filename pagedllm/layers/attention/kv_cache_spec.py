"""What one attention layer keeps in the paged KV cache (vLLM's ``KVCacheSpec``): its KV heads
(this rank's), head size, the cache's dtype and its window. The runner
groups layers and sizes every KV tensor from these specs (runner/kv_cache_groups.py), never from
one model-wide geometry, so layers may differ in KV heads or head size. A layer that keeps no
KV (an encoder's: it attends its whole input in one pass) has no spec."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None  # None: full attention

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer."""
        return 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def page_size_bytes(self, block_size: int) -> int:
        """One block of this layer's cache."""
        return block_size * self.bytes_per_token

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """This layer's cache: ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_size]``."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)
