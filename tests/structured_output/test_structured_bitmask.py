"""The runner's side: one masked_fill over the batch's logits; the FakeRunner's stand-in."""
from __future__ import annotations

import struct

import torch

from pagedllm.runner.fake import grammar_choice
from pagedllm.runner.grammar_bitmask import apply_grammar_bitmask


def packed(allowed: set[int], words: int) -> bytes:
    values = [0] * words
    for t in allowed:
        values[t // 32] |= 1 << (t % 32)
    return struct.pack(f"<{words}I", *values)


def test_masks_only_constrained_rows_and_the_tail_beyond_the_mask():
    logits = torch.zeros(3, 70)
    apply_grammar_bitmask(logits, [packed({0, 31, 33}, 2), None, packed({63}, 2)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 33]
    assert torch.isfinite(logits[1]).all()
    # Tokens 64..69 lie beyond the tokenizer's mask: never allowed.
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [63]


def test_nothing_constrained_is_a_no_op():
    logits = torch.randn(2, 8)
    before = logits.clone()
    apply_grammar_bitmask(logits, [None, None])
    assert torch.equal(logits, before)


def test_fake_runner_keeps_allowed_tokens_and_replaces_others():
    mask = packed({3, 9}, 1) + packed({5}, 1)  # two rows
    assert grammar_choice(mask, 0, 2, 9) == 9
    assert grammar_choice(mask, 0, 2, 4) in (3, 9)
    assert grammar_choice(mask, 1, 2, 4) == 5


def test_every_row_constrained_masks_in_place():
    logits = torch.zeros(2, 40)
    apply_grammar_bitmask(logits, [packed({1, 39}, 2), packed({0}, 2)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 39]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]
