"""KV cache groups: which layers share a block table, and which KV tensor each layer uses.

Layers are grouped by attention type: full attention, or a sliding window of w tokens (a window
that covers ``max_model_len`` is full attention: it never leaves anything out). Each group gets
its own block table per request from one BlockPool (core/kv_cache_manager.py). As in vLLM's
hybrid allocator, the groups are made the same size: with several types, each type's layers are
cut into groups of ``group_size`` = the smallest type's layer count (the last one of a type may
be shorter: it wastes the missing layers' share of its blocks). Layers of one type that differ in
KV heads or head size stay in one group (a block table is the same for them, as in vLLM's
``UniformTypeKVCacheSpecs``): only the tensors' sizes differ.

The tensors are planned from each layer's KV bytes per token (its spec, layers/attention/
kv_cache_spec.py). A block id indexes every tensor; block b of a tensor holds the KV of whichever
group owns block b, so a tensor is shared by at most one layer of each group, and only by layers
whose blocks have the same bytes (a layer with other heads x head size views it in its own
shape): group g's i-th layer of a given size uses that size's i-th tensor. One block id costs a
block in every tensor. A model with one size is the plain scheme (group g's i-th layer uses
tensor i); one type (every model without windows) gives every layer its own tensor.

Plain Python (no torch): the FakeRunner and the tests use it as well.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layer_indices: tuple[int, ...]  # positions in the model's KV-layer order


@dataclass(frozen=True, slots=True)
class KVCacheTensor:
    bytes_per_token: int  # K and V of one token, the same in every layer stored here
    layer_indices: tuple[int, ...]  # one layer of each group at most; the first one's shape is the tensor's

    def page_size_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


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


def plan_kv_tensors(groups: Sequence[KVCacheGroup],
                    bytes_per_token: Sequence[int]) -> list[KVCacheTensor]:
    """The KV tensors for ``groups``, given each layer's KV bytes per token (in layer order):
    for each size, as many tensors as the group with the most layers of that size has; group
    g's i-th layer of a size uses that size's i-th tensor."""
    by_size: dict[int, list[list[int]]] = {}  # size -> its tensors' layers
    for group in groups:
        seen: dict[int, int] = {}  # size -> this group's layers of that size so far
        for layer in group.layer_indices:
            size = bytes_per_token[layer]
            i = seen[size] = seen.get(size, -1) + 1
            tensors = by_size.setdefault(size, [])
            if i == len(tensors):
                tensors.append([])
            tensors[i].append(layer)
    planned = [KVCacheTensor(size, tuple(layers)) for size, tensors in by_size.items()
               for layers in tensors]
    return sorted(planned, key=lambda t: min(t.layer_indices))  # in layer order


def layer_placement(groups: Sequence[KVCacheGroup],
                    tensors: Sequence[KVCacheTensor]) -> list[tuple[int, int]]:
    """Per KV layer (in layer order): (its group, its KV tensor)."""
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layer_indices}
    tensor_of = {layer: t for t, tensor in enumerate(tensors) for layer in tensor.layer_indices}
    return [(group_of[layer], tensor_of[layer]) for layer in sorted(group_of)]
