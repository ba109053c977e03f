"""KV cache helpers the model runner calls: layout, binding to layers, copy-on-write."""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.layers.attention import Attention, KVCacheSpec
from pagedllm.layers.attention.kv_cache_dtype import storage
from pagedllm.layers.attention.unified_attention import register_layer


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int, int]:
    """Shape of one layer's cache: keys at index 0, values at index 1."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. Zeros, not empty: masked-out slots are multiplied by zero
    weights, and 0 * NaN = NaN. On CPU the zeros are an anonymous private mapping, which the OS
    fills with zero pages as they are first written: the whole budget is reserved (its blocks
    are the scheduler's), but a page of RAM is committed only once a block on it holds KV, and
    the block pool hands out recently freed blocks first (core/block_pool.py). Elsewhere
    ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    # The tensor keeps the mapping alive; the mapping is unmapped when the tensor is freed.
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, ordered by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)),
                  key=lambda m: m.layer_idx)


def kv_cache_layers(model: nn.Module, kv_cache_dtype: torch.dtype) -> list[tuple[Attention, KVCacheSpec]]:
    """The attention layers that keep KV, in layer order, each with its spec."""
    specs = ((layer, layer.kv_cache_spec(kv_cache_dtype)) for layer in attention_layers(model))
    return [(layer, spec) for layer, spec in specs if spec is not None]


def bind_kv_caches(model: nn.Module | Sequence[Attention], kv_caches: list[torch.Tensor],
                   placement: list[tuple[int, int]] | None = None) -> None:
    """Give attention layer i (of ``model``'s, or of the list given) the cache ``kv_caches[i]``
    (shape from ``kv_cache_shape``), or, with KV cache groups, ``placement[i] = (group, tensor)``:
    the layer reads its group's block tables and stores into ``kv_caches[tensor]``, which layers
    of other groups share (a block belongs to one group at a time; runner/kv_cache_groups.py).
    A layer whose heads x head size differ from the tensor's, with as many elements per block,
    gets the tensor viewed in its own shape."""
    layers = attention_layers(model) if isinstance(model, nn.Module) else list(model)
    if placement is None:
        if len(layers) != len(kv_caches):
            raise ValueError(f"model has {len(layers)} attention layers, got {len(kv_caches)} caches")
        placement = [(0, i) for i in range(len(layers))]
    if len(placement) != len(layers):
        raise ValueError(f"model has {len(layers)} attention layers, got {len(placement)} placements")
    for layer, (group, index) in zip(layers, placement):
        cache = kv_caches[index]
        heads, head_dim = layer.num_kv_heads, layer.head_dim
        if (cache.dim() != 5 or cache.shape[0] != 2
                or cache.shape[3] * cache.shape[4] != heads * head_dim):
            raise ValueError(f"layer {layer.layer_idx}: cache shape {tuple(cache.shape)} is not "
                             f"[2, blocks, block_size, {heads}, {head_dim}]")
        if tuple(cache.shape[3:]) != (heads, head_dim):
            cache = cache.view(*cache.shape[:3], heads, head_dim)
        layer.kv_cache = cache
        layer.kv_cache_group = group
        register_layer(layer)


def copy_blocks(kv_caches: list[torch.Tensor], block_copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy block ``src`` to block ``dst`` for every pair, in every layer."""
    if not block_copies:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in block_copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in block_copies], dtype=torch.long, device=device)
    for cache in kv_caches:
        # Advanced indexing reads every src block before any dst is written; bytes for fp8.
        data = storage(cache)
        data[:, dst] = data[:, src]
