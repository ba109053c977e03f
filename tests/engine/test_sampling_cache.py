"""The runner reuses a step's sampling metadata while its sampled rows stay the same."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.runner.sampler import SamplingMetadata

PROMPTS = [[1, 291], [1, 346, 394], [1, 342], [1, 261, 300]]


@pytest.fixture(scope="module")
def llm(demo_model_path):
    return LLM(demo_model_path, device="cpu", enforce_eager=True, max_num_seqs=3)


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    real, calls = SamplingMetadata.build, []

    def counting_build(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(SamplingMetadata, "build", staticmethod(counting_build))
    return calls


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_a_steady_batch_builds_its_metadata_once(llm, builds):
    params = [_greedy(12), SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), _greedy(12)]
    _tokens(llm, PROMPTS[:3], params)
    assert builds == [3]


def test_rows_that_change_rebuild_it(llm, builds):
    # The fourth request takes the first one's place: the same number of rows, other requests;
    # the random row moves from row 1 to row 0, and the greedy ones must stay greedy.
    alone = [_tokens(llm, [p], [_greedy(n)])[0] for p, n in zip(PROMPTS, (5, 0, 14, 8)) if n]
    builds.clear()
    params = [_greedy(5), SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True), _greedy(14), _greedy(8)]
    out = _tokens(llm, PROMPTS, params)
    assert [out[0], out[2], out[3]] == alone
    assert len(builds) >= 2


def test_rows_that_need_per_step_data_rebuild_every_step(llm, builds):
    params = [_greedy(6), SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)]
    _tokens(llm, PROMPTS[:2], params)
    assert builds == [2] * 6
