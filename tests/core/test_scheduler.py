"""Scheduler driven directly with Request objects and the FakeRunner (or hand-made RunnerOutput).

Every scenario uses block_size 4 and a handful of blocks, and asserts exact per-step schedules.
"""
from __future__ import annotations

import random

import pytest
from core_helpers import (
    VOCAB,
    assert_all_free,
    expected_tokens,
    free_ids,
    make_request,
    make_runner,
    make_scheduler,
    run_to_completion,
    runner_output,
    step,
)

from pagedllm.core.request import RequestStatus
from pagedllm.errors import ValidationError
from pagedllm.runner.fake import fake_generate


def run_steps(sched, runner, n):
    """n steps; returns the per-step num_scheduled_tokens dicts."""
    return [dict(step(sched, runner)[0].num_scheduled_tokens) for _ in range(n)]


def collect(results, outs):
    for o in outs:
        results.setdefault(o.request_id, []).extend(o.new_token_ids)


# -- order and budgets ---------------------------------------------------------------------------
def test_running_first_then_waiting():
    sched = make_scheduler(max_num_batched_tokens=6)
    runner = make_runner(sched)
    a = make_request("a", [1, 2, 3, 4], 5)
    sched.add_request(a)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4}
    sched.add_request(make_request("b", list(range(10, 18)), 5))
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 5)]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [4]
    assert so.scheduled_cached_reqs.new_block_ids == [[[1]]]  # a's token 4 starts block 1
    assert so.total_num_scheduled_tokens == 6
    assert [o.request_id for o in outs] == ["a"]  # b is a partial prefill


def test_token_budget_chunks_concurrent_long_prompts():
    sched = make_scheduler(max_num_batched_tokens=6)
    runner = make_runner(sched)
    a = make_request("a", list(range(10)), 3)
    b = make_request("b", list(range(100, 110)), 3)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 6}
    ro = runner.execute_model(so)
    assert ro.sampled_token_ids == [[]]  # a partial prefill samples nothing
    assert not list(sched.update_from_output(so, ro))
    assert a.output_token_ids == [] and a.num_computed_tokens == 6
    assert run_steps(sched, runner, 5) == [
        {"a": 4, "b": 2},
        {"a": 1, "b": 5},
        {"a": 1, "b": 3},
        {"b": 1},
        {"b": 1},
    ]
    assert not sched.has_unfinished_requests()
    assert a.output_token_ids == expected_tokens(a)
    assert b.output_token_ids == expected_tokens(b)
    assert_all_free(sched)


def test_long_prefill_threshold_caps_one_requests_share():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    runner = make_runner(sched)
    sched.add_request(make_request("a", list(range(10)), 2))
    sched.add_request(make_request("b", list(range(100, 110)), 2))
    assert run_steps(sched, runner, 4) == [
        {"a": 4, "b": 4}, {"a": 4, "b": 4}, {"a": 2, "b": 2}, {"a": 1, "b": 1}]
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    runner = make_runner(sched)
    for rid, mt in (("a", 2), ("b", 3), ("c", 2)):
        sched.add_request(make_request(rid, [len(rid), 1, 2, 3], mt))
    assert run_steps(sched, runner, 4) == [
        {"a": 4, "b": 4}, {"a": 1, "b": 1}, {"b": 1, "c": 4}, {"c": 1}]
    assert not sched.has_unfinished_requests()


def test_budget_and_seq_limits_over_random_load():
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=7, max_num_seqs=3,
                           long_prefill_token_threshold=5)
    runner = make_runner(sched)
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 12))],
                         rng.randint(1, 6)) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched, runner)
        assert so.total_num_scheduled_tokens <= 7
        assert all(n <= 5 for n in so.num_scheduled_tokens.values())
        assert len(so.num_scheduled_tokens) <= 3
    assert runner.max_tokens_in_step == 7
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


