"""The per-step attention metadata, reachable from every attention layer without being threaded
through each model's forward signature (models keep the plain ``model(input_ids, positions)``).

    with set_forward_context(attn_metadata):
        hidden_states = model(input_ids, positions)

Outside any context the metadata is ``None`` and attention treats the whole input as one causal
sequence without touching the KV cache (handy for a warm-up or a memory-profiling pass).

A step may also carry each row's token type (``token_type_ids [T]``, a text pair's segment), an
input beside the positions that only encoders with token type embeddings read; None: all 0.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedllm.layers.attention.backend import AttentionMetadata

# A module-level value rather than a ContextVar: one forward pass runs on one thread at a time and
# the lookup happens once per layer, so the simplest thing is also the cheapest.
_attn_metadata: AttentionMetadata | None = None
_token_type_ids: torch.Tensor | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None,
                        token_type_ids: torch.Tensor | None = None) -> Iterator[None]:
    global _attn_metadata, _token_type_ids
    previous = _attn_metadata, _token_type_ids
    _attn_metadata, _token_type_ids = attn_metadata, token_type_ids
    # The backend hooks: what a compiled graph's attention op reads outside the graph.
    if attn_metadata is not None:
        attn_metadata.backend.enter_step(attn_metadata)
    try:
        yield
    finally:
        _attn_metadata, _token_type_ids = previous
        if attn_metadata is not None:
            attn_metadata.backend.leave_step()
        if previous[0] is not None:
            previous[0].backend.enter_step(previous[0])


def get_attn_metadata() -> AttentionMetadata | None:
    return _attn_metadata


def get_token_type_ids() -> torch.Tensor | None:
    """The step's ``[T]`` token types, or None when every row's is 0."""
    return _token_type_ids
