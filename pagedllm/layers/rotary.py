"""Rotary position embedding (half-split "rotate_half" layout, as in HF Llama checkpoints).

The rope settings arrive in two spellings: transformers 4.x writes ``rope_theta`` at the top level
and an optional ``rope_scaling`` dict (``type`` or ``rope_type``); transformers 5.x writes one
``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``, or one such dict per layer type
(Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``). ``RopeConfig.from_hf``
reads all of them.

Scaled variants change the inverse frequencies (linear, llama3, yarn, longrope) and may multiply
cos/sin by an attention factor (yarn, longrope). Partial rotary (``partial_rotary_factor``) rotates
only the first ``rotary_dim`` dims of each head; the rest pass through.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Old spellings of the same methods (Phi-3's first checkpoints wrote "su").
_ALIASES = {"su": "longrope"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = 1.0  # None (yarn, longrope): max_position_embeddings / original
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 8192  # the config's own (yarn/longrope derive factors from it)
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None  # yarn/longrope: None means the paper's default
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None  # longrope, one per rotated frequency
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, config: dict, layer_type: str | None = None) -> RopeConfig:
        """Merge the 4.x and 5.x spellings; the 5.x ``rope_parameters`` wins where both exist.
        ``layer_type`` picks one entry of a per-layer-type ``rope_parameters`` dict."""
        params: dict = {}
        params.update(config.get("rope_scaling") or {})
        nested = config.get("rope_parameters") or {}
        if layer_type is not None and isinstance(nested.get(layer_type), dict):
            nested = nested[layer_type]
        elif any(isinstance(v, dict) for v in nested.values()):
            nested = nested.get("full_attention") or {}
        params.update(nested)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        rope_type = _ALIASES.get(rope_type, rope_type)
        if rope_type == "dynamic":
            raise UnsupportedModelError(
                "rope type 'dynamic' is not supported: its scaling depends on the longest sequence "
                "seen so far, so one request's rotation would depend on its batch; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}", "rope_scaling")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}",
                "rope_scaling")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        max_pos = int(config.get("max_position_embeddings", 8192))
        original_max = params.get("original_max_position_embeddings", max_pos)
        if rope_type in ("yarn", "longrope") and config.get("original_max_position_embeddings"):
            # As transformers does: a top-level value (Phi-3 writes one) wins for these types.
            original_max = config["original_max_position_embeddings"]
        default_factor = None if rope_type in ("yarn", "longrope") else 1.0
        factor = params.get("factor", default_factor)
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))

        def optional(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        def factors(key: str) -> tuple[float, ...] | None:
            return None if params.get(key) is None else tuple(float(f) for f in params[key])

        rope = cls(theta=float(theta), rope_type=rope_type,
                   factor=None if factor is None else float(factor),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(original_max),
                   max_position_embeddings=max_pos, partial_rotary_factor=float(partial or 1.0),
                   attention_factor=optional("attention_factor"),
                   beta_fast=float(params.get("beta_fast") or 32.0),
                   beta_slow=float(params.get("beta_slow") or 1.0),
                   mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                   truncate=bool(params.get("truncate", True)),
                   short_factor=factors("short_factor"), long_factor=factors("long_factor"))
        if rope_type == "longrope" and (rope.short_factor is None or rope.long_factor is None):
            raise UnsupportedModelError("rope type 'longrope' needs short_factor and long_factor "
                                        "lists in rope_scaling", "rope_scaling")
        return rope

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def scale_factor(self) -> float:
        """yarn/longrope's factor; absent, the ratio of the extended to the original context."""
        if self.factor is not None:
            return self.factor
        return self.max_position_embeddings / self.original_max_position_embeddings


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """``[rotary_dim // 2]`` float32 inverse frequencies, scaled as ``rope.rope_type`` says
    (longrope: the short factors, used within the original context)."""
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(exponents, rope, rope.short_factor)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(dim, rope)
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """The factor yarn and longrope multiply cos and sin by (1.0 for the others)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.scale_factor()
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        return _yarn_mscale(factor)
    if rope.rope_type == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly, so the model keeps local detail while reaching a longer context.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, rope: RopeConfig) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times kept, a linear
    # ramp between; the same float32 steps as transformers, so the values match bit for bit.
    base, factor = rope.theta, rope.scale_factor()

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((index - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope_inv_freq(exponents: torch.Tensor, rope: RopeConfig,
                       ext_factors: tuple[float, ...] | None) -> torch.Tensor:
    if ext_factors is None or len(ext_factors) != exponents.numel():
        raise UnsupportedModelError(
            f"longrope factors must have rotary_dim / 2 = {exponents.numel()} entries, got "
            f"{None if ext_factors is None else len(ext_factors)}", "rope_scaling")
    factors = torch.tensor(ext_factors, dtype=torch.float32, device="cpu")
    return 1.0 / (factors * rope.theta ** exponents)


class RotaryEmbedding(nn.Module):
    """Positions ``[T]`` -> ``(cos, sin)``, each ``[T, rotary_dim]``, computed once per forward
    pass and shared by every layer with the same rope.

    Computing from the positions (instead of slicing a precomputed table) has no length limit and
    gives bit-identical values to transformers, which also multiplies position by inv_freq in
    float32.

    Longrope: transformers picks the short or the long factors for a whole sequence by its
    length, re-rotating every cached key when a sequence outgrows the original context. A paged
    cache cannot re-rotate, and a token's rotation must not depend on its batch, so the choice
    is per position: positions within the original context use the short factors (exactly
    transformers' result for any sequence that fits it), positions past it the long ones.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.rope = rope
        # Plain attributes, not buffers: the loader builds the model on the meta device and
        # casts parameters to the model dtype; inv_freq must stay real float32 through both.
        self.inv_freq = compute_inv_freq(head_dim, rope)
        self.long_inv_freq = None
        if rope.rope_type == "longrope":
            dims = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu")
            exponents = dims.float() / self.rotary_dim
            self.long_inv_freq = _longrope_inv_freq(exponents, rope, rope.long_factor)
        self.attention_scaling = attention_scaling(rope)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if self.long_inv_freq is not None:
                self.long_inv_freq = self.long_inv_freq.to(positions.device)
        pos = positions.to(torch.float32)[:, None]
        freqs = pos * self.inv_freq[None, :]  # [T, rotary_dim // 2]
        if self.long_inv_freq is not None:
            is_long = positions[:, None] >= self.rope.original_max_position_embeddings
            freqs = torch.where(is_long, pos * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, {self.rope.rope_type}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the ``[T, rotary_dim]`` angles; with partial
    rotary the dims past ``rotary_dim`` pass through unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
