"""A mixed batch samples its random rows only: greedy rows skip temperature, filters and softmax."""
from __future__ import annotations

import torch

from pagedllm.runner.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from tests.runner.sampling_reference import reference_metadata

V = 300


def _build(params: list[SamplingParams], generators: list[torch.Generator | None]) -> SamplingMetadata:
    n = len(params)
    return reference_metadata(params, [[]] * n, [[]] * n, generators, [frozenset()] * n, V, "cpu")


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_softmax_sees_only_the_random_rows(monkeypatch):
    seen: list[int] = []
    real = torch.softmax

    def counting_softmax(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "softmax", counting_softmax)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.8, top_k=20, top_p=0.9)]
    logits = torch.randn(4, V, generator=_seeded(0))
    out = Sampler()(logits, _build(params, [None, None, None, _seeded(1)]))
    assert seen == [1]
    assert out.sampled_token_ids[:3] == logits[:3].argmax(dim=-1).tolist()


def test_a_seeded_row_draws_the_same_token_alone_or_among_greedy_rows():
    random_params = SamplingParams(temperature=1.3, top_p=0.95, min_p=0.01, seed=7)
    logits = torch.randn(5, V, generator=_seeded(3))
    for seed in range(20):
        alone = Sampler()(logits[2:3], _build([random_params], [_seeded(seed)]))
        params = [SamplingParams(temperature=0.0)] * 2 + [random_params] + [SamplingParams(temperature=0.0)] * 2
        gens = [None, None, _seeded(seed), None, None]
        mixed = Sampler()(logits, _build(params, gens))
        assert mixed.sampled_token_ids[2] == alone.sampled_token_ids[0]
        assert [mixed.sampled_token_ids[i] for i in (0, 1, 3, 4)] == logits[[0, 1, 3, 4]].argmax(dim=-1).tolist()
