"""The KV cache's dtype (``--kv-cache-dtype``, vLLM's ``kv_cache_dtype``): the names, and the
conversions the backends make when they store K/V and read them back.

``auto`` keeps the model's dtype; ``bfloat16``/``float16`` halve a float32 model's cache, ``fp8``
(= ``fp8_e4m3``, torch's float8_e4m3fn, the OCP variant without infinities) and ``fp8_e5m2``
quarter it, so the same memory budget holds 2x or 4x the tokens. Attention widens what it reads
to float32 and sums there.

fp8 uses a scale of 1.0 (vLLM's k_scale/v_scale without calibration). Values beyond the fp8
range are clamped to its largest finite value before the cast: torch's CPU cast to e4m3fn
saturates the same way, but its cast to e5m2 makes them infinite (and an infinity in a key
would turn a row's softmax into NaN). NaN stays NaN.
"""
from __future__ import annotations

import torch

from pagedllm.errors import ValidationError

_NAMED = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache for ``kv_cache_dtype`` ``name`` and the model's dtype."""
    if name == "auto":
        return model_dtype
    dtype = _NAMED[name]  # the name was validated by CacheConfig
    # The kernels widen to the model's dtype: a cache wider than the model, or the other 16-bit
    # type under a 16-bit model (a lossy swap that saves nothing), is refused.
    if dtype != model_dtype and dtype.itemsize >= model_dtype.itemsize:
        raise ValidationError(
            f"kv_cache_dtype {name} is unsupported with a {str(model_dtype).removeprefix('torch.')} "
            f"model; supported: auto, a narrower type ({_narrower(model_dtype)})", "kv_cache_dtype")
    return dtype


def _narrower(model_dtype: torch.dtype) -> str:
    return ", ".join(n for n, d in _NAMED.items() if d.itemsize < model_dtype.itemsize)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_MAX


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: cast to ``dtype``, clamped first for fp8 (see above)."""
    if x.dtype == dtype:
        return x
    if dtype in _FP8_MAX:
        bound = _FP8_MAX[dtype]
        x = x.clamp(-bound, bound)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as the cache would store it, back in its own dtype: what attention reads
    for these positions from the cache, for the rows that attend their own fresh K/V instead."""
    if x.dtype == dtype:
        return x
    return to_cache_dtype(x, dtype).to(x.dtype)


def storage(t: torch.Tensor) -> torch.Tensor:
    """A view for copying and indexing: bytes for fp8, whose dtypes torch's CPU index kernels
    (index_copy_, index_select, advanced indexing) do not cover; ``t`` itself otherwise."""
    return t.view(torch.uint8) if t.dtype in _FP8_MAX else t


def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache[block_ids]`` (one of K or V, ``[num_blocks, block_size, Hkv, D]``) widened to
    ``dtype``: index_select copies whole blocks (memcpy), then one cast."""
    return storage(cache).index_select(0, block_ids).view(cache.dtype).to(dtype)
