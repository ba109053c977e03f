"""The choice of an attention backend per device: a registry that imports the chosen backend's
module lazily (nothing device-specific is imported on another device, and ``backend.py``, the
interface every backend imports, never imports a backend)."""
from __future__ import annotations

import functools

import torch

from pagedllm.config import ATTENTION_BACKENDS
from pagedllm.layers.attention.backend import AttentionBackend


@functools.cache
def get_attn_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    """``name``: one of ATTENTION_BACKENDS; ``auto`` is cpu_paged on a CPU its kernel is tuned
    for (x86-64-v3 or -v4: kernels/cpu_extension.py) and torch elsewhere (other CPUs and
    devices). cpu_paged falls back to torch (with a warning, logged once) when its kernel
    cannot be built."""
    device_type = torch.device(device).type
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        from pagedllm.kernels.cpu_extension import native_isa

        name = "cpu_paged" if device_type == "cpu" and native_isa() is not None else "torch"
    if name == "cpu_paged":
        if device_type != "cpu":
            raise ValueError(f"the cpu_paged attention backend runs on CPU only, not {device}")
        from pagedllm.layers.attention.cpu_paged import CpuPagedBackend, load_paged_attention_op

        if load_paged_attention_op() is not None:
            return CpuPagedBackend()
        name = "torch"  # the loader has logged why
    from pagedllm.layers.attention.torch_backend import TorchBackend

    return TorchBackend()