# -- preemption ----------------------------------------------------------------------------------
def test_fcfs_preempts_most_recent_and_resumes_from_head():
    sched = make_scheduler(num_blocks=4, max_skip_ahead=0)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    a = make_request("a", [1, 2, 3, 4], 8)
    b = make_request("b", [5, 6, 7, 8], 8)
    sched.add_request(a)
    sched.add_request(b)
    results: dict[str, list[int]] = {}
    so, outs = step(sched, runner)
    collect(results, outs)
    assert (kv.get_block_ids("a")[0], kv.get_block_ids("b")[0]) == ([0], [1])
    for _ in range(4):  # steps 2..5: decode; the second block of each fills up
        so, outs = step(sched, runner)
        collect(results, outs)
        assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert (kv.get_block_ids("a")[0], kv.get_block_ids("b")[0]) == ([0, 2], [1, 3])
    assert free_ids(sched) == []
    c = make_request("c", [9, 9, 9, 9], 1)
    sched.add_request(c)

    # Step 6: a needs a third block; b (admitted last) is the victim.
    so, outs = step(sched, runner)
    collect(results, outs)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert kv.get_block_ids("a")[0] == [0, 2, 3]  # b's blocks, its tail first
    assert free_ids(sched) == [1]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b at the head
    assert [r.request_id for r in sched.running] == ["a"]

    # Steps 7, 8: b does not fit (and c may not skip past it); a finishes at step 8.
    for _ in range(2):
        so, outs = step(sched, runner)
        collect(results, outs)
        assert so.num_scheduled_tokens == {"a": 1}
        assert so.preempted_req_ids == set()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert free_ids(sched) == [3, 1, 2, 0]  # a's partial block 3 (no hash) first

    # Step 9: b resumes; its prompt block 1 is still cached, the rest is recomputed.
    so, outs = step(sched, runner)
    collect(results, outs)
    assert so.num_scheduled_tokens == {"b": 5, "c": 4}
    new_b, new_c = so.scheduled_new_reqs
    assert new_b.req_id == "b" and new_b.num_computed_tokens == 4
    assert new_b.block_ids == [[1, 3, 2]]
    assert len(new_b.output_token_ids) == 5  # sampled in steps 1..5, before the preemption
    assert new_b.output_token_ids == results["b"][:5]
    assert new_c.block_ids == [[0]]
    run_to_completion(sched, runner, results=results)
    for r in (a, b, c):
        assert results[r.request_id] == expected_tokens(r) == r.output_token_ids
    assert_all_free(sched)


def _two_requests_competing(policy):
    sched = make_scheduler(num_blocks=4, scheduling_policy=policy)
    runner = make_runner(sched)
    a = make_request("a", [1, 2, 3, 4], 8, priority=1)
    b = make_request("b", [5, 6, 7, 8], 8, priority=0)
    sched.add_request(a)
    step(sched, runner)  # a admitted alone
    sched.add_request(b)
    for _ in range(4):  # steps 2..5
        so, _ = step(sched, runner)
        assert so.preempted_req_ids == set()
    assert free_ids(sched) == []
    so, _ = step(sched, runner)  # step 6: a needs a third block
    return sched, runner, a, b, so


def test_fcfs_victim_is_most_recently_admitted():
    sched, runner, a, b, so = _two_requests_competing("fcfs")
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    run_to_completion(sched, runner)
    assert a.output_token_ids == expected_tokens(a)
    assert b.output_token_ids == expected_tokens(b)
    assert_all_free(sched)


def test_priority_victim_is_worst_priority_even_if_admitted_first():
    sched, runner, a, b, so = _two_requests_competing("priority")
    assert so.preempted_req_ids == {"a"}  # a preempts itself: it is the worst
    assert so.num_scheduled_tokens == {"b": 1}
    assert [r.request_id for r in sched.running] == ["b"]
    run_to_completion(sched, runner)
    assert a.output_token_ids == expected_tokens(a)
    assert b.output_token_ids == expected_tokens(b)
    assert a.num_preemptions >= 1 and b.num_preemptions == 0
    assert_all_free(sched)


