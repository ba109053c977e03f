"""The runner writes a sampled row's parameters when its request arrives or moves, not every step."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.runner.sampling_batch import SamplingBatch

PROMPTS = [[1, 291], [1, 346, 394], [1, 342], [1, 261, 300]]


@pytest.fixture(scope="module")
def llm(demo_model_path):
    return LLM(demo_model_path, device="cpu", enforce_eager=True, max_num_seqs=3)


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    real, calls = SamplingBatch._write_row, []

    def counting_write(self, i, state):
        calls.append(i)
        return real(self, i, state)

    monkeypatch.setattr(SamplingBatch, "_write_row", counting_write)
    return calls


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_a_steady_batch_writes_its_rows_once(llm, writes):
    params = [_greedy(12), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), _greedy(12)]
    _tokens(llm, PROMPTS[:3], params)
    assert writes == [0, 1, 2]


def test_rows_that_change_are_written_again(llm, writes):
    # The fourth request takes the first one's place: the same number of rows, other requests;
    # the random row moves from row 1 to row 0, and the greedy ones must stay greedy.
    alone = [_tokens(llm, [p], [_greedy(n)])[0] for p, n in zip(PROMPTS, (5, 0, 14, 8)) if n]
    writes.clear()
    params = [_greedy(5), SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True), _greedy(14), _greedy(8)]
    out = _tokens(llm, PROMPTS, params)
    assert [out[0], out[2], out[3]] == alone
    assert len(writes) > 3  # the first three rows, then the rows that moved or changed


def test_rows_that_need_per_step_data_are_not_written_again(llm, writes):
    params = [_greedy(6), SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)]
    first = _tokens(llm, PROMPTS[:2], params)
    assert writes == [0, 1]
    assert _tokens(llm, PROMPTS[:2], params) == first  # the seeded row's generator is per step
