"""The attention backend on CPU, measured at startup (the safety net beside
weight_plan/linear_choice.py's): the cpu_paged kernel against the torch backend, on layers like the
model's own (each kind of layer it has: its heads and head size, sliding window, soft-cap,
sinks) over a KV
cache of its dtype (fp8 and 16-bit caches are widened as they are read, which costs the two
backends differently), at a decode batch and a prefill chunk over a cached prefix. A windowed
layer is timed over a context past its window (up to _MAX_CONTEXT), where the kernel reads only
the window's blocks. The kernel stays unless the torch backend is clearly faster (the linears'
margin: near ties are a 2-core VM's noise, and the kernel gives a token the same bits in a
decode and in a chunk, which SDPA need not). ``PAGEDLLM_CPU_KERNELS=pagedllm`` or ``=torch``
skips the measurement.
"""
from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Iterable

import torch

from pagedllm import envs
from pagedllm.kernels.cpu_extension import cpu_description
from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.layers.attention_metadata import build_attention_metadata
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import bind_kv_caches, kv_cache_shape
from pagedllm.utils import cdiv
from pagedllm.weight_plan.linear_choice import TORCH_MARGIN, best_times

logger = logging.getLogger(__name__)

_BLOCK_SIZE = 16
_CONTEXT = 256       # cached prefix + new tokens per request, full-attention layers
_MAX_CONTEXT = 1024  # a windowed layer: past its window, up to this
_DECODES, _CHUNK = 8, 128  # a decode batch of 8 requests; one prefill chunk over a prefix
_ROUNDS = 3
# (dtype, kv cache dtype, (layer kind, count) ...) -> the torch backend's time over the kernel's
_MEASURED: dict[tuple, float] = {}

# heads, KV heads, head_dim, sliding window, logits soft-cap, sinks
LayerKind = tuple[int, int, int, int | None, float | None, bool]


def choose_cpu_attention(layers: Attention | Iterable[Attention],
                         kv_cache_dtype: torch.dtype | None = None,
                         dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """cpu_paged or torch for a model whose attention layers are ``layers`` (one layer: every
    layer like it), q/k/v in ``dtype`` and its KV cache in ``kv_cache_dtype`` (None: ``dtype``)."""
    forced = envs.cpu_kernels()
    paged = get_attn_backend("cpu_paged", "cpu")
    if paged.name != "cpu_paged" or forced == "torch":
        return get_attn_backend("torch", "cpu")
    if forced == "pagedllm":
        return paged
    layers = [layers] if isinstance(layers, Attention) else list(layers)
    kinds = Counter((layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.sliding_window,
                     layer.logits_soft_cap, layer.sinks is not None) for layer in layers)
    key = (dtype, kv_cache_dtype or dtype, tuple(sorted(kinds.items(), key=repr)))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(*key[:2], kinds, paged, get_attn_backend("torch", "cpu"))
    speedup = _MEASURED[key]
    chosen = paged if speedup * TORCH_MARGIN >= 1.0 else get_attn_backend("torch", "cpu")
    logger.info("attention on %s: the %s backend; the torch backend's time over the cpu_paged "
                "kernel's (%s cache, layers %s; a decode batch and a prefill chunk): %.2fx",
                cpu_description(), chosen.name, str(key[1]).removeprefix("torch."),
                _describe(kinds), speedup)
    return chosen


def _describe(kinds: Counter) -> str:
    def one(kind: LayerKind) -> str:
        heads, kv_heads, head_dim, window, cap, sinks = kind
        parts = [f"{kv_heads} / {heads} heads x {head_dim}", f"window {window}" if window else "full"]
        parts += [f"soft-cap {cap:g}"] if cap else []
        parts += ["sinks"] if sinks else []
        return " + ".join(parts)
    return ", ".join(f"{count} x {one(kind)}" for kind, count in kinds.items())


@torch.inference_mode()
def _measure(dtype: torch.dtype, cache_dtype: torch.dtype, kinds: Counter,
             paged: AttentionBackend, reference: AttentionBackend) -> float:
    """The torch backend's time over the kernel's: the geometric mean over the two batches of
    each kind of layer, weighted by how many layers are of that kind; best of _ROUNDS
    interleaved calls each."""
    gen = torch.Generator().manual_seed(0)
    log_ratio, weight = 0.0, 0
    for (heads, kv_heads, head_dim, window, cap, sinks), count in kinds.items():
        layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, layer_idx=0,
                          sliding_window=window, logits_soft_cap=cap, has_sinks=sinks)
        if sinks:
            layer.sinks.data = torch.randn(heads, generator=gen).to(dtype)
        context = _CONTEXT if not window else min(max(_CONTEXT, window + _CHUNK), _MAX_CONTEXT)
        for batch in ([(context - 1, 1)] * _DECODES, [(context - _CHUNK, _CHUNK)]):
            log_ratio += count * math.log(_time(layer, batch, dtype, cache_dtype, gen, paged,
                                                reference))
            weight += count
    return math.exp(log_ratio / weight)


def _time(layer: Attention, batch: list[tuple[int, int]], dtype: torch.dtype,
          cache_dtype: torch.dtype, gen: torch.Generator, paged: AttentionBackend,
          reference: AttentionBackend) -> float:
    """The torch backend's time over the kernel's for ``batch`` ((cached, new) per request)."""
    need = [cdiv(c + n, _BLOCK_SIZE) for c, n in batch]
    ids = list(range(sum(need)))
    random.Random(0).shuffle(ids)  # scattered blocks, as a running cache has them
    tables = [[ids.pop() for _ in range(k)] for k in need]
    shape = kv_cache_shape(sum(need), _BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
    cache = torch.randn(shape, generator=gen).to(cache_dtype)
    bind_kv_caches(torch.nn.ModuleList([layer]), [cache])
    tokens = sum(n for _, n in batch)
    q = torch.randn(tokens, layer.num_heads, layer.head_dim, generator=gen).to(dtype)
    kv = torch.randn(tokens, layer.num_kv_heads, layer.head_dim, generator=gen).to(dtype)
    metadata = [build_attention_metadata([n for _, n in batch], [c for c, _ in batch], tables,
                                         _BLOCK_SIZE, backend=b) for b in (paged, reference)]
    calls = [lambda md=md: _attend(layer, md, q, kv) for md in metadata]
    mine, torch_time = best_times(calls, _ROUNDS)
    return torch_time / mine


def _attend(layer: Attention, md, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    with set_forward_context(md):
        return layer(q, kv, kv)