def test_priority_victim_ties_broken_by_latest_arrival():
    sched = make_scheduler(num_blocks=6, scheduling_policy="priority")
    runner = make_runner(sched)
    # Same priority: y arrived later than x, though it is admitted in the same step.
    x = make_request("x", [1, 2, 3, 4], 8, arrival_time=1.0)
    y = make_request("y", [5, 6, 7, 8], 8, arrival_time=2.0)
    big = make_request("big", [9] * 8, 8, priority=-1, arrival_time=3.0)
    for r in (y, x, big):
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert [r.request_id for r in sched.running] == ["big", "x", "y"]
    preempted = []
    for _ in range(20):
        so, _ = step(sched, runner)
        preempted.extend(sorted(so.preempted_req_ids))
        if preempted:
            break
    assert preempted == ["y"]
    run_to_completion(sched, runner)
    for r in (x, y, big):
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


def test_waiting_request_never_preempts():
    sched = make_scheduler(num_blocks=4)
    runner = make_runner(sched)
    a = make_request("a", list(range(8)), 8)
    sched.add_request(a)
    step(sched, runner)
    b = make_request("b", list(range(50, 59)), 3)  # 9 tokens: 3 blocks, only 2 free
    sched.add_request(b)
    for i in range(7):  # steps 2..8: a runs to its end, b waits
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {"a": 1}, i
        assert so.preempted_req_ids == set()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_preemptions == 0
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"b": 9}
    assert b.num_preemptions == 0
    run_to_completion(sched, runner)
    assert b.output_token_ids == expected_tokens(b)
    assert_all_free(sched)


def test_victim_preempted_in_step_that_scheduled_it_unpublishes_uncomputed_blocks():
    # Priority policy: the victim may already have been scheduled (and its blocks published) in
    # the very step that preempts it; blocks whose KV was never computed must not stay cached.
    sched = make_scheduler(num_blocks=7, scheduling_policy="priority",
                           long_prefill_token_threshold=8)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    lo = make_request("lo", list(range(100, 124)), 2, priority=5)
    sched.add_request(lo)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"lo": 8}
    hi = make_request("hi", [1, 2, 3, 4], 4, priority=0)
    sched.add_request(hi)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"lo": 8, "hi": 4}
    assert kv.get_block_ids("lo")[0] == [0, 1, 2, 3] and kv.get_block_ids("hi")[0] == [4]
    # Step 3: lo's last chunk gets blocks 5 6 (published at allocation), then hi needs a block.
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"lo"}
    assert so.num_scheduled_tokens == {"hi": 1}
    # lo's uncomputed blocks 5 6, unpublished, are handed out first
    assert kv.get_block_ids("hi")[0] == [4, 5]
    assert free_ids(sched) == [6, 3, 2, 1, 0]
    assert pool.blocks[6].block_hash is None
    assert set(pool.cached_block_hash_to_block) == set(lo.block_hashes[:4]) | {hi.block_hashes[0]}
    run_to_completion(sched, runner)
    assert lo.output_token_ids == expected_tokens(lo)
    assert hi.output_token_ids == expected_tokens(hi)
    assert_all_free(sched)


# -- skip-ahead ----------------------------------------------------------------------------------
def test_skip_ahead_bounded_within_one_step():
    sched = make_scheduler(num_blocks=6, max_skip_ahead=1)
    runner = make_runner(sched)
    a = make_request("a", list(range(16)), 1)  # 4 blocks
    h = make_request("h", list(range(100, 112)), 1)  # 3 blocks: does not fit next to a
    s1 = make_request("s1", [7, 7, 7], 1)
    s2 = make_request("s2", [8, 8, 8], 1)
    for r in (a, h, s1, s2):
        sched.add_request(r)
    so, _ = step(sched, runner)
    # Only one request may pass h (max_skip_ahead=1), even within a single step.
    assert so.num_scheduled_tokens == {"a": 16, "s1": 3}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"h": 12, "s2": 3}
    assert not sched.has_unfinished_requests()
    assert_all_free(sched)


