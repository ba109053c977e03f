"""Apply structured outputs' token bitmasks to a step's logits: one masked_fill for the batch.

The engine core sends, per constrained request, one packed row per logits row it samples
(SchedulerOutput.grammar_bitmask: little-endian int32 words, bit t = token t allowed). Tokens
beyond the rows' width (a model vocabulary padded past the tokenizer's) are never allowed.
"""
from __future__ import annotations

import torch

# byte value -> its 8 bits, lowest first: unpacking is one gather (cheaper than shifts and ands).
_BITS = torch.tensor([[b >> i & 1 for i in range(8)] for b in range(256)], dtype=torch.bool)


def apply_grammar_bitmask(logits: torch.Tensor, row_masks: list[bytes | None]) -> None:
    """``logits``: [num_rows, vocab]; ``row_masks[i]``: row i's packed mask, or None (free)."""
    rows = [i for i, m in enumerate(row_masks) if m is not None]
    if not rows:
        return
    packed = bytearray(b"".join(row_masks[i] for i in rows))  # type: ignore[misc]
    # [rows, bytes] -> [rows, bytes * 8]: bit j of byte k is token 8 * k + j.
    allowed = _BITS[torch.frombuffer(packed, dtype=torch.uint8).long()].view(len(rows), -1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row constrained: in place, no gather and scatter
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
