"""The attention backend on CPU, measured at startup (the safety net beside
layers/linear_kernel.py's): the cpu_paged kernel against the torch backend, on the model's own
heads, at a decode batch and a prefill chunk over a cached prefix. The kernel stays unless the
torch backend is clearly faster (the linears' margin: near ties are a 2-core VM's noise, and the
kernel gives a token the same bits in a decode and in a chunk, which SDPA need not).
``PAGEDLLM_CPU_KERNELS=pagedllm`` or ``=torch`` skips the measurement.
"""
from __future__ import annotations

import logging
import math
import os
import random

import torch

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.layers.attention_metadata import build_attention_metadata
from pagedllm.layers.cpu_extension import cpu_description
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import bind_kv_caches, kv_cache_shape
from pagedllm.layers.linear_kernel import TORCH_MARGIN, best_times

logger = logging.getLogger(__name__)

_BLOCK_SIZE = 16
# (cached prefix, new tokens) per request: a decode batch, and a prefill chunk over a prefix.
_DECODE = [(255, 1)] * 8
_PREFILL = [(128, 128)]
_ROUNDS = 3
_MEASURED: dict[tuple[int, int, int], float] = {}  # (heads, kv heads, head_dim) -> speedup


def choose_cpu_attention(layer: Attention) -> AttentionBackend:
    """cpu_paged or torch for a model whose attention layers look like ``layer``."""
    forced = os.environ.get("PAGEDLLM_CPU_KERNELS", "auto")
    if forced not in ("auto", "pagedllm", "torch"):
        raise ValueError(f"PAGEDLLM_CPU_KERNELS={forced!r}: expected auto, pagedllm or torch")
    paged = get_attn_backend("cpu_paged", "cpu")
    if paged.name != "cpu_paged" or forced == "torch":
        return get_attn_backend("torch", "cpu")
    if forced == "pagedllm":
        return paged
    key = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(*key, paged, get_attn_backend("torch", "cpu"))
    speedup = _MEASURED[key]
    chosen = paged if speedup * TORCH_MARGIN >= 1.0 else get_attn_backend("torch", "cpu")
    logger.info("attention on %s: the %s backend; the torch backend's time over the cpu_paged "
                "kernel's (%d / %d heads x %d, a decode batch and a prefill chunk): %.2fx",
                cpu_description(), chosen.name, *key, speedup)
    return chosen


@torch.inference_mode()
def _measure(heads: int, kv_heads: int, head_dim: int, paged: AttentionBackend,
             reference: AttentionBackend) -> float:
    """The torch backend's time over the kernel's: geometric mean over the two batches, best of
    _ROUNDS interleaved calls each."""
    gen = torch.Generator().manual_seed(0)
    log_ratio = 0.0
    for batch in (_DECODE, _PREFILL):
        need = [-(-(c + n) // _BLOCK_SIZE) for c, n in batch]
        ids = list(range(sum(need)))
        random.Random(0).shuffle(ids)  # scattered blocks, as a running cache has them
        tables = [[ids.pop() for _ in range(k)] for k in need]
        cache = torch.randn(kv_cache_shape(sum(need), _BLOCK_SIZE, kv_heads, head_dim), generator=gen)
        layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, layer_idx=0)
        bind_kv_caches(torch.nn.ModuleList([layer]), [cache])
        tokens = sum(n for _, n in batch)
        q = torch.randn(tokens, heads, head_dim, generator=gen)
        kv = torch.randn(tokens, kv_heads, head_dim, generator=gen)
        metadata = [build_attention_metadata([n for _, n in batch], [c for c, _ in batch], tables,
                                             _BLOCK_SIZE, backend=b) for b in (paged, reference)]
        calls = [lambda md=md: _attend(layer, md, q, kv) for md in metadata]
        mine, torch_time = best_times(calls, _ROUNDS)
        log_ratio += math.log(torch_time / mine)
    return math.exp(log_ratio / 2)


def _attend(layer: Attention, md, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    with set_forward_context(md):
        return layer(q, kv, kv)
