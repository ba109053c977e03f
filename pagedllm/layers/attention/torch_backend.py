"""The reference backend, in plain torch (CPU and CUDA): gather each request's blocks, then SDPA.

Readable rather than fast: decode gathers every decoding request's whole context from the paged
cache into a padded ``[B, Hkv, L, D]`` tensor in every layer at every step (widened to the
model's dtype when the cache is narrower). It is the numerical reference the other backends are
tested against.

A layer with a sliding window masks the keys before it (SDPA with a boolean mask); one with
logit soft-capping or attention sinks, which SDPA cannot express, takes the same steps written
out (``_attend_math``: scores, cap, mask, sink column, softmax, values), in float32.

A bidirectional layer (``causal`` False: an encoder's) keeps no KV: each request attends to its
own rows of the step, which is always its whole input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backend import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    DecodeBatch,
    PrefillChunk,
    is_plain,
)
from pagedllm.layers.attention.kv_cache_dtype import as_stored, read_blocks, storage, to_cache_dtype


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """One sequence: ``q [n, H, D]``, ``k/v [L, Hkv, D]`` -> ``[n, H, D]``; without a mask,
    causal, or every key for every query when ``causal`` is False."""
    # 4-D inputs and enable_gqa: torch's fused CPU kernel (flash) instead of the math path,
    # and no repeat_interleave copies of K/V; query head h reads kv head h // num_groups.
    q_t = q.transpose(0, 1)[None]  # [1, H, n, D]
    k_t = k.transpose(0, 1)[None]  # [1, Hkv, L, D]
    v_t = v.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, is_causal=mask is None and causal,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)  # [n, H, D]


def causal_mask(query_pos: torch.Tensor, num_keys: int, window: int | None,
                causal: bool = True) -> torch.Tensor:
    """``[n, num_keys]`` bool: True where the query at ``query_pos[i]`` sees key position j,
    i.e. ``j <= p`` and, with a window, ``j > p - window`` (transformers'
    sliding_window_overlay); not causal: any j, or with a window ``|j - p| < window``
    (Gemma 3's bidirectional overlay)."""
    key_pos = torch.arange(num_keys, device=query_pos.device)[None, :]  # [1, L]
    if not causal:
        if window is None:
            return torch.ones(len(query_pos), num_keys, dtype=torch.bool, device=query_pos.device)
        return (key_pos - query_pos[:, None]).abs() < window
    mask = key_pos <= query_pos[:, None]
    if window is not None:
        mask &= key_pos > query_pos[:, None] - window
    return mask


def attend_sequence(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """One request's query rows ``q [n, H, D]``, the last n of the positions of ``k/v [L, Hkv,
    D]``, -> ``[n, H, D]`` with the layer's features. ``mask``: the plain causal mask ``[n, L]``
    when the caller has one (None: causal over the rows' own positions, or all of them)."""
    if is_plain(layer):
        return attend_causal(q, k, v, layer.scale, mask, layer.causal)
    n, num_keys = q.shape[0], k.shape[0]
    mask = causal_mask(torch.arange(num_keys - n, num_keys, device=q.device), num_keys,
                       layer.sliding_window, layer.causal)
    if layer.logits_soft_cap is None and layer.sinks is None:
        return attend_causal(q, k, v, layer.scale, mask)
    # Query heads grouped by their kv head: [n, H, D] -> [Hkv, groups, n, D]; the K/V of a kv
    # head broadcast over its groups: [L, Hkv, D] -> [Hkv, 1, L, D].
    q_g = q.transpose(0, 1).reshape(layer.num_kv_heads, layer.num_groups, n, layer.head_dim)
    k_g, v_g = k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None]
    sinks = None if layer.sinks is None else layer.sinks.view(layer.num_kv_heads, layer.num_groups, 1, 1)
    out = _attend_math(layer, q_g, k_g, v_g, mask, sinks)  # [Hkv, groups, n, D]
    return out.reshape(layer.num_heads, n, layer.head_dim).transpose(0, 1)


def _attend_math(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``q [..., R, D]`` against ``k/v [..., L, D]`` (batch dims broadcast), ``mask``
    broadcastable to ``[..., R, L]``, ``sinks`` to ``[..., R, 1]``: transformers' eager
    attention (gemma2's soft cap, gpt_oss's sinks), in float32, -> ``[..., R, D]``."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scale  # [..., R, L]
    if layer.logits_soft_cap is not None:
        cap = layer.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink is one more column of the softmax, dropped after it
        sink_col = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def attend_each_request(layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        query_start_loc: list[int]) -> torch.Tensor:
    """A bidirectional layer: each request's rows attend to its own rows, ``[T, H, D]``."""
    out = q.new_empty(q.shape)
    for a, b in zip(query_start_loc[:-1], query_start_loc[1:]):
        out[a:b] = attend_sequence(layer, q[a:b], k[a:b], v[a:b])
    return out


class TorchBackend(AttentionBackend):
    name = "torch"
    needs_gather_plan = True

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        if not layer.causal:
            return attend_each_request(layer, q, k, v, md.query_start_loc)
        self.write_kv(layer, k, v, md)
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

    @staticmethod
    def write_kv(layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor,
                 md: AttentionMetadata) -> None:
        """Store this step's ``k/v [T, Hkv, D]`` in ``layer.kv_cache`` at the flat slots
        ``md.slot_mapping``: torch's index_copy_ into a slot-indexed view, on any device, in the
        cache's dtype (kv_cache_dtype.py)."""
        cache = layer.kv_cache
        _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        flat = storage(cache).view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, md.slot_mapping, storage(to_cache_dtype(k, cache.dtype)))
        flat[1].index_copy_(0, md.slot_mapping, storage(to_cache_dtype(v, cache.dtype)))

    def _decode(self, layer: AttentionLayer, q: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """``q [Bd, H, D]`` (one token per request) -> ``[Bd, H, D]``, one SDPA for the batch."""
        cache = layer.kv_cache
        num_reqs, num_blocks = q.shape[0], batch.block_tables.shape[1]
        ids = batch.block_tables.flatten()
        # index_select copies whole blocks (memcpy); advanced indexing is several times slower.
        # [Bd * nb, block_size, Hkv, D] -> [Bd, L, Hkv, D] -> [Bd, Hkv, L, D]
        shape = (num_reqs, num_blocks * cache.shape[2], layer.num_kv_heads, layer.head_dim)
        # A narrower cache dtype is widened to the query's here.
        keys = read_blocks(cache[0], ids, q.dtype).view(shape).transpose(1, 2)
        values = read_blocks(cache[1], ids, q.dtype).view(shape).transpose(1, 2)
        # GQA without copying K/V: the num_groups query heads that share a kv head become that
        # head's "query positions": [Bd, H, D] -> [Bd, Hkv, groups, D]. The mask [Bd, 1, 1, L]
        # broadcasts over both.
        q = q.view(num_reqs, layer.num_kv_heads, layer.num_groups, layer.head_dim)
        mask = batch.mask
        if layer.sliding_window is not None:  # the query sits at position seq_len - 1
            key_pos = torch.arange(shape[1], device=q.device)
            first = batch.seq_lens - layer.sliding_window  # [Bd]: the first position it sees
            mask = mask & (key_pos[None, :] >= first[:, None])[:, None, None, :]
        if layer.logits_soft_cap is None and layer.sinks is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 scale=layer.scale)
        else:
            sinks = None if layer.sinks is None else layer.sinks.view(layer.num_kv_heads,
                                                                      layer.num_groups, 1)
            out = _attend_math(layer, q, keys, values, mask, sinks)  # [Bd, Hkv, groups, D]
        return out.reshape(num_reqs, layer.num_heads, layer.head_dim)

    def _prefill(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        """``q [n, H, D]`` of one request -> ``[n, H, D]``, causal over prefix + chunk."""
        cache = layer.kv_cache
        if chunk.num_computed_tokens == 0:
            # No prefix: the chunk's own K/V (just written; as_stored rounds them as the cache
            # did when its dtype is narrower) suffice.
            return attend_sequence(layer, q, as_stored(k, cache.dtype), as_stored(v, cache.dtype))
        seq_len = chunk.num_computed_tokens + q.shape[0]
        # [nb, block_size, Hkv, D] -> [seq_len, Hkv, D]
        keys = read_blocks(cache[0], chunk.block_ids, q.dtype).flatten(0, 1)[:seq_len]
        values = read_blocks(cache[1], chunk.block_ids, q.dtype).flatten(0, 1)[:seq_len]
        return attend_sequence(layer, q, keys, values, mask=chunk.mask)