def test_skip_ahead_bounded_across_steps_then_head_runs():
    sched = make_scheduler(num_blocks=8, max_skip_ahead=2)
    runner = make_runner(sched)
    a = make_request("a", list(range(13)), 3)  # 4 blocks for its whole life
    h = make_request("h", list(range(100, 117)), 1)  # 5 blocks
    s = [make_request(f"s{i}", [i, i, i], 1) for i in (1, 2, 3)]
    for r in (a, h, s[0]):
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 13, "s1": 3}
    assert h.num_skipped_past == 1
    sched.add_request(s[1])
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "s2": 3}
    assert h.num_skipped_past == 2
    sched.add_request(s[2])
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}  # s3 fits but must wait for h now
    assert [r.request_id for r in sched.waiting] == ["h", "s3"]
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"h": 17, "s3": 3}
    assert not sched.has_unfinished_requests()
    for r in (a, h, *s):
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


def test_skip_ahead_zero_is_strict_head_of_line():
    sched = make_scheduler(num_blocks=6, max_skip_ahead=0)
    runner = make_runner(sched)
    for r in (make_request("a", list(range(16)), 1), make_request("h", list(range(100, 112)), 1),
              make_request("s", [1, 1, 1], 1)):
        sched.add_request(r)
    assert run_steps(sched, runner, 2) == [{"a": 16}, {"h": 12, "s": 3}]


# -- admission order -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy, order", [
    ("fcfs", ["r0", "r1", "r2", "r3"]),
    ("priority", ["r1", "r3", "r2", "r0"]),
])
def test_admission_order(policy, order):
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    runner = make_runner(sched)
    for rid, prio in (("r0", 2), ("r1", 0), ("r2", 1), ("r3", 0)):
        sched.add_request(make_request(rid, [1, 2, 3, 4], 1, priority=prio))
    admitted = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        admitted.extend(r.req_id for r in so.scheduled_new_reqs)
    assert admitted == order


# -- stop conditions (hand-made runner output, several tokens at once) ----------------------------
def _scheduled(req, **kw):
    sched = make_scheduler(**kw)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {req.request_id: req.num_prompt_tokens}
    return sched, so


def _apply(req, tokens, **kw):
    sched, so = _scheduled(req, **kw)
    outs = sched.update_from_output(so, runner_output({req.request_id: tokens}))
    return sched, outs


def _finished_ok(sched, req):
    assert req.request_id not in sched.requests
    assert sched.running == []
    assert req.request_id in sched.finished_req_ids
    assert_all_free(sched)


def test_min_tokens_suppresses_eos():
    req = make_request("r", [1, 2, 3], 8, eos=frozenset({9}), min_tokens=2)
    sched, outs = _apply(req, [9, 9, 5])
    assert len(outs) == 1
    assert outs[0].new_token_ids == [9, 9]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", None)
    assert req.output_token_ids == [9, 9] and req.all_token_ids == [1, 2, 3, 9, 9]
    assert outs.scheduler_stats.num_generation_tokens == 2
    _finished_ok(sched, req)


def test_min_tokens_suppresses_stop_token_ids():
    req = make_request("r", [1, 2, 3], 8, stop_token_ids=[8], min_tokens=2)
    _, outs = _apply(req, [8, 5, 8, 6])
    assert outs[0].new_token_ids == [8, 5, 8]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", 8)


def test_eos_checked_before_stop_token_ids():
    req = make_request("r", [1, 2, 3], 8, eos=frozenset({9}), stop_token_ids=[9])
    _, outs = _apply(req, [9])
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", None)


