"""The model families (one small file each over the shared decoder: docs/models.md), the
architecture registry and the weight loader."""
from __future__ import annotations

from pagedllm.models.loader import load_model
from pagedllm.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "load_model", "supported_architectures"]
