"""The scheduler runs at most max_loras adapters at once: a request with another adapter waits
(like one that does not fit the cache) until a running adapter's requests finish; base requests
and requests of a running adapter are admitted meanwhile. Adapters also key the prefix cache."""
from __future__ import annotations

from core_helpers import make_runner, run_to_completion, step, step_with_stats

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

A, B, C = (LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc"))


def _request(rid: str, lora: LoRARequest | None, max_tokens: int, prompt=(1, 2, 3)) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=float(rid[-1]), lora_request=lora)


def test_at_most_max_loras_adapters_run_at_once():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), 40, 4, 64, max_loras=2)
    runner = make_runner(sched)
    for rid, lora, n in (("r1", A, 2), ("r2", B, 6), ("r3", C, 2), ("r4", None, 2), ("r5", A, 2)):
        sched.add_request(_request(rid, lora, n))
    so, outs = step_with_stats(sched, runner)
    stats = outs.scheduler_stats  # what metrics' lora_requests_info shows
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ({"a": 2, "b": 1}, {"c": 1})
    # C would be a third adapter: r3 waits; the base request and A's second one go past it.
    assert list(so.num_scheduled_tokens) == ["r1", "r2", "r4", "r5"]
    assert so.skipped_req_ids == ["r3"]
    assert [r.lora_request for r in so.scheduled_new_reqs] == [A, B, None, A]
    so, _ = step(sched, runner)  # r1, r4 and r5 finish their second token here
    assert "r3" not in so.num_scheduled_tokens
    so, _ = step(sched, runner)  # A's requests are done: C gets A's slot
    assert list(so.num_scheduled_tokens) == ["r2", "r3"]
    run_to_completion(sched, runner)
    sched.check_integrity()


def test_adapters_key_the_prefix_cache():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), 40, 4, 64, max_loras=2)
    runner = make_runner(sched)
    prompt = list(range(10, 23))  # three full blocks
    sched.add_request(_request("p0", A, 1, prompt))
    run_to_completion(sched, runner)
    kv = sched.kv_cache_manager
    hits = {name: kv.get_computed_blocks(_request("p1", lora, 1, prompt))[1]
            for name, lora in (("a", A), ("b", B), ("base", None))}
    assert hits == {"a": 12, "b": 0, "base": 0}
