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
    max_position_embeddings: int = 2048  # positions the cos/sin table covers

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
                   original_max_position_embeddings=int(original_max),
                   max_position_embeddings=int(config.get("max_position_embeddings", 2048)))


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
    """Positions ``[T]`` -> ``(cos, sin)``, each ``[T, head_dim]``, shared by every layer.

    Looked up in a table of every position's angles, ``[max_position_embeddings, head_dim]``
    (cosines, then sines, of the ``head_dim // 2`` frequencies; vLLM's cos_sin_cache), computed
    once at load as transformers computes them per step (position times inv_freq in float32,
    torch's cos and sin): the same bits (tests/models/test_loader.py). 64 MiB for a
    128k-position model of head_dim 128. Computed per step, inductor fuses cos and sin into each
    layer's rotary kernel and evaluates them for every head of every layer (measured: the rotary
    kernels 3.2% of a decode step of the 58M benchmark model, the largest fused kernel); a
    lookup is a load.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.inv_freq = compute_inv_freq(head_dim, rope)
        positions = torch.arange(rope.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, head_dim // 2]
        # A plain attribute, not a buffer: derived (state_dict() must not save it) and float32
        # whatever the model's dtype (cast per step, as the angles were).
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, head_dim]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_sin.device != positions.device:
            self.cos_sin = self.cos_sin.to(positions.device)
        cos, sin = self.cos_sin[positions].to(dtype).chunk(2, dim=-1)  # [T, head_dim // 2] each
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the ``[T, head_dim]`` angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
