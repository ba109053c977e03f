"""Attention metadata, KV cache layout and binding, copy-on-write."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.layers import (
    Attention,
    bind_kv_caches,
    build_attention_metadata,
    copy_blocks,
    get_attn_backend,
    kv_cache_shape,
)


def test_metadata_slots_positions_and_groups():
    # Request 0: 3-token prefill chunk after 2 cached tokens; 1: a decode at position 5;
    # 2: a fresh 2-token prompt. block_size 4.
    md = build_attention_metadata(query_lens=[3, 1, 2], num_computed_tokens=[2, 5, 0],
                                  block_tables=[[7, 3], [1, 9], [4]], block_size=4,
                                  backend=get_attn_backend("torch"))
    assert md.query_start_loc == [0, 3, 4, 6]
    assert md.seq_lens == [5, 6, 2]
    assert md.positions.tolist() == [2, 3, 4, 5, 0, 1]
    # position 2, 3 -> block 7; position 4 -> block 3 offset 0; decode pos 5 -> block 9 offset 1
    assert md.slot_mapping.tolist() == [30, 31, 12, 37, 16, 17]
    assert md.block_tables.tolist() == [[7, 3], [1, 9], [4, 0]]
    assert md.decode.token_indices.tolist() == [3]
    assert md.decode.block_tables.tolist() == [[1, 9]]
    assert md.decode.mask.shape == (1, 1, 1, 8)
    assert md.decode.mask.flatten().tolist() == [True] * 6 + [False] * 2
    first, second = md.prefills
    assert (first.token_start, first.token_end, first.num_computed_tokens) == (0, 3, 2)
    assert first.block_ids.tolist() == [7, 3]
    # query at position 2 sees keys 0..2; at 4 sees 0..4
    assert first.mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert (second.token_start, second.num_computed_tokens, second.mask) == (4, 0, None)
    assert md.query_start_loc_tensor.tolist() == [0, 3, 4, 6] and md.seq_lens_tensor.tolist() == [5, 6, 2]


def test_metadata_for_an_in_place_backend_has_no_gather_plan():
    backend = get_attn_backend("cpu_paged")
    md = build_attention_metadata([3, 1], [2, 5], [[7, 3], [1, 9]], block_size=4, backend=backend)
    assert md.backend is backend and md.decode is None and md.prefills == []


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([5], [0], [[1]], block_size=4)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Attention(4, 2, 8, scale=1.0, layer_idx=1)
        self.b = Attention(4, 2, 8, scale=1.0, layer_idx=0)


def test_bind_kv_caches_by_layer_index():
    model = TwoLayers()
    caches = [torch.zeros(kv_cache_shape(6, 4, 2, 8)) for _ in range(2)]
    assert caches[0].shape == (2, 6, 4, 2, 8)
    bind_kv_caches(model, caches)
    assert model.b.kv_cache is caches[0] and model.a.kv_cache is caches[1]
    with pytest.raises(ValueError, match="2 attention layers"):
        bind_kv_caches(model, caches[:1])
    with pytest.raises(ValueError, match="cache shape"):
        bind_kv_caches(model, [torch.zeros(kv_cache_shape(6, 4, 3, 8))] * 2)


def test_kv_cache_spec_and_a_shared_tensor_viewed_in_each_layers_shape():
    wide, narrow = Attention(4, 2, 8, 1.0, layer_idx=0), Attention(4, 1, 16, 1.0, layer_idx=1, sliding_window=8)
    spec = narrow.kv_cache_spec(torch.bfloat16)
    assert (spec.num_kv_heads, spec.head_size, spec.dtype, spec.sliding_window) == (1, 16, torch.bfloat16, 8)
    assert spec.bytes_per_token == 2 * 16 * 2 and spec.page_size_bytes(4) == 4 * 64
    assert spec.shape(6, 4) == (2, 6, 4, 1, 16)
    cache = torch.zeros(kv_cache_shape(6, 4, 2, 8))
    bind_kv_caches([wide, narrow], [cache], [(0, 0), (1, 0)])  # two groups, one tensor
    assert wide.kv_cache is cache and narrow.kv_cache.shape == (2, 6, 4, 1, 16)
    assert narrow.kv_cache_group == 1 and narrow.kv_cache.data_ptr() == cache.data_ptr()
    narrow.kv_cache[1, 3, 2] = 1.0  # block 3 of the narrow layer is block 3 of the tensor
    assert cache[1, 3, 2].sum() == 16 and cache.sum() == 16
    with pytest.raises(ValueError, match="cache shape"):  # fewer elements per block: no view
        bind_kv_caches([Attention(4, 1, 8, 1.0, layer_idx=0)], [cache], [(0, 0)])


def test_copy_blocks_copies_exactly_the_listed_blocks():
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(kv_cache_shape(8, 4, 2, 8), generator=gen) for _ in range(3)]
    before = [c.clone() for c in caches]
    # 4 -> 7 and 3 -> 4 in one call: every source is read before any destination is written.
    copies = [(1, 5), (3, 4), (4, 7)]
    copy_blocks(caches, copies)
    for cache, old in zip(caches, before):
        for src, dst in copies:
            assert torch.equal(cache[:, dst], old[:, src])
        untouched = [b for b in range(8) if b not in (5, 4, 7)]
        assert torch.equal(cache[:, untouched], old[:, untouched])
    copy_blocks(caches, [])  # no-op
