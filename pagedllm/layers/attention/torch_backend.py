"""The reference backend, in plain torch (CPU and CUDA): gather each request's blocks, then SDPA.

Readable rather than fast: decode gathers every decoding request's whole context from the paged
cache into a padded ``[B, Hkv, L, D]`` tensor in every layer at every step. It is the numerical
reference the other backends are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backend import (AttentionBackend, AttentionLayer, AttentionMetadata,
                                               DecodeBatch, PrefillChunk)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: ``q [n, H, D]``, ``k/v [L, Hkv, D]`` -> ``[n, H, D]``; causal if no mask."""
    # 4-D inputs and enable_gqa: torch's fused CPU kernel (flash) instead of the math path,
    # and no repeat_interleave copies of K/V; query head h reads kv head h // num_groups.
    q_t = q.transpose(0, 1)[None]  # [1, H, n, D]
    k_t = k.transpose(0, 1)[None]  # [1, Hkv, L, D]
    v_t = v.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)  # [n, H, D]


class TorchBackend(AttentionBackend):
    name = "torch"
    needs_gather_plan = True

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        decode = md.decode
        if decode is not None and not md.prefills:  # all decodes, in batch order: no shuffling
            return self._decode(layer, q, decode)
        out = q.new_empty(q.shape)  # [T, H, D]
        if decode is not None:
            out[decode.rows] = self._decode(layer, q[decode.rows], decode)
        for chunk in md.prefills:
            rows = slice(chunk.token_start, chunk.token_end)
            out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], chunk)
        return out

    def _decode(self, layer: AttentionLayer, q: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """``q [Bd, H, D]`` (one token per request) -> ``[Bd, H, D]``, one SDPA for the batch."""
        cache = layer.kv_cache
        num_reqs, num_blocks = q.shape[0], batch.block_tables.shape[1]
        ids = batch.block_tables.flatten()
        # index_select copies whole blocks (memcpy); advanced indexing is several times slower.
        # [Bd * nb, block_size, Hkv, D] -> [Bd, L, Hkv, D] -> [Bd, Hkv, L, D]
        shape = (num_reqs, num_blocks * cache.shape[2], layer.num_kv_heads, layer.head_dim)
        keys = cache[0].index_select(0, ids).view(shape).transpose(1, 2)
        values = cache[1].index_select(0, ids).view(shape).transpose(1, 2)
        # GQA without copying K/V: the num_groups query heads that share a kv head become that
        # head's "query positions": [Bd, H, D] -> [Bd, Hkv, groups, D]. The mask [Bd, 1, 1, L]
        # broadcasts over both.
        q = q.view(num_reqs, layer.num_kv_heads, layer.num_groups, layer.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask,
                                             scale=layer.scale)
        return out.reshape(num_reqs, layer.num_heads, layer.head_dim)

    def _prefill(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        """``q [n, H, D]`` of one request -> ``[n, H, D]``, causal over prefix + chunk."""
        if chunk.num_computed_tokens == 0:
            # No prefix: the chunk's own K/V (just written, bit-identical to the cache) suffice.
            return attend_causal(q, k, v, layer.scale)
        seq_len = chunk.num_computed_tokens + q.shape[0]
        # [nb, block_size, Hkv, D] -> [seq_len, Hkv, D]
        keys = layer.kv_cache[0][chunk.block_ids].flatten(0, 1)[:seq_len]
        values = layer.kv_cache[1][chunk.block_ids].flatten(0, 1)[:seq_len]
        return attend_causal(q, keys, values, layer.scale, mask=chunk.mask)
