"""Rotary position embedding (half-split "rotate_half" layout, as in HF Llama checkpoints).

The rope settings arrive in two spellings: transformers 4.x writes ``rope_theta`` at the top level
and an optional ``rope_scaling`` dict (``type`` or ``rope_type``); transformers 5.x writes one
``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``. ``RopeConfig.from_hf`` reads both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, config: dict) -> RopeConfig:
        """Merge the 4.x and 5.x spellings; the 5.x ``rope_parameters`` wins where both exist."""
        params: dict = {}
        params.update(config.get("rope_scaling") or {})
        params.update(config.get("rope_parameters") or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}",
                "rope_scaling")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        original_max = params.get("original_max_position_embeddings",
                                  config.get("max_position_embeddings", 8192))
        return cls(theta=float(theta), rope_type=rope_type,
                   factor=float(params.get("factor", 1.0)),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(original_max))


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled as ``rope.rope_type`` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


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


class RotaryEmbedding(nn.Module):
    """Positions ``[T]`` -> ``(cos, sin)``, each ``[T, head_dim]``, computed once per forward pass
    and shared by every layer.

    Computing from the positions (instead of slicing a precomputed table) has no length limit and
    gives bit-identical values to transformers, which also multiplies position by inv_freq in
    float32.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # A plain attribute, not a buffer: the loader builds the model on the meta device and
        # casts parameters to the model dtype; inv_freq must stay real float32 through both.
        self.inv_freq = compute_inv_freq(head_dim, rope)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the ``[T, head_dim]`` angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
