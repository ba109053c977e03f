"""KV cache groups: which layers share a block table, and which KV tensor each layer uses.

Layers are grouped by attention type: full attention, or a sliding window of w tokens (a window
that covers ``max_model_len`` is full attention: it never leaves anything out). Each group gets
its own block table per request from one BlockPool (core/kv_cache_manager.py), so a block id of
the pool must cost the same bytes whatever group holds it. As in vLLM's hybrid allocator, the
groups are made the same size: with several types, each type's layers are cut into groups of
``group_size`` = the smallest type's layer count (the last one of a type may be shorter: it
wastes the missing layers' share of its blocks), and group g's i-th layer uses KV tensor i. So
there are ``group_size`` tensors of ``num_blocks`` blocks each, and block b of tensor i holds
the KV of whichever group owns block b. One type (every model without windows, or a Mistral
whose window covers max_model_len) is one group whose i-th layer uses tensor i: the plain cache.

Plain Python (no torch): the FakeRunner and the tests use it as well.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layer_indices: tuple[int, ...]  # positions in the model's attention-layer order


def group_layers(sliding_windows: Sequence[int | None], max_model_len: int) -> list[KVCacheGroup]:
    """Group attention layers (given as each layer's window, in layer order); full attention
    first, then windows from the narrowest."""
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(sliding_windows):
        by_type.setdefault(None if w is None or w >= max_model_len else w, []).append(i)
    if not by_type:
        raise ValueError("the model has no attention layers")
    size = min(len(layers) for layers in by_type.values())
    groups = []
    for w in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[w]
        step = len(layers) if len(by_type) == 1 else size
        groups.extend(KVCacheGroup(w, tuple(layers[j:j + step])) for j in range(0, len(layers), step))
    return groups


def num_kv_tensors(groups: Sequence[KVCacheGroup]) -> int:
    """How many per-layer KV tensors the groups share (the largest group's layer count)."""
    return max(len(g.layer_indices) for g in groups)


def layer_placement(groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """Per attention layer (in layer order): (its group, its KV tensor)."""
    placement: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for i, layer in enumerate(group.layer_indices):
            placement[layer] = (g, i)
    return [placement[layer] for layer in sorted(placement)]
