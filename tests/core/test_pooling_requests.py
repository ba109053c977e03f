"""Pooling requests in the scheduler: one rule, no prefix hit, finished with a vector; an encoder's
input never chunked, a generator's (pooling_chunks) chunked and capped while generation runs."""
from __future__ import annotations

import pytest
from core_helpers import (
    assert_all_free,
    expected_tokens,
    make_request,
    make_runner,
    make_scheduler,
    runner_output,
    step_with_stats,
)

from pagedllm.core.outputs import RunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.errors import ValidationError
from pagedllm.pooling_params import PoolingParams
from pagedllm.runner.fake import fake_pooled


def pooling_request(rid: str, prompt: list[int]) -> Request:
    # A pooling request samples nothing: it carries PoolingParams only.
    return Request(rid, prompt, None, arrival_time=float(len(rid)), pooling_params=PoolingParams(task="embed"))


def _pooled(so, vectors: dict[str, list[float]]) -> RunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return RunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[] for _ in ids], pooler_output=vectors)


def test_whole_input_in_one_step_then_finished_with_its_vector():
    sched = make_scheduler(max_num_batched_tokens=12, long_prefill_token_threshold=2)
    sched.add_request(pooling_request("a", list(range(1, 11))))  # 10 tokens: never capped at 2
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_new_reqs[0].pooling_params.task == "embed"
    assert so.scheduled_new_reqs[0].sampling_params is None
    out = sched.update_from_output(so, _pooled(so, {"a": [0.5, -0.5]}))
    assert out.pooler_output == {"a": [0.5, -0.5]}
    assert out.finished == {"a": ("stop", None)}
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_not_chunked_waits_for_a_step_with_room():
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("gen", list(range(1, 9)), max_tokens=4))  # 8 tokens
    sched.add_request(pooling_request("pool", list(range(1, 7))))  # 6: does not fit the 4 left
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"gen": 8}
    out = sched.update_from_output(so, RunnerOutput(["gen"], {"gen": 0}, [[7]]))
    assert not out.pooler_output
    so = sched.schedule()  # the decode (1) and the whole pooling input (6)
    assert so.num_scheduled_tokens == {"gen": 1, "pool": 6}
    sched.check_integrity()


def test_no_prefix_hit_for_a_pooling_input():
    sched = make_scheduler()
    for rid in ("a", "bb"):
        sched.add_request(pooling_request(rid, list(range(1, 10))))
        so = sched.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 0
        assert so.num_scheduled_tokens == {rid: 9}
        sched.update_from_output(so, _pooled(so, {rid: [1.0]}))
    sched.check_integrity()


def test_too_long_inputs_name_both_numbers():
    sched = make_scheduler(max_model_len=16, max_num_batched_tokens=12)
    with pytest.raises(ValidationError, match="17 tokens but this model's maximum length is 16"):
        sched.add_request(pooling_request("a", [1] * 17))
    with pytest.raises(ValidationError, match="13 tokens but max_num_batched_tokens is 12"):
        sched.add_request(pooling_request("b", [1] * 13))
    sched.add_request(pooling_request("c", [1] * 12))  # the whole length fits: no output token needed
    assert sched.requests["c"].status == RequestStatus.WAITING


# -- a generator that pools too (pooling_chunks): inputs are prompts, chunked, capped while decoding --
def _run(sched, runner, steps: int = 200) -> tuple[dict[str, list[int]], dict[str, list[float]], list]:
    """Step to the end: generated tokens, vectors, and each step's num_scheduled_tokens."""
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, list[float]] = {}
    schedules = []
    for _ in range(steps):
        if not sched.has_unfinished_requests():
            return tokens, vectors, schedules
        so, outs = step_with_stats(sched, runner)
        schedules.append(dict(so.num_scheduled_tokens))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        vectors.update(outs.pooler_output)
    raise AssertionError(f"not finished after {steps} steps: {list(sched.requests)}")


