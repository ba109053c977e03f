"""greedy_sample: the chunked argmax gives exactly torch.argmax's indices (first maximum wins)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.runner.sampler import greedy_sample


@pytest.mark.parametrize("vocab", [96, 256, 1000, 32000])
def test_matches_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(33, vocab, generator=gen)
    logits[1] = 0.0                                      # all tied: index 0
    logits[2, [5, vocab // 2, vocab - 1]] = 50.0         # ties across chunks: the first
    logits[3, [vocab - 2, vocab - 1]] = 50.0             # ties inside the last chunk
    logits[4] = float("-inf")
    logits[5, vocab - 1] = float("inf")
    logits[6, 3] = float("nan")                          # argmax treats NaN as the maximum
    assert torch.equal(greedy_sample(logits), logits.argmax(dim=-1))


def test_single_row_and_strided_input():
    logits = torch.randn(4, 2 * 32000)[:, ::2]           # not contiguous
    assert torch.equal(greedy_sample(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_sample(logits[:1]), logits[:1].argmax(dim=-1))
