"""Paged attention: the layer models use, and the backends that compute it (one file each):

- ``torch_backend.py``: gather + SDPA in plain torch, CPU and CUDA; the numerical reference.
- ``cpu_paged.py``: the CPU default, a C++ kernel (``kernels/csrc/``, built by
  ``kernels/cpu_extension.py``) that reads the paged cache in place.

``backend.py`` holds the interface (and the per-step metadata's types) and imports no backend;
``selector.py`` holds ``get_attn_backend`` (the choice per device), importing backends lazily;
runner/attention_choice.py measures cpu_paged against torch on a model's heads at startup
(``auto`` on CPU).
"""
from __future__ import annotations

from pagedllm.config import ATTENTION_BACKENDS
from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.kv_cache_spec import KVCacheSpec
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.selector import get_attn_backend

__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionBackend", "KVCacheSpec", "get_attn_backend"]