def test_first_stop_condition_in_sequence_wins():
    req = make_request("r", [1, 2, 3], 8, eos=frozenset({9}), stop_token_ids=[8])
    _, outs = _apply(req, [5, 9, 8])
    assert outs[0].new_token_ids == [5, 9] and outs[0].stop_reason is None
    req = make_request("r", [1, 2, 3], 8, eos=frozenset({9}), stop_token_ids=[8])
    _, outs = _apply(req, [5, 8, 9])
    assert outs[0].new_token_ids == [5, 8]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", 8)


def test_stop_token_beats_length_on_the_same_token():
    req = make_request("r", [1, 2, 3], 2, stop_token_ids=[8])
    _, outs = _apply(req, [5, 8])
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", 8)


def test_max_tokens_trims_surplus():
    req = make_request("r", [1, 2, 3], 2)
    sched, outs = _apply(req, [5, 6, 7])
    assert outs[0].new_token_ids == [5, 6]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("length", None)
    assert req.output_token_ids == [5, 6] and req.num_tokens == 5
    assert outs.scheduler_stats.num_generation_tokens == 2
    _finished_ok(sched, req)


def test_max_model_len_caps_when_max_tokens_unset():
    req = make_request("r", [1, 2, 3, 4, 5, 6], None)
    sched, so = _scheduled(req, max_model_len=10)
    assert req.max_tokens == 4
    outs = sched.update_from_output(so, runner_output({"r": [1, 2, 3, 4, 5]}))
    assert outs[0].new_token_ids == [1, 2, 3, 4]
    assert outs[0].finish_reason == "length"
    assert req.num_tokens == 10


def test_ignore_eos():
    req = make_request("r", [1, 2, 3], 3, eos=frozenset({9}), ignore_eos=True)
    _, outs = _apply(req, [9, 9, 9, 9])
    assert outs[0].new_token_ids == [9, 9, 9]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("length", None)


def test_not_stopped_keeps_running():
    req = make_request("r", [1, 2, 3], 8, eos=frozenset({9}))
    sched, outs = _apply(req, [4, 5])
    assert outs[0].new_token_ids == [4, 5] and outs[0].finish_reason is None
    assert req.status == RequestStatus.RUNNING and sched.running == [req]
    assert sched.finished_req_ids == set()


def test_no_output_for_request_missing_from_runner_output():
    req = make_request("r", [1, 2, 3], 8)
    sched, so = _scheduled(req)
    assert not list(sched.update_from_output(so, runner_output({})))
    assert req.output_token_ids == []


# -- abort ---------------------------------------------------------------------------------------
def test_abort_waiting_request():
    sched = make_scheduler()
    runner = make_runner(sched)
    a = make_request("a", [1, 2, 3], 4)
    sched.add_request(a)
    assert sched.finish_requests("a") == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.get_finished_reason() == "abort"
    assert len(sched.waiting) == 0 and not sched.has_unfinished_requests()
    assert sched.finish_requests("a") == []
    so, outs = step(sched, runner)
    assert so.is_empty and so.finished_req_ids == {"a"} and outs == []
    assert_all_free(sched)