def test_a_chunked_input_gives_the_vector_of_its_whole_input():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8, pooling_chunks=True)
    prompt = list(range(3, 23))  # 20 tokens: longer than a step's budget, accepted when chunked
    sched.add_request(pooling_request("p", prompt))
    _, vectors, schedules = _run(sched, make_runner(sched))
    assert schedules == [{"p": 8}, {"p": 8}, {"p": 4}]
    assert vectors == {"p": fake_pooled(prompt)}
    assert_all_free(sched)


def test_pooling_tokens_capped_while_generation_runs_and_tokens_unchanged():
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=32, max_pooling_tokens_while_decoding=3,
                           pooling_chunks=True)
    gens = [make_request(f"g{i}", list(range(10 + i, 18 + i)), max_tokens=12, ignore_eos=True) for i in range(2)]
    pools = {f"p{i}": list(range(40 + i, 60 + 6 * i)) for i in range(3)}  # 20, 25, 30 tokens
    for g in gens:
        sched.add_request(g)
    for rid, prompt in pools.items():
        sched.add_request(pooling_request(rid, prompt))
    expected = {g.request_id: expected_tokens(g) for g in gens}
    tokens, vectors, schedules = _run(sched, make_runner(sched))
    assert tokens == expected
    assert vectors == {rid: fake_pooled(prompt) for rid, prompt in pools.items()}
    # The first step prefills the prompts (nothing decodes yet); every step that decodes
    # holds at most 3 pooling tokens.
    assert sum(n for rid, n in schedules[0].items() if rid.startswith("p")) > 3
    decoding = [s for s in schedules[1:] if any(r.startswith("g") for r in s)]
    assert len(decoding) == 11
    assert all(sum(n for r, n in s.items() if r.startswith("p")) <= 3 for s in decoding), decoding
    assert any(sum(n for r, n in s.items() if r.startswith("p")) == 3 for s in decoding)
    # Once generation is done, the pooling inputs left take the whole budget again.
    tail = [s for s in schedules if not any(r.startswith("g") for r in s)]
    assert tail and sum(tail[0].values()) > 3
    assert_all_free(sched)


def test_a_pooling_input_skipped_for_its_budget_lets_generation_in():
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=32, max_pooling_tokens_while_decoding=4,
                           pooling_chunks=True)
    sched.add_request(make_request("g0", [1, 2, 3], max_tokens=4))
    so = sched.schedule()
    sched.update_from_output(so, runner_output({"g0": [5]}))
    sched.add_request(pooling_request("p0", list(range(1, 11))))
    sched.add_request(pooling_request("p1", list(range(1, 11))))
    sched.add_request(make_request("g1", [7, 8, 9], max_tokens=4))
    so = sched.schedule()  # p0 takes the 4 pooling tokens; p1 waits; g1 is admitted past it
    assert so.num_scheduled_tokens == {"g0": 1, "p0": 4, "g1": 3}
    assert so.skipped_req_ids == ["p1"]
    sched.check_integrity()


def test_without_pooling_chunks_the_cap_never_applies():
    sched = make_scheduler(max_num_batched_tokens=32, max_pooling_tokens_while_decoding=2)
    sched.add_request(make_request("g", [1, 2, 3], max_tokens=4))
    so = sched.schedule()
    sched.update_from_output(so, runner_output({"g": [5]}))
    sched.add_request(pooling_request("p", list(range(1, 11))))
    assert sched.schedule().num_scheduled_tokens == {"g": 1, "p": 10}


def test_a_chunked_input_of_the_whole_model_length_finishes():
    sched = make_scheduler(max_model_len=16, max_num_batched_tokens=8, pooling_chunks=True)
    prompt = list(range(1, 17))  # max_model_len tokens: nothing is sampled after them
    sched.add_request(pooling_request("p", prompt))
    _, vectors, schedules = _run(sched, make_runner(sched), steps=5)
    assert schedules == [{"p": 8}, {"p": 8}] and vectors == {"p": fake_pooled(prompt)}
    assert_all_free(sched)
