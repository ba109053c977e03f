"""Layers a compiled graph calls by number.

A custom op that stands for a layer inside a torch.compile graph (attention) cannot take the
layer itself: its state (a KV cache bound later, the step's metadata) must stay out of the
graph. The graph holds an int constant instead, and the op looks the layer up
here. Weak references, so a dropped model's layers go away; ids are unique per instance, not per
layer index, since a process may hold several models.

``layer_op`` defines such an op. It registers the Python function as the op's one kernel straight
with the dispatcher rather than through ``torch.library.custom_op``, whose Python wrappers
(autograd, an aliasing check of the output) cost several times the call, once per layer per
decode step (docs/cpu_kernels.md#elsewhere-in-the-engine).
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
F = TypeVar("F", bound=Callable)

# The C++ extension's ops live in the same namespace (TORCH_LIBRARY_FRAGMENT in csrc/).
_library = torch.library.Library("pagedllm", "FRAGMENT")


def layer_op(name: str) -> Callable[[F], F]:
    """Decorator: ``pagedllm::<name>``, its schema read from the function's annotations (as
    ``custom_op`` reads it; no argument is mutated), the function its kernel on every device.
    Inference only: it has no autograd formula. Register its fake with
    ``torch.library.register_fake("pagedllm::<name>")``."""
    def define(fn: F) -> F:
        _library.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _library.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return define


class LayerRegistry(weakref.WeakValueDictionary, Generic[T]):
    """id -> layer, weakly; ``register`` hands out the next id."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count()

    def register(self, layer: T) -> int:
        layer_id = next(self._ids)
        self[layer_id] = layer
        return layer_id
