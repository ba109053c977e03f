"""BeamSearchParams: the parameters of ``LLM.beam_search`` (vLLM's), validated on creation."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pagedllm.errors import ValidationError, check_ints


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted for vLLM compatibility; beams are scored, not sampled
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):  # what the executor wire carries: 64 bits
            check_ints(getattr(self, name), name)
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValidationError(f"beam_width must be >= 1, got {self.beam_width!r}", "beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValidationError(f"max_tokens must be >= 1, got {self.max_tokens!r}", "max_tokens")
        for name in ("length_penalty", "temperature"):  # NaN would poison every score
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValidationError(f"{name} must be a finite number, got {v!r}", name)
