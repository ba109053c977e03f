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
from pagedllm.layers.forward_context import get_attn_metadata


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at the flat cache slots ``[T]``."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # slot-indexed view
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _repeat_kv(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[..., kv_heads, L, D] -> [..., kv_heads * num_groups, L, D]``: query head h reads kv head
    h // num_groups (the layout of HF checkpoints)."""
    if num_groups == 1:
        return x
    return x.repeat_interleave(num_groups, dim=-3)


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

        out = q.new_empty(q.shape)  # [T, H, D]
        if md.decode is not None:
            rows = md.decode.token_indices
            out[rows] = self._decode(q[rows], md.decode)
        for chunk in md.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], chunk, md)
        return out.view(num_tokens, -1)  # [T, H * D]

    def _decode(self, q: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """``q [Bd, H, D]`` (one token per request) -> ``[Bd, H, D]``; one SDPA for the batch."""
        num_reqs = q.shape[0]
        keys, values = self.kv_cache[0], self.kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        # Gather whole blocks: [Bd, nb, block_size, Hkv, D] -> [Bd, Hkv, L, D]
        k = keys[batch.block_tables].flatten(1, 2).transpose(1, 2)
        v = values[batch.block_tables].flatten(1, 2).transpose(1, 2)
        # GQA without copying K/V: the num_groups query heads that share a kv head become that
        # head's "query positions": [Bd, H, D] -> [Bd, Hkv, groups, D]. The mask [Bd, 1, 1, L]
        # broadcasts over both.
        q = q.view(num_reqs, self.num_kv_heads, self.num_groups, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=self.scale)
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
        q_t = q.transpose(0, 1)  # [H, n, D]
        k_t = _repeat_kv(k.transpose(0, 1), self.num_groups)  # [H, L, D]
        v_t = _repeat_kv(v.transpose(0, 1), self.num_groups)
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale)
        return out.transpose(0, 1)  # [n, H, D]
