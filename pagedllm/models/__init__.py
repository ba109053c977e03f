"""The model families (one small file each over the shared decoder: docs/models.md) and the
architecture registry. Loading a checkpoint into one is pagedllm/checkpoint/'s."""
from __future__ import annotations

from pagedllm.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
