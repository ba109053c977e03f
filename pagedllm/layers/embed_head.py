"""Token embedding and the language-model head (which may share the embedding's weight)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.linear import linear


class VocabEmbedding(nn.Embedding):
    """``[T] token ids -> [T, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)


class LMHead(nn.Module):
    """``[N, hidden] -> [N, vocab]`` float32 logits (the sampler wants float32 whatever the dtype)."""

    # Set by prepack_linear_weights (see linear.py); a tied head gets its own packed copy.
    packed_weight: torch.Tensor | None = None

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def tie_to(self, embedding: VocabEmbedding) -> None:
        # One Parameter object for both: named_parameters() lists it once (as the embedding), so
        # the loader never expects an ``lm_head.weight`` tensor in a tied checkpoint.
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight, None, self.packed_weight).float()