def test_abort_running_frees_at_once_and_reaches_runner():
    sched = make_scheduler()
    runner = make_runner(sched)
    a = make_request("a", list(range(9)), 8)
    b = make_request("b", list(range(50, 55)), 3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv_cache_manager.get_block_ids("a")[0] == [0, 1, 2]
    assert sched.finish_requests(["a", "unknown"]) == [a]
    assert sched.finish_requests(["a"]) == []  # idempotent
    assert sched.kv_cache_manager.get_block_ids("a")[0] == []
    assert free_ids(sched) == [2, 5, 6, 7, 8, 9, 1, 0]  # the partial block 2 first
    sched.check_integrity()
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert "a" not in runner.requests
    assert so.num_scheduled_tokens == {"b": 1}
    so, _ = step(sched, runner)
    assert so.finished_req_ids == set()
    run_to_completion(sched, runner)
    assert b.output_token_ids == expected_tokens(b)
    assert_all_free(sched)


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    runner = make_runner(sched)
    a = make_request("a", [1, 2, 3], 4)
    sched.add_request(a)
    so = sched.schedule()
    ro = runner.execute_model(so)
    sched.finish_requests("a")
    assert not list(sched.update_from_output(so, ro))
    assert a.output_token_ids == []
    assert_all_free(sched)


def test_abort_preempted_request():
    sched, runner, a, b, so = _two_requests_competing("fcfs")
    assert b.status == RequestStatus.PREEMPTED
    assert sched.finish_requests("b") == [b]
    assert len(sched.waiting) == 0
    sched.check_integrity()
    so, _ = step(sched, runner)
    assert "b" in so.finished_req_ids
    run_to_completion(sched, runner)
    assert a.output_token_ids == expected_tokens(a)
    assert_all_free(sched)


# -- admission checks ----------------------------------------------------------------------------
def test_admission_rejects_impossible_requests():
    sched = make_scheduler(num_blocks=3, max_model_len=16)  # 12 cache tokens
    bad = [
        make_request("empty", [], 4),
        make_request("too_long", list(range(16)), 1),
        make_request("over_len", list(range(10)), 7),  # 17 > 16
        make_request("over_cache", list(range(10)), 6),  # 16 tokens: 4 blocks > 3
    ]
    for r in bad:
        with pytest.raises(ValidationError):
            sched.add_request(r)
    assert sched.requests == {} and len(sched.waiting) == 0
    ok = make_request("ok", list(range(10)), 3)  # 13 tokens, the last never written: 3 blocks
    sched.add_request(ok)
    with pytest.raises(ValidationError) as e:
        sched.add_request(make_request("ok", [1], 1))
    assert e.value.param == "request_id"
    assert list(sched.requests) == ["ok"] and len(sched.waiting) == 1
    run_to_completion(sched, make_runner(sched))
    assert ok.output_token_ids == expected_tokens(ok)


def test_unset_max_tokens_resolved_to_what_fits():
    sched = make_scheduler(num_blocks=3, max_model_len=64)
    r = make_request("r", [1, 2, 3, 4, 5], None)
    sched.add_request(r)
    assert r.max_tokens == 8  # cache 12 tokens + the never-written last one, minus the prompt
    sched = make_scheduler(num_blocks=30, max_model_len=16)
    r = make_request("r", [1, 2, 3, 4, 5], None)
    sched.add_request(r)
    assert r.max_tokens == 11
    runner = make_runner(sched)
    run_to_completion(sched, runner)
    assert r.output_token_ids == expected_tokens(r) and r.num_tokens == 16


# -- no leaks ------------------------------------------------------------------------------------
def test_everything_free_after_mixed_workload():
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=9, max_num_seqs=4)
    runner = make_runner(sched)
    rng = random.Random(1)
    bases = [[rng.randrange(1000) for _ in range(8)] for _ in range(2)]
    reqs = []
    for i in range(14):
        prompt = (rng.choice(bases)[: rng.randint(0, 8)]
                  + [rng.randrange(1000) for _ in range(rng.randint(1, 6))])
        reqs.append(make_request(f"r{i}", prompt, rng.randint(1, 10)))
        sched.add_request(reqs[-1])
    results = run_to_completion(sched, runner)
    for r in reqs:
        assert results[r.request_id] == expected_tokens(r)
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert any(r.num_cached_tokens > 0 for r in reqs)
    assert_all_free(sched)
    assert sched.reset_prefix_cache() is True


