"""The attention backend interface, and the choice of one per device.

A backend stores one layer's K/V of a step in the paged cache, then computes that layer's
attention from the query and the cache. It also says what per-step metadata it needs:
the torch backend gathers blocks and needs gather tables and masks; the cpu_paged kernel reads
the block tables in place and needs none of that. Backends are stateless singletons, carried by
the step's ``AttentionMetadata`` so that every layer of a step uses the same one.
"""
from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedllm.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from pagedllm.layers.attention.layer import Attention
    from pagedllm.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether the step's metadata must carry the decode batch and prefill chunks (gather tables
    # and masks) that the torch backend reads; building them costs a few small tensors per step.
    needs_gather_plan: ClassVar[bool]

    def prepare(self, md: AttentionMetadata) -> object:
        """Anything per step that every layer would otherwise rebuild; kept as
        ``md.backend_data``."""
        return None

    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor,
                 md: AttentionMetadata) -> None:
        """Store this step's ``k/v [T, Hkv, D]`` in ``layer.kv_cache`` at the flat slots
        ``md.slot_mapping``: torch's index_copy_ into a slot-indexed view, on any device."""
        _, num_blocks, block_size, num_kv_heads, head_dim = layer.kv_cache.shape
        flat = layer.kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, md.slot_mapping, k)
        flat[1].index_copy_(0, md.slot_mapping, v)

    @abstractmethod
    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """``q [T, H, D]`` and this step's ``k/v [T, Hkv, D]`` (already in ``layer.kv_cache``)
        -> ``[T, H, D]``."""

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"


@functools.cache
def get_attn_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """``name``: one of ATTENTION_BACKENDS; ``auto`` is cpu_paged on CPU and torch elsewhere.
    cpu_paged falls back to torch (with a warning, logged once) when its kernel cannot be
    built. Imports a backend's module only when it is chosen: nothing device-specific is
    imported on another device."""
    device_type = torch.device(device).type
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = "cpu_paged" if device_type == "cpu" else "torch"
    if name == "cpu_paged":
        if device_type != "cpu":
            raise ValueError(f"the cpu_paged attention backend runs on CPU only, not {device}")
        from pagedllm.layers.attention.cpu_paged import CpuPagedBackend, load_paged_attention_op

        if load_paged_attention_op() is not None:
            return CpuPagedBackend()
        name = "torch"  # the loader has logged why
    from pagedllm.layers.attention.torch_backend import TorchBackend

    return TorchBackend()
