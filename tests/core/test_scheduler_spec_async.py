"""Drafts under async scheduling, step by step: a step verifying drafts is scheduled past as if
every draft were accepted; the runner rolls the rejected ones back at once, the scheduler at the
step's update; only blocks of known (verified) tokens are published."""
from __future__ import annotations

from core_helpers import make_request, make_runner, make_scheduler

from pagedllm.runner.fake import fake_generate

VOCAB = 1000


def test_a_step_is_scheduled_past_drafts_in_flight():
    sched = make_scheduler(num_blocks=10, async_scheduling=True)
    runner = make_runner(sched)
    prompt = [1, 2, 3, 4, 5]
    req = make_request("x", prompt, max_tokens=12, ignore_eos=True)
    sched.add_request(req)
    want = fake_generate(prompt, 12, VOCAB)

    so1 = sched.schedule()  # the prompt; its first token in flight
    ro1 = runner.execute_model(so1)
    so2 = sched.schedule()  # that token, before it is known
    ro2 = runner.execute_model(so2)
    sched.update_from_output(so1, ro1)
    # Drafts after the token in flight: the first right, the second wrong.
    drafts = [want[2], (want[3] + 1) % VOCAB, 7]
    sched.set_draft_tokens("x", drafts)
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"x": 4} and so3.scheduled_spec_decode_tokens == {"x": drafts}
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_drafts_in_flight) == (10, 5, 3)
    # Block 1, positions 4..7 (the prompt's last token, a sampled one, one in flight, a draft): unpublished.
    assert sched.kv_cache_manager.managers[0].num_cached_blocks["x"] == 1
    ro3 = runner.execute_model(so3)
    assert ro3.sampled_token_ids == [[want[2], want[3]]]  # one draft accepted, then the target's token
    assert runner.requests["x"].num_computed_tokens == 8  # rolled back by the runner already
    sched.update_from_output(so2, ro2)
    so4 = sched.schedule()  # scheduled from the optimistic count: the runner starts 2 lower
    assert so4.scheduled_cached_reqs.num_computed_tokens == [10] and so4.num_scheduled_tokens == {"x": 1}
    ro4 = runner.execute_model(so4)  # raises if the runner's check or its KV disagree
    sched.update_from_output(so3, ro3)
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_drafts_in_flight) == (9, 1, 0)
    assert req.output_token_ids == want[:4]

    in_flight = (so4, ro4)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        ro = runner.execute_model(so)
        sched.update_from_output(*in_flight)
        in_flight = (so, ro)
    sched.update_from_output(*in_flight)
    assert req.output_token_ids == want
    sched.check_integrity()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 10
