"""Pooling requests in the scheduler: one rule, never chunked, no prefix hit, finished with a vector."""
from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler

from pagedllm.core.outputs import RunnerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.errors import ValidationError
from pagedllm.pooling_params import PoolingParams


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
