"""Data-parallel replicas (DPEngineCoreClient, DPRouter), FakeRunner behind each core process:
the routing rule exactly (least loaded, prefix affinity, its slack), outputs equal to one
in-process core, shared prefixes on one replica (its prefix-cache hit counter proves it),
unrelated requests spread, aborts reaching the owner, a killed replica failing every stream and
/health within a second, and shutdown reaping every replica by pid."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.dp_client import DPEngineCoreClient
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "executor"))  # spawn keeps sys.path
from executor_helpers import SlowFakeRunner, child_pids, workload  # noqa: E402

VOCAB = 1000
BLOCK = 4


def _engine(dp: int, runner: FakeRunner | None = None, max_num_seqs: int = 6,
            num_blocks: int = 40) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=64),
                          CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks),
                          SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs),
                          None, ParallelConfig(data_parallel_size=dp))
    info = ModelInfo(vocab_size=VOCAB, max_position_embeddings=64, eos_token_ids=frozenset({7}))
    return LLMEngine(config, runner=runner or FakeRunner(vocab_size=VOCAB), model_info=info,
                     load_tokenizer=False, multiprocess=False)


def _drain(engine: LLMEngine) -> dict[str, list[list[int]]]:
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [c.token_ids for c in out.outputs]
    assert not engine.has_unfinished_requests()
    return final


def _run_workload(engine: LLMEngine) -> dict[str, list[list[int]]]:
    for i, req in enumerate(workload()):
        engine.add_request(req.request_id, req.prompt_token_ids, SamplingParams(
            max_tokens=req.max_tokens, n=1 + i % 3, seed=i, temperature=0.0 if i % 2 else 1.0,
            detokenize=False))
    engine.abort_request(["r2", "r3"])
    return _drain(engine)


# -- the rule, exactly -----------------------------------------------------------------------
def test_router_least_loaded_then_prefix_affinity_within_the_slack():
    router = DPRouter(2, block_size=4, affinity_slack=4)
    shared = router.prefix_hash([1, 2, 3, 4, 9], None)
    assert router.prefix_hash([1, 2, 3], None) is None  # shorter than a block: no prefix
    assert router.prefix_hash([1, 2, 3, 4, 5], "salt") != shared  # the salt is part of it
    assert router.route(shared) == 0  # nobody holds it: least loaded, lowest index on a tie
    router.assign(0, ["a"], shared)
    assert router.load(0) == 4  # open, not reported running: waiting (weight 4)
    assert router.route(None) == 1  # unrelated: the least loaded
    assert router.route(shared) == 0  # 4 - 0 <= slack: the holder
    router.update_stats(0, num_running_reqs=1)
    assert router.load(0) == 1
    router.assign(0, ["b", "c"], shared)  # load 1 running + 2 waiting = 9
    assert router.load(0) == 9 and router.num_prefix_routed == [1, 0]
    assert router.route(shared) == 1  # 9 - 0 > slack: spills to the least loaded ...
    router.assign(1, ["d"], shared)
    assert router.prefix_holder[shared] == 1  # ... which holds the prefix from now on
    assert router.release(["a", "d", "a", "zz"]) == {0: ["a"], 1: ["d"]}  # idempotent
    assert router.num_open == [2, 0] and router.owner_of("b") == 0 and router.owner_of("a") is None


def test_outputs_match_one_in_process_core_and_unrelated_requests_spread():
    local = _engine(1)
    want = _run_workload(local)
    local.shutdown()
    engine = _engine(2)
    try:
        core = engine.engine_core
        assert isinstance(core, DPEngineCoreClient) and len(set(core.pids)) == 2
        assert _run_workload(engine) == want
        routed = [m["pagedllm:dp_requests_routed"] for m in core.get_metrics_per_engine()]
        assert sum(routed) == 12 and min(routed) >= 4, routed  # both replicas served
        assert core.router.num_open == [0, 0] and not core.router.owner  # every finish seen
        total = engine.get_metrics()
        assert total["pagedllm:num_requests_running"] == total["pagedllm:num_requests_waiting"] == 0
        assert total["pagedllm:num_gpu_blocks"] == 80 and engine.num_blocks == 40
        assert engine.reset_prefix_cache() is True
    finally:
        engine.shutdown()


def test_shared_prefix_requests_go_to_one_replica_and_hit_its_cache():
    engine = _engine(2)
    try:
        core = engine.engine_core
        params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
        engine.add_request("other", [900, 901, 902, 903, 904], params)  # replica 0 busy first
        shared = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
        for i in range(4):
            engine.add_request(f"p{i}", shared + [100 + i, 101], params)
            if i == 0:
                assert core.router.owner_of("p0") == 1  # the least loaded took the new prefix
            _drain(engine)
        assert core.router.num_routed == [1, 4] and core.router.num_prefix_routed == [0, 3]
        per_engine = core.get_metrics_per_engine()
        assert per_engine[0]["pagedllm:prefix_cache_hits"] == 0
        assert per_engine[1]["pagedllm:prefix_cache_hits"] == 3 * len(shared)  # p1..p3 hit
    finally:
        engine.shutdown()


def test_abort_reaches_the_replica_that_owns_the_request():
    engine = _engine(2, runner=SlowFakeRunner(0.005, vocab_size=VOCAB))
    try:
        core = engine.engine_core
        params = SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False, n=2)
        engine.add_request("keep", [10, 11, 12], params)
        engine.add_request("drop", [20, 21, 22], params)
        owner = core.router.owner_of("0_drop")
        assert owner is not None and owner != core.router.owner_of("0_keep")
        engine.step()
        engine.abort_request("drop")
        engine.abort_request("drop")  # idempotent
        assert core.router.num_open[owner] == 0
        metrics = core.get_metrics_per_engine()  # a call: it follows the abort on the socket
        assert metrics[owner]["pagedllm:num_requests_running"] == 0
        assert metrics[owner]["pagedllm:num_requests_waiting"] == 0
        assert metrics[1 - owner]["pagedllm:num_requests_running"] >= 1
        finished = _drain(engine)
        assert list(finished) == ["keep"] and all(len(t) == 50 for t in finished["keep"])
        assert core.get_metrics_per_engine()[owner]["pagedllm:num_requests_running"] == 0
    finally:
        engine.shutdown()


def test_admission_error_records_nothing():
    engine = _engine(2, num_blocks=8)
    try:
        with pytest.raises(ValidationError) as info:  # 8 blocks of 4 hold 32 tokens
            engine.add_request("big", list(range(10, 50)), SamplingParams(max_tokens=4))
        assert info.value.param is not None
        assert not engine.engine_core.router.owner and not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_a_killed_replica_fails_every_stream_and_health_within_a_second():
    async def scenario() -> None:
        llm = AsyncLLM(_engine(2, runner=SlowFakeRunner(0.05, vocab_size=VOCAB)))
        llm._owns_engine = True
        core = llm.engine.engine_core
        params = SamplingParams(max_tokens=55, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        streams = [await llm.add_request(f"s{i}", [10 + i, 11, 12], params) for i in range(4)]
        assert set(core.router.owner.values()) == {0, 1}
        await streams[0].__anext__()
        survivor = core.pids[0]
        os.kill(core.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        for stream in streams:  # the other replica's streams too: the engine is dead
            with pytest.raises(EngineDeadError, match="data-parallel replica 1 of 2 died.*SIGKILL"):
                async for _ in stream:
                    pass
        assert time.monotonic() - t0 < 30.0  # a second, usually: no hang, on a loaded machine too
        assert "data-parallel replica 1" in llm.health_error()
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", [10], params)
        await llm.shutdown()  # the survivor too
        assert not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE

    asyncio.run(scenario())


def test_shutdown_with_requests_in_flight_reaps_every_replica():
    before = child_pids()
    engine = _engine(2, runner=SlowFakeRunner(0.01, vocab_size=VOCAB))
    procs = [psutil.Process(pid) for pid in engine.engine_core.pids]
    assert {p.name() for p in procs} and all(p.is_running() for p in procs)
    for i in range(4):
        engine.add_request(f"r{i}", [10 + i, 11], SamplingParams(max_tokens=55, ignore_eos=True,
                                                                  detokenize=False))
    engine.step()
    engine.shutdown()
    psutil.wait_procs(procs, timeout=5)
    assert not any(p.is_running() for p in procs)
    assert child_pids() <= before


@pytest.mark.slow
def test_offline_llm_with_two_replicas_matches_one_on_the_demo_model():
    from pagedllm import LLM
    from pagedllm.config import default_model

    prompts = ["Once upon a time", "The little dog", "Once upon a time there was a girl", "Tom and"]
    params = SamplingParams(max_tokens=24, temperature=0)
    want = [o.outputs[0].token_ids for o in LLM(default_model()).generate(prompts, params)]
    llm = LLM(default_model(), data_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert llm.llm_engine.engine_core.router.num_routed == [2, 2]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_seeded_sampling_is_the_same_on_every_replica_on_the_demo_model():
    """The FakeRunner ignores seed and temperature, so only a real model shows that a seeded
    request samples from its own generator whatever replica serves it: seeded requests (n = 1
    and n = 2, temperature 0.9) over two replicas give what one in-process engine gives."""
    from pagedllm import LLM
    from pagedllm.config import default_model

    prompts = ["Once upon a time", "The little dog", "Once upon a time there was a girl", "Tom and"]
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=100 + i, n=1 + i % 2)
              for i in range(len(prompts))]
    local = LLM(default_model())
    want = [[c.token_ids for c in o.outputs] for o in local.generate(prompts, params)]
    greedy = [o.outputs[0].token_ids for o in local.generate(prompts, SamplingParams(max_tokens=24, temperature=0))]
    assert any(w[0] != g for w, g in zip(want, greedy)), "the seeded runs sampled nothing but greedy"
    llm = LLM(default_model(), data_parallel_size=2)
    try:
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == want
        routed = llm.llm_engine.engine_core.router.num_routed
        assert all(routed), routed  # both replicas sampled some of them
    finally:
        llm.llm_engine.shutdown()
