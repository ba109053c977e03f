"""Where the cpu_paged kernel reads a bidirectional layer's K/V: a small paged cache of the
step's own rows, written and read by the same kernel call.

The kernel reads keys and values only through block tables. A bidirectional layer keeps no KV in
the engine's block pool (its requests run whole in one step, nothing is read again), so rather
than give the kernel a second, unpaged input path, each step lays its requests out in a scratch
cache of ``sum(cdiv(n_i, block_size))`` blocks, one run of blocks per request, shared by every
such layer of the step (they run one after another, each rewriting every row before reading).
"""
from __future__ import annotations

import torch


class ScratchKV:
    """The step's scratch layout: block tables, slots and sequence lengths for the kernel."""

    def __init__(self, query_start_loc: list[int], block_size: int, device: torch.device) -> None:
        lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
        num_blocks = [-(-n // block_size) for n in lens]
        first = [sum(num_blocks[:i]) for i in range(len(lens))]
        width = max(num_blocks, default=1) or 1
        tables = [list(range(f, f + nb)) + [0] * (width - nb) for f, nb in zip(first, num_blocks)]
        slots = [f * block_size + r for f, n in zip(first, lens) for r in range(n)]
        self.block_size = block_size
        self.num_blocks = max(sum(num_blocks), 1)
        self.block_tables = torch.tensor(tables, dtype=torch.long, device=device)  # [B, width]
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)   # [T]
        self.seq_lens = torch.tensor(lens, dtype=torch.long, device=device)        # [B]
        self._caches: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def cache(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """``[2, num_blocks, block_size, Hkv, D]``, one per shape for the whole step; zeros, so
        that a slot no row writes holds nothing that a zero weight could turn into NaN."""
        key = (num_kv_heads, head_dim, dtype)
        if key not in self._caches:
            self._caches[key] = torch.zeros((2, self.num_blocks, self.block_size, num_kv_heads, head_dim),
                                            dtype=dtype, device=self.block_tables.device)
        return self._caches[key]
