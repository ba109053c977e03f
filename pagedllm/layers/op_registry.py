"""Layers a compiled graph calls by number.

A custom op that stands for a layer inside a torch.compile graph (attention) cannot take the
layer itself: its state (a KV cache bound later, the step's metadata) must stay out of the
graph. The graph holds an int constant instead, and the op looks the layer up
here. Weak references, so a dropped model's layers go away; ids are unique per instance, not per
layer index, since a process may hold several models.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class LayerRegistry(weakref.WeakValueDictionary, Generic[T]):
    """id -> layer, weakly; ``register`` hands out the next id."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count()

    def register(self, layer: T) -> int:
        layer_id = next(self._ids)
        self[layer_id] = layer
        return layer_id