# -- sharing: fork + copy-on-write through the scheduler -----------------------------------------
def test_forked_samples_share_prompt_blocks_then_copy_on_write():
    sched = make_scheduler(num_blocks=10)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    p, c1, c2 = [make_request(rid, [1, 2, 3, 4, 5, 6], 4, ignore_eos=True, arrival_time=0.0)
                 for rid in ("p", "c1", "c2")]
    sched.add_request(p)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"p": 6}
    assert [o.request_id for o in outs] == ["p"]
    # The prompt is computed: the samples fork, sharing every block, the partial one included.
    sched.fork([("p", c1), ("p", c2)])
    assert [kv.get_block_ids(r)[0] for r in ("p", "c1", "c2")] == [[0, 1]] * 3
    assert [b.ref_cnt for b in kv.block_pool.blocks[:3]] == [3, 3, 0]
    assert [r.request_id for r in sched.running] == ["p", "c1", "c2"]
    assert (c1.num_computed_tokens, c2.num_computed_tokens) == (5, 5)
    sched.check_integrity()
    # Step 2: p writes its first output, each sample recomputes the last prompt token, all into
    # the shared partial block: p and c1 copy it; c2, the last holder, writes in place.
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"p": 1, "c1": 1, "c2": 1}
    assert so.block_copies == [(1, 2), (1, 3)]
    assert [kv.get_block_ids(r)[0] for r in ("p", "c1", "c2")] == [[0, 2], [0, 3], [0, 1]]
    assert [b.ref_cnt for b in kv.block_pool.blocks[:4]] == [3, 1, 1, 1]
    assert so.replaced_block_tables == {"p": [[0, 2]]}
    assert {r.req_id: (r.block_ids, r.num_computed_tokens) for r in so.scheduled_new_reqs} == {
        "c1": ([[0, 3]], 5), "c2": ([[0, 1]], 5)}
    run_to_completion(sched, runner)
    for r in (p, c1, c2):
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


def test_fork_without_a_free_slot_or_parent_kv_waits_and_recomputes():
    sched = make_scheduler(num_blocks=10, max_num_seqs=2)
    runner = make_runner(sched)
    p, c1, c2 = [make_request(rid, [1, 2, 3, 4, 5, 6], 3, arrival_time=0.0) for rid in ("p", "c1", "c2")]
    sched.add_request(p)
    step(sched, runner)
    sched.fork([("p", c1), ("p", c2)])
    assert [r.request_id for r in sched.running] == ["p", "c1"]
    assert list(sched.waiting) == [c2] and c2.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("c2")[0] == []
    ghost = make_request("g", [1, 2, 3, 4, 5, 6], 3)
    sched.fork([("gone", ghost)])  # the parent no longer exists: a plain waiting request
    assert list(sched.waiting) == [ghost, c2]
    sched.check_integrity()
    run_to_completion(sched, runner)
    for r in (p, c1, c2, ghost):
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


def test_fork_then_finish_replaces_sequences_like_a_beam_step():
    sched = make_scheduler(num_blocks=10)
    runner = make_runner(sched)
    a = make_request("a", [1, 2, 3, 4, 5], 6)
    sched.add_request(a)
    step(sched, runner)  # a computed 5 tokens and sampled one
    kv = sched.kv_cache_manager
    x = make_request("x", [1, 2, 3, 4, 5], 6, output_token_ids=[a.all_token_ids[5], 70])
    y = make_request("y", [1, 2, 3, 4, 5], 6, output_token_ids=[a.all_token_ids[5], 71])
    step(sched, runner)  # a's first output token is computed too
    sched.fork([("a", x), ("a", y)], finish=["a"])
    assert "a" not in sched.requests and "a" in sched.finished_req_ids
    assert [r.request_id for r in sched.running] == ["x", "y"]
    assert x.num_computed_tokens == y.num_computed_tokens == 6
    assert kv.get_block_ids("x")[0] == kv.get_block_ids("y")[0] == [0, 1]
    run_to_completion(sched, runner)
    for r in (x, y):
        assert r.output_token_ids[2:] == fake_generate(r.all_token_ids[:7], 4, VOCAB)
    assert_all_free(sched)
