"""The persistent batch's sampling rows: the same metadata as a build from scratch, with only
the rows whose request changed written again."""
from __future__ import annotations

import random

import torch

from pagedllm.runner.input_batch import CachedRequestState
from pagedllm.runner.sampler import SamplingMetadata
from pagedllm.runner.sampling_batch import SamplingBatch
from pagedllm.sampling_params import SamplingParams
from tests.runner.sampling_reference import reference_metadata

V = 50


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    if kind == 0:
        return SamplingParams(temperature=0.0, logprobs=rng.choice([None, 2]), min_tokens=rng.choice([0, 0, 3]))
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([-1, 5, 80]), top_p=rng.choice([1.0, 0.8]),
        min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, 7]), min_tokens=rng.choice([0, 2]),
        repetition_penalty=rng.choice([1.0, 1.2]) if kind == 2 else 1.0,
        frequency_penalty=rng.choice([0.0, 0.5]) if kind == 3 else 0.0,
        presence_penalty=0.3 if kind == 3 else 0.0, logit_bias={3: 1.5, 99: 2.0} if kind == 1 else None,
        logprobs=rng.choice([None, 0, 3]))


def _state(rng: random.Random, i: int) -> CachedRequestState:
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 5))]
    out = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
    return CachedRequestState(f"r{i}", prompt + out, len(prompt), _params(rng), [[0]], 0, frozenset({2}))


def _reference(rows, stream: int) -> tuple[SamplingMetadata, list]:
    """The metadata built from scratch, row by row (the runner's rule before the persistent batch)."""
    params, prompts, outputs, gens, masks = [], [], [], [], []
    for state, prefix, _ in rows:
        p = state.params
        num_output = len(state.token_ids) - state.num_prompt_tokens + len(prefix)
        params.append(p)
        prompts.append(state.token_ids[:state.num_prompt_tokens])
        outputs.append(state.output_token_ids + prefix)
        g = None
        if p.seed is not None and not p.sampling_type_greedy:
            g = torch.Generator()
            g.manual_seed(((p.seed * 1_000_003 + num_output) ^ (stream << 48)) % (1 << 63))
        gens.append(g)
        stop = p.all_stop_token_ids if p.ignore_eos else p.all_stop_token_ids | state.eos_token_ids
        masks.append(stop if num_output < p.min_tokens else frozenset())
    return reference_metadata(params, prompts, outputs, gens, masks, V, "cpu"), gens


def _same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, dict):  # row -> generator: the same stream state
        assert got.keys() == want.keys()
        for row in want:
            assert torch.equal(got[row].get_state(), want[row].get_state())
    else:
        assert got == want


def test_every_field_equals_a_build_from_scratch_as_rows_come_and_go():
    rng = random.Random(0)
    batch, live, next_id = SamplingBatch(V, torch.device("cpu"), stream=1), [], 0
    for _ in range(60):
        action = rng.randrange(4)
        if action == 0 or not live:
            live.insert(rng.randint(0, len(live)), _state(rng, next_id))
            next_id += 1
        elif action == 1:
            live.pop(rng.randrange(len(live)))
        elif action == 2:
            rng.shuffle(live)
        for state in live:  # a decode step: one more output token
            state.token_ids.append(rng.randrange(V))
        rows = [(s, [rng.randrange(V)] * rng.randint(0, 1), r) for r, s in enumerate(live)]
        if not rows:
            continue
        (md, gens), (want, want_gens) = batch.prepare(rows), _reference(rows, stream=1)
        for field in SamplingMetadata.__slots__:
            _same(getattr(md, field), getattr(want, field))
        assert [g is None for g in gens] == [g is None for g in want_gens]


def test_only_rows_whose_request_changed_are_written():
    rng = random.Random(1)
    batch, states = SamplingBatch(V, torch.device("cpu")), [_state(rng, i) for i in range(5)]
    batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert batch.rows_written == 5
    batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert batch.rows_written == 5  # a steady batch writes nothing
    states[2] = _state(rng, 9)
    batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert batch.rows_written == 6  # one request replaced: its row only
    states.pop()  # the last row finishes: the others stay where they were
    batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert batch.rows_written == 6
    states.pop(0)  # the first finishes: the three behind it move up a row
    batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert batch.rows_written == 9


def test_a_steady_greedy_batch_keeps_its_metadata():
    rng = random.Random(2)
    states = [CachedRequestState(f"g{i}", [1, 2], 1, SamplingParams(temperature=t), [[0]], 0, frozenset())
              for i, t in enumerate((0.0, 0.7, 0.0))]
    batch = SamplingBatch(V, torch.device("cpu"))
    first, _ = batch.prepare([(s, [], r) for r, s in enumerate(states)])
    states[0].token_ids.append(rng.randrange(V))
    second, _ = batch.prepare([(s, [], r) for r, s in enumerate(states)])
    assert second is first and first.random_rows == [1]
