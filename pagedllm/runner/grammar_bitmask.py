"""Apply structured outputs' token bitmasks to a step's logits: one masked_fill for the batch.

The engine core sends, per constrained request, one packed row per logits row it samples
(SchedulerOutput.grammar_bitmask: little-endian int32 words, bit t = token t allowed). Tokens
beyond the rows' width (a model vocabulary padded past the tokenizer's) are never allowed.
"""
from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, row_masks: list[bytes | None]) -> None:
    """``logits``: [num_rows, vocab]; ``row_masks[i]``: row i's packed mask, or None (free)."""
    rows = [i for i, m in enumerate(row_masks) if m is not None]
    if not rows:
        return
    packed = bytearray(b"".join(row_masks[i] for i in rows))  # type: ignore[misc]
    words = torch.frombuffer(packed, dtype=torch.int32).view(len(rows), -1)
    shifts = torch.arange(32, dtype=torch.int32)
    # [rows, words, 32] -> [rows, words * 32]: bit j of word w is token 32 * w + j.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
