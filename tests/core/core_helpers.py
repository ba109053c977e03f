"""Small builders shared by the core tests (tiny numbers: block_size 4, about 10 blocks)."""
from __future__ import annotations

import itertools

from pagedllm.config import SchedulerConfig
from pagedllm.core.outputs import EngineCoreOutput, EngineCoreOutputs, RunnerOutput, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.runner.fake import FakeRunner, fake_generate
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
VOCAB = 1000
_arrival = itertools.count()


def make_request(rid: str, prompt: list[int], max_tokens: int | None = 8, *,
                 eos: frozenset[int] = frozenset(), priority: int = 0,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 output_token_ids: list[int] | None = None, **sp_kwargs) -> Request:
    """A Request with a strictly increasing arrival time (so order never depends on the clock)."""
    sp = SamplingParams(max_tokens=max_tokens, **sp_kwargs)
    return Request(rid, prompt, sp, eos_token_ids=eos, priority=priority, cache_salt=cache_salt,
                   arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time,
                   output_token_ids=output_token_ids)


def make_scheduler(num_blocks: int = 10, block_size: int = BLOCK_SIZE, max_model_len: int = 64,
                   enable_caching: bool = True, sliding_windows: tuple[int | None, ...] = (None,),
                   pooling_chunks: bool = False, **sched_kwargs) -> Scheduler:
    sched_kwargs.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(**sched_kwargs), num_blocks, block_size, max_model_len,
                     enable_caching, sliding_windows, pooling_chunks=pooling_chunks)


def make_runner(sched: Scheduler, vocab_size: int = VOCAB) -> FakeRunner:
    """A FakeRunner checking every read against the scheduler's KV cache groups."""
    runner = FakeRunner(vocab_size=vocab_size, verify_kv=True,
                        sliding_windows=sched.kv_cache_manager.sliding_windows)
    kv = sched.kv_cache_manager
    runner.initialize_kv_cache(kv.num_blocks, kv.block_size)
    return runner


def step_with_stats(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    ro = runner.execute_model(so)
    outs = sched.update_from_output(so, ro)
    sched.check_integrity()
    return so, outs


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so, outs = step_with_stats(sched, runner)
    return so, list(outs)


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000,
                      results: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until no request is left; returns every request's generated tokens."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        _, outs = step(sched, runner)
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {list(sched.requests)}")


def expected_tokens(req: Request, vocab_size: int = VOCAB) -> list[int]:
    sp = req.sampling_params
    return fake_generate(req.prompt_token_ids, req.max_tokens, vocab_size, req.eos_token_ids,
                         sp.ignore_eos, sp.min_tokens, sp.all_stop_token_ids)


def runner_output(sampled: dict[str, list[int]]) -> RunnerOutput:
    """A hand-made RunnerOutput: request id -> the tokens 'sampled' for it this step."""
    ids = list(sampled)
    return RunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, [sampled[r] for r in ids])


def free_ids(sched_or_pool) -> list[int]:
    pool = getattr(sched_or_pool, "kv_cache_manager", sched_or_pool)
    pool = getattr(pool, "block_pool", pool)
    return pool.free_block_queue.block_ids()


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    sched.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert all(m.req_to_blocks == {} for m in kv.managers)
    assert kv.usage == 0.0
