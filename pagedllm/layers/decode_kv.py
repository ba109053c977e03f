"""A contiguous copy of the decoding requests' KV, so decode attention reads it in place.

Paged decode attention in pure torch must gather every request's blocks into a padded
``[B, L, Hkv, D]`` tensor, in every layer, at every step: a copy of the whole context that costs
more than the attention itself. Instead, the runner keeps one row per decoding request in a dense
``[2, rows, max_len, Hkv, D]`` tensor per layer (the layout of a paged cache with one "block" per
request, so ``write_kv`` writes into it too). Each step a layer writes the new token's K/V into
both caches and attends over ``store[:, :num_rows, :max_len]``: a view, no gather.

The paged cache stays the source of truth (prefix sharing, copy-on-write, preemption). A row
holds a valid prefix of its request's context (``valid_len`` positions); whatever it lacks (the
prompt, at the first decode; positions written by prefill-shaped steps such as draft verification)
is copied from the paged cache in the step that needs it, after that layer's own paged write, so
blocks shared with a request prefilled in the same step are read after they are written.

Rows stay compact: a finished request's row is filled with the last row. Memory is bounded by
``max_tokens`` (rows x row length, at most the paged cache's tokens); a step that would need
more uses the gather path instead. The tensors are allocated empty and zeroed only as far as
steps read them (see ``_ensure_clean``): zeroing the whole capacity at once cost a few percent of
a throughput run, for memory most workloads never touch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodeKVPlan:
    """What every layer does with the store in one step (rows are in ``DecodeBatch`` order)."""

    caches: list[torch.Tensor]     # per layer [2, row_capacity, len_capacity, Hkv, D]
    num_rows: int                  # rows 0 .. num_rows - 1 take part in the attention
    max_len: int                   # keys 0 .. max_len - 1 (every row's context fits)
    rows: torch.Tensor | None      # [Bd] long: each decode request's row; None: rows 0..Bd-1
    write_slots: torch.Tensor      # [Bd] long: row * len_capacity + position of the new token
    fill_src: torch.Tensor | None  # [F] long: paged slots to copy ...
    fill_dst: torch.Tensor | None  # [F] long: ... into these store slots
    mask: torch.Tensor             # [num_rows, 1, 1, max_len] float: 0 = a key of that row, else -inf


class DecodeKVStore:
    """Owned by the runner: rows per request, capacity, and the per-step plan."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_tokens = max_tokens
        self.caches: list[torch.Tensor] = []
        self.row_capacity = self.len_capacity = 0
        # Every position in rows [0, clean_rows) x [0, clean_len) holds a finite value (zero or
        # KV, possibly stale): attention may read it, masked, and 0 * NaN would still be NaN.
        self.clean_rows = self.clean_len = 0
        self.row_of: dict[str, int] = {}
        self.owners: list[str] = []          # owners[row] = request id
        self.valid_len: dict[str, int] = {}  # leading positions the row holds correctly

    def invalidate(self, req_id: str) -> None:
        """The request's context changed under it (a new block table): refill from scratch."""
        if req_id in self.valid_len:
            self.valid_len[req_id] = 0

    def release(self, req_id: str) -> None:
        """Free the request's row; the last row moves into it to keep rows 0..n-1 in use."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.valid_len.pop(req_id)
        last = len(self.owners) - 1
        if row != last:
            mover = self.owners[last]
            n = self.valid_len[mover]
            for cache in self.caches:
                cache[:, row, :n] = cache[:, last, :n]
            self.owners[row] = mover
            self.row_of[mover] = row
        self.owners.pop()
        # The tensors stay allocated when idle, like the paged cache: they never hold more
        # tokens than it does, and regrowing them costs a copy and fresh page faults.

    def plan(self, reqs: list[tuple[str, int, list[int]]], block_size: int) -> DecodeKVPlan | None:
        """``reqs``: (request id, position of its new token, block table) per decode request.
        Returns None (use the gather path) when the rows would exceed ``max_tokens``."""
        new = [rid for rid, _, _ in reqs if rid not in self.row_of]
        num_rows = len(self.owners) + len(new)
        max_len = max(pos for _, pos, _ in reqs) + 1
        if not self._reserve(num_rows, max_len):
            return None
        self._ensure_clean(num_rows, max_len)
        for rid in new:
            self.row_of[rid] = len(self.owners)
            self.owners.append(rid)
            self.valid_len[rid] = 0

        cap = self.len_capacity
        rows, write_slots, fill_src, fill_dst = [], [], [], []
        seq_lens = [1] * num_rows  # rows without a token this step attend to position 0 only
        for rid, pos, table in reqs:
            row = self.row_of[rid]
            rows.append(row)
            write_slots.append(row * cap + pos)
            seq_lens[row] = pos + 1
            # Positions from valid_len on come from the paged cache. After a rollback (rejected
            # drafts) pos < valid_len: nothing to fill, and valid_len drops to pos + 1 below.
            for p in range(self.valid_len[rid], pos):
                fill_src.append(table[p // block_size] * block_size + p % block_size)
                fill_dst.append(row * cap + p)
            self.valid_len[rid] = pos + 1

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        identity = num_rows == len(rows) and rows == list(range(num_rows))
        # Additive float mask, built once per step: SDPA would convert a bool mask in every layer.
        beyond = torch.arange(max_len)[None, :] >= torch.tensor(seq_lens)[:, None]  # [rows, max_len]
        mask = torch.zeros(beyond.shape, dtype=self.dtype).masked_fill_(beyond, float("-inf"))
        return DecodeKVPlan(
            caches=self.caches, num_rows=num_rows, max_len=max_len,
            rows=None if identity else longs(rows), write_slots=longs(write_slots),
            fill_src=longs(fill_src) if fill_src else None,
            fill_dst=longs(fill_dst) if fill_dst else None,
            mask=mask[:, None, None, :].to(self.device))

    def _reserve(self, num_rows: int, max_len: int) -> bool:
        """Grow the tensors (keeping their content) so they hold ``num_rows`` x ``max_len``."""
        if num_rows <= self.row_capacity and max_len <= self.len_capacity:
            return True
        need_rows, need_len = max(num_rows, self.row_capacity), max(max_len, self.len_capacity)
        # Grow to twice the need (rows at least 16, lengths in multiples of 256): growing copies
        # everything and touches fresh pages, so it should happen a few times per run, not per step.
        rows, length = need_rows, need_len
        if num_rows > self.row_capacity:
            rows = max(2 * num_rows, 16)
        if max_len > self.len_capacity:
            length = -(-2 * max_len // 256) * 256
        if rows * length > self.max_tokens:  # near the bound: just what this step needs
            rows, length = need_rows, need_len
            if rows * length > self.max_tokens:
                return False
        shape = (2, rows, length, self.num_kv_heads, self.head_dim)
        clean_rows, clean_len = self.clean_rows, self.clean_len
        caches = []
        for i in range(self.num_layers):
            cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            if clean_rows:  # only the clean part can hold anything worth keeping
                cache[:, :clean_rows, :clean_len] = self.caches[i][:, :clean_rows, :clean_len]
            caches.append(cache)
        self.caches, self.row_capacity, self.len_capacity = caches, rows, length
        return True

    def _ensure_clean(self, num_rows: int, max_len: int) -> None:
        """Zero the fresh memory this step is about to read, in chunks (16 rows, 256 positions)
        so that it happens now and then, not every step."""
        if num_rows <= self.clean_rows and max_len <= self.clean_len:
            return
        rows = min(self.row_capacity, max(self.clean_rows, -(-num_rows // 16) * 16))
        length = min(self.len_capacity, max(self.clean_len, -(-max_len // 256) * 256))
        for cache in self.caches:
            cache[:, self.clean_rows:rows, :length].zero_()
            cache[:, :self.clean_rows, self.clean_len:length].zero_()
        self.clean_rows, self.clean_len = rows, length
