"""The compiled graph's attention call: ``pagedllm::unified_attention`` (kernels/csrc/unified_attention.cpp)
goes from the graph to the paged kernel without coming back into Python once per layer.

The op finds a layer's KV cache, and the step's block tables, query start locations, sequence
lengths and slot mapping, in tables of its own: a layer's entry is written when the runner binds
its cache (``register_layer``), the step's when the forward context is entered (``set_step``,
by ``CpuPagedBackend``), so the graph keeps only the layer's number and constant settings. What
the kernel alone cannot do goes back to ``pagedllm::attention`` (the layer's Python path).
"""
from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedllm.kernels.cpu_extension import load_cpu_ops

if TYPE_CHECKING:
    from pagedllm.layers.attention.backend import AttentionMetadata


class BoundLayer(Protocol):
    """What the op's table keeps of an attention layer (``layer.Attention`` is one)."""

    _op_id: int              # the number the graph calls it by
    kv_cache: torch.Tensor   # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache_group: int      # whose step metadata it reads


@functools.cache
def _ops() -> Any | None:
    """The C++ ops, or None where the kernels cannot be built (the Python op serves alone)."""
    return load_cpu_ops()


@torch.compiler.assume_constant_result  # dynamo asks once while tracing, not into the build
def available_on_cpu() -> bool:
    """Whether a graph on CPU can call ``pagedllm::unified_attention``."""
    return _ops() is not None


def register_layer(layer: BoundLayer) -> None:
    """Tell the op ``layer``'s cache and group (again after every bind); forgotten with the layer."""
    if layer.kv_cache.device.type != "cpu" or (ops := _ops()) is None:
        return
    ops.set_attention_layer(layer._op_id, layer.kv_cache, layer.kv_cache_group)
    if getattr(layer, "_forget_cache", None) is None:
        # At interpreter exit the op table goes with the process: nothing to forget then.
        layer._forget_cache = weakref.finalize(layer, ops.forget_attention_layer, layer._op_id)
        layer._forget_cache.atexit = False


def set_step(md: AttentionMetadata, has_fresh: list[bool]) -> None:
    """The step's metadata per KV cache group (``md.group_metadata``, or ``md`` alone) for the op;
    ``has_fresh[g]``: group g has prompts without a cached prefix (plain layers attend those in
    Python)."""
    ops = _ops()
    if ops is None:
        return
    groups = md.group_metadata or [md]
    ops.set_attention_step([g.block_tables for g in groups], [g.query_start_loc_tensor for g in groups],
                           [g.seq_lens_tensor for g in groups], [g.slot_mapping for g in groups], has_fresh)


def clear_step() -> None:
    ops = _ops()
    if ops is not None:
        ops.clear_attention_step()
