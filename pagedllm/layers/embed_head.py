"""Token embedding and the language-model head, split by vocabulary rows across ranks.

Rank ``r`` holds rows ``r * P : (r + 1) * P`` of the vocabulary, ``P = ceil(vocab / tp)``; the
last rank's rows past the vocabulary are padding (zeroed by the loader, never looked up, and cut
from the logits). The embedding looks up the ids it owns, writes zeros for the others and sums
over the ranks (adding zeros is exact: the result is the unsharded lookup, bit for bit). The head
computes its rows' logits and all-gathers them; the runner calls it only on the hidden rows
that sample or score prompt tokens, so only those rows' logits cross the wire.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.distributed.tp_sizes import vocab_rows_per_rank
from pagedllm.layers.linear import WeightSlice, linear
from pagedllm.layers.weight_format import WeightFormat


class VocabParallelEmbedding(nn.Embedding):
    """``[T] token ids -> [T, hidden]``."""

    # How the embedding holds its weight once loaded (``weight`` is then None): a tied
    # embedding shares its head's format object (panels, bf16/fp16, GGUF's blocks) and reads
    # its rows from there, one copy of the matrix; an untied one may hold its own (GGUF).
    weight_format: WeightFormat | None = None

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        tp = get_tp_group()
        rows = vocab_rows_per_rank(vocab_size, tp.world_size)
        super().__init__(rows, hidden_size)
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = min(tp.rank * rows, vocab_size)
        self.vocab_end = min(self.vocab_start + rows, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = self._lookup(local_ids).masked_fill_(~owned.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_format is None:
            return F.embedding(ids, self.weight)
        return self.weight_format.rows(ids)

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        return [_vocab_rows(self, param)]


class ParallelLMHead(nn.Module):
    """``[N, hidden] -> [N, vocab]`` float32 logits (the sampler wants float32 whatever the dtype),
    the same full rows on every rank (each rank samples, with the same generator state)."""

    # How the head holds its weight once loaded, in place of ``weight`` (see linear.py).
    weight_format: WeightFormat | None = None

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        rows = vocab_rows_per_rank(vocab_size, tp.world_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.out_features = rows  # this rank's
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = min(tp.rank * rows, vocab_size)
        self.vocab_end = min(self.vocab_start + rows, vocab_size)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        # One Parameter object for both (the same rows on this rank): named_parameters() lists
        # it once (as the embedding), so the loader never expects an ``lm_head.weight`` tensor.
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(self, hidden_states, None)
        if self.tp.world_size == 1:
            return logits.float()
        # Gather in the model's dtype (half the bytes of float32 for bf16), then widen.
        logits = self.tp.all_gather(logits, dim=-1)  # [N, tp * rows]
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()  # cut the padding rows
        return logits.float()

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        return [_vocab_rows(self, param)]


def _vocab_rows(layer: VocabParallelEmbedding | ParallelLMHead, param: torch.Tensor) -> WeightSlice:
    """This rank's vocabulary rows of the checkpoint tensor, into the first rows of ``param``."""
    rows = layer.vocab_end - layer.vocab_start
    return WeightSlice(param.narrow(0, 0, rows), None, 0, layer.vocab_start, layer.vocab_size)
