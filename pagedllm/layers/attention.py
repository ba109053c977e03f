"""Paged attention in pure torch (runs on CPU, and on CUDA through the same code).

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). Each step a layer first writes the new tokens' K/V at ``slot_mapping``, then attends
by reading the cache through the block tables. Writing first matters: requests scheduled in the
same step may share blocks (identical prompts), and the reader must see the writer's K/V.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention_metadata import AttentionMetadata, DecodeBatch, PrefillChunk
from pagedllm.layers.decode_kv import DecodeKVPlan
from pagedllm.layers.forward_context import get_attn_metadata


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at the flat cache slots ``[T]``."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # slot-indexed view
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


class Attention(nn.Module):
    """Scaled dot-product attention over the paged KV cache of layer ``layer_idx``.

    ``forward(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H * D]`` where rope has already
    been applied. ``kv_cache`` is bound by the runner (see ``bind_kv_caches``).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.num_groups = num_heads // num_kv_heads
        # A plain attribute (not a buffer): the runner owns the cache memory, and model.to() or
        # state_dict() must not copy or save it. Empty until bound.
        self.kv_cache: torch.Tensor = torch.empty(0, device="cpu")

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        md = get_attn_metadata()
        if md is None:
            return self._attend(q, k, v, mask=None).reshape(num_tokens, -1)
        if self.kv_cache.dim() != 5:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound; "
                               "call bind_kv_caches(model, kv_caches) first")
        write_kv(self.kv_cache, k, v, md.slot_mapping)

        decode = md.decode
        if decode is not None and not md.prefills:  # all decodes, in batch order: no shuffling
            return self._decode(q, k, v, decode).view(num_tokens, -1)
        out = q.new_empty(q.shape)  # [T, H, D]
        if decode is not None:
            rows = decode.rows
            out[rows] = self._decode(q[rows], k[rows], v[rows], decode)
        for chunk in md.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk, md)
        return out.view(num_tokens, -1)  # [T, H * D]

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: DecodeBatch) -> torch.Tensor:
        """``q [Bd, H, D]``, ``k/v [Bd, Hkv, D]`` (one token per request) -> ``[Bd, H, D]``."""
        if batch.contiguous is not None:
            return self._decode_contiguous(q, k, v, batch.contiguous)
        num_reqs = q.shape[0]
        num_blocks = batch.block_tables.shape[1]
        ids = batch.block_tables.flatten()
        # index_select copies whole blocks (memcpy); advanced indexing is several times slower.
        # [Bd * nb, block_size, Hkv, D] -> [Bd, Hkv, L, D]
        k_ctx = self.kv_cache[0].index_select(0, ids).view(num_reqs, num_blocks * self.kv_cache.shape[2],
                                                           self.num_kv_heads, self.head_dim)
        v_ctx = self.kv_cache[1].index_select(0, ids).view(k_ctx.shape)
        return self._decode_attend(q, k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), batch.mask)

    def _decode_contiguous(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           plan: DecodeKVPlan) -> torch.Tensor:
        """Attend over the decode store (see decode_kv.py): one row per request, read in place."""
        store = plan.caches[self.layer_idx]  # [2, rows, len, Hkv, D]
        if plan.fill_src is not None:
            # Context the rows lack, from the paged cache (already holding this step's writes).
            paged = self.kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
            flat = store.view(2, -1, self.num_kv_heads, self.head_dim)
            flat.index_copy_(1, plan.fill_dst, paged.index_select(1, plan.fill_src))
        write_kv(store, k, v, plan.write_slots)
        n, length = plan.num_rows, plan.max_len
        keys = store[0, :n, :length].transpose(1, 2)  # [n, Hkv, L, D], a view
        values = store[1, :n, :length].transpose(1, 2)
        if plan.rows is None:  # request i sits in row i
            return self._decode_attend(q, keys, values, plan.mask)
        q_rows = q.new_zeros(n, self.num_heads, self.head_dim).index_copy_(0, plan.rows, q)
        out = self._decode_attend(q_rows, keys, values, plan.mask)
        return out.index_select(0, plan.rows)

    def _decode_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """``q [B, H, D]``, ``k/v [B, Hkv, L, D]`` -> ``[B, H, D]``; one SDPA for the batch."""
        num_reqs = q.shape[0]
        # GQA without copying K/V: the num_groups query heads that share a kv head become that
        # head's "query positions": [B, H, D] -> [B, Hkv, groups, D]. The mask [B, 1, 1, L]
        # broadcasts over both.
        q = q.view(num_reqs, self.num_kv_heads, self.num_groups, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(num_reqs, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk,
                 md: AttentionMetadata) -> torch.Tensor:
        """``q [n, H, D]`` of one request -> ``[n, H, D]``, causal over prefix + chunk."""
        if chunk.num_computed_tokens == 0:
            # No prefix: the chunk's own K/V (just written, bit-identical to the cache) suffice.
            return self._attend(q, k, v, mask=None)
        seq_len = chunk.num_computed_tokens + q.shape[0]
        # [nb, block_size, Hkv, D] -> [seq_len, Hkv, D]
        k_ctx = self.kv_cache[0][chunk.block_ids].flatten(0, 1)[:seq_len]
        v_ctx = self.kv_cache[1][chunk.block_ids].flatten(0, 1)[:seq_len]
        return self._attend(q, k_ctx, v_ctx, mask=chunk.mask)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """One sequence: ``q [n, H, D]``, ``k/v [L, Hkv, D]`` -> ``[n, H, D]``; causal if no mask."""
        # 4-D inputs and enable_gqa: torch's fused CPU kernel (flash) instead of the math path,
        # and no repeat_interleave copies of K/V; query head h reads kv head h // num_groups.
        q_t = q.transpose(0, 1)[None]  # [1, H, n, D]
        k_t = k.transpose(0, 1)[None]  # [1, Hkv, L, D]
        v_t = v.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale, enable_gqa=self.num_groups > 1)
        return out[0].transpose(0, 1)  # [n, H, D]
