"""The attention backend interface, and the per-step metadata it reads (vLLM's abstract.py).

A backend's ``forward`` stores one layer's K/V of a step in the paged cache, then computes that
layer's attention from the query and the cache (one call, as in vLLM's backends). It also says
what per-step metadata it needs: the torch backend gathers blocks and needs gather tables and
masks; the cpu_paged kernel reads the block tables in place and needs none of that. Backends
are stateless singletons, carried by the step's ``AttentionMetadata`` so that every layer of a
step uses the same one.

This module sits below everything else in attention: the backends (one module each) import it,
``selector.py`` picks one and imports it lazily, ``attention_metadata.py`` builds the metadata.
It imports none of them, so no import circle runs through it; the layer a backend attends for is
typed by what the backend reads from it (``AttentionLayer``), not by the layer's class.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch


class AttentionLayer(Protocol):
    """What a backend reads from the layer it attends for (``layer.Attention`` is one)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_groups: int  # query heads per KV head
    scale: float
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    # What a layer adds to plain causal attention (layer.Attention says how); None: nothing.
    sliding_window: int | None     # a query at position p sees keys at (p - window, p]
    logits_soft_cap: float | None  # scores -> cap * tanh(scores / cap), after the scale
    sinks: torch.Tensor | None     # [num_heads]: per query head, a logit in the denominator only
    causal: bool                   # False: a query sees its request's keys after it too (no KV kept)


def is_plain(layer: AttentionLayer) -> bool:
    """Whether the layer is plain attention (no window, soft cap or sinks; causal or not): the
    path every backend had before those existed, kept as it was."""
    return layer.sliding_window is None and layer.logits_soft_cap is None and layer.sinks is None


@dataclass(slots=True)
class DecodeBatch:
    """All requests with exactly one new token, attended by the torch backend with a single
    batched SDPA call over blocks gathered from the paged cache."""

    token_indices: torch.Tensor  # [Bd] long: rows of the flat batch
    rows: slice | torch.Tensor   # token_indices as a slice when they are consecutive (no copies)
    block_tables: torch.Tensor   # [Bd, nb] long: enough blocks for the longest of them
    mask: torch.Tensor           # [Bd, 1, 1, nb * block_size] bool: True = position < seq_len
    seq_lens: torch.Tensor       # [Bd] long: where a sliding window's keys end


@dataclass(slots=True)
class PrefillChunk:
    """One request with several new tokens (a whole prompt or a chunk of it)."""

    token_start: int             # its rows in the flat batch: [token_start, token_end)
    token_end: int
    num_computed_tokens: int     # cached prefix length (0: attend to the new tokens only)
    block_ids: torch.Tensor      # [nb] long: blocks holding positions [0, seq_len)
    mask: torch.Tensor | None    # [q, seq_len] bool, causal shifted by the prefix; None if no prefix


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] long: cache slot (block_id * block_size + offset) per new token
    query_start_loc: list[int]        # [B + 1]: request i owns rows [query_start_loc[i], query_start_loc[i+1])
    seq_lens: list[int]               # [B]: context length after this step (computed + new)
    num_computed_tokens: list[int]    # [B]: tokens already in the cache before this step
    block_tables: torch.Tensor        # [B, max_blocks] long, padded with block 0 (never read: masked)
    block_size: int
    positions: torch.Tensor           # [T] long: position of each new token (what the model's rope needs)
    query_start_loc_tensor: torch.Tensor  # [B + 1] long, on the device
    seq_lens_tensor: torch.Tensor     # [B] long, on the device
    backend: AttentionBackend         # attends in every layer of the step
    # The torch backend's gather plan (None / empty for backends that read the cache in place).
    decode: DecodeBatch | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    backend_data: object = None       # whatever else the backend prepared (backend.prepare)
    # With several KV cache groups: one metadata per group (its block tables and slots), and a
    # layer reads its own group's (``Attention.kv_cache_group``); None with one group.
    group_metadata: list[AttentionMetadata] | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether the step's metadata must carry the decode batch and prefill chunks (gather tables
    # and masks) that the torch backend reads; building them costs a few small tensors per step.
    needs_gather_plan: ClassVar[bool]

    def prepare(self, md: AttentionMetadata) -> object:
        """Anything per step that every layer would otherwise rebuild; kept as
        ``md.backend_data``."""
        return None

    def enter_step(self, md: AttentionMetadata) -> None:
        """The step ``md`` starts (the forward context is entered): anything the compiled graph's
        attention op must find outside the graph."""

    def leave_step(self) -> None:
        """The step's forward context is left."""

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """``q [T, H, D]`` and this step's ``k/v [T, Hkv, D]`` -> ``[T, H, D]``: stores k/v in
        ``layer.kv_cache`` at ``md.slot_mapping`` first. Requests scheduled in the same step may
        share blocks (identical prompts), and every reader must see every writer's K/V."""

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"
