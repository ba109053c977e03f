"""The compiled graph's loop threads (runner/loop_threads.py): a model whose widest row is under
inductor's per-thread chunk gets one thread, a wider one inductor's default; one thread in torch
leaves nothing to decide."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor import config

from pagedllm.runner.loop_threads import loop_threads, widest_row


class _Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, vocab: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)
        self.lm_head = nn.Linear(hidden, vocab)  # outside the compiled forward: not counted


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_widest_row_leaves_the_logits_head_out():
    assert widest_row(_Block(64, 172, 32000)) == 344


def test_one_thread_for_a_tiny_model_only(four_threads):
    chunk = config.cpp.min_chunk_size * 4
    assert loop_threads(_Block(64, 172, 32000)) == 1  # the demo model's shape
    assert loop_threads(_Block(64, (chunk - 2) // 2, 8)) == 1
    assert loop_threads(_Block(64, chunk // 2, 8)) is None
    assert loop_threads(_Block(1024, 2816, 8)) is None


def test_nothing_to_decide_on_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert loop_threads(_Block(64, 172, 8)) is None
    finally:
        torch.set_num_threads(before)
