"""The engine core in its own process (MPEngineCoreClient) against the in-process EngineCore,
FakeRunner behind both: the same outputs (n > 1, aborts, async scheduling, the mp executor),
admission errors with their type, message and param, a killed core failing every stream within
a second, and shutdown reaping the core and its workers."""
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
from pagedllm.engine.core_client import MPEngineCoreClient, multiprocessing_enabled
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "executor"))  # spawn keeps sys.path
from executor_helpers import SlowFakeRunner, child_pids, workload  # noqa: E402

VOCAB = 1000


def _engine(multiprocess: bool, async_scheduling: bool = False, backend: str = "uni",
            runner: FakeRunner | None = None, num_blocks: int = 40) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                          SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6,
                                          async_scheduling=async_scheduling),
                          None, ParallelConfig(backend))
    info = ModelInfo(vocab_size=VOCAB, max_position_embeddings=64, eos_token_ids=frozenset({7}))
    return LLMEngine(config, runner=runner or FakeRunner(vocab_size=VOCAB), model_info=info,
                     load_tokenizer=False, multiprocess=multiprocess)


def _run(engine: LLMEngine, abort: bool) -> dict[str, list[list[int]]]:
    aborted = {"r2", "r3"} if abort else set()
    for i, req in enumerate(workload()):
        engine.add_request(req.request_id, req.prompt_token_ids, SamplingParams(
            max_tokens=req.max_tokens, n=1 + i % 3, seed=i, temperature=0.0 if i % 2 else 1.0,
            detokenize=False))
    # Aborted before any step: the same requests are gone in both engines, whatever the timing.
    engine.abort_request(sorted(aborted))
    final = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            final[out.request_id] = [c.token_ids for c in out.outputs]
    assert not engine.has_unfinished_requests()
    assert not aborted & final.keys()
    return final


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("abort", [False, True])
def test_outputs_match_in_process(async_scheduling, abort):
    local = _engine(False, async_scheduling)
    want = _run(local, abort)
    local.shutdown()
    remote = _engine(True, async_scheduling)
    try:
        assert isinstance(remote.engine_core, MPEngineCoreClient)
        assert remote.num_blocks == 40
        assert _run(remote, abort) == want
        metrics = remote.get_metrics()
        assert metrics["pagedllm:kv_cache_usage_perc"] == 0.0
        assert metrics["pagedllm:num_requests_running"] == metrics["pagedllm:num_requests_waiting"] == 0
        assert remote.reset_prefix_cache() is True
        assert remote.engine_core.step() is None  # nothing pending: at once
    finally:
        remote.shutdown()


def test_the_mp_executor_under_a_core_process_is_reaped():
    before = child_pids()
    engine = _engine(True, async_scheduling=True, backend="mp")
    core = psutil.Process(engine.engine_core.pid)
    assert len(core.children()) == 1  # its worker
    procs = [core, *core.children()]
    assert _run(engine, abort=False) == _run(_engine(False), abort=False)
    engine.shutdown()
    psutil.wait_procs(procs, timeout=5)
    assert not any(p.is_running() for p in procs)
    assert child_pids() <= before


def test_admission_errors_keep_type_message_and_param():
    local, remote = _engine(False, num_blocks=8), _engine(True, num_blocks=8)
    try:
        errors = []
        for engine in (local, remote):
            with pytest.raises(ValidationError) as info:  # 8 blocks of 4 hold 32 tokens
                engine.add_request("big", list(range(10, 50)), SamplingParams(max_tokens=4))
            errors.append((type(info.value), str(info.value), info.value.param))
            assert not engine.has_unfinished_requests()  # nothing queued
        assert errors[0] == errors[1]
        assert errors[0][2] is not None
        engine.add_request("ok", [10, 11, 12], SamplingParams(max_tokens=3, detokenize=False))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        local.shutdown()
        remote.shutdown()


def test_core_parts_are_attribute_errors_in_the_api_process():
    engine = _engine(True)
    try:
        for part in ("scheduler", "executor", "step_observers"):
            with pytest.raises(AttributeError, match="the engine core runs in another process"):
                getattr(engine, part)
            assert getattr(engine, part, None) is None  # the metrics' probe
    finally:
        engine.shutdown()
    assert isinstance(_engine(False).engine_core, EngineCore)


def test_the_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_ENABLE_MULTIPROCESSING", raising=False)
    assert multiprocessing_enabled() is False and multiprocessing_enabled(default=True) is True
    for value, want in (("1", True), ("true", True), ("0", False), ("off", False)):
        monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", value)
        assert multiprocessing_enabled(default=not want) is want


def _async_llm(delay_s: float) -> AsyncLLM:
    return AsyncLLM(_engine(True, runner=SlowFakeRunner(delay_s, vocab_size=VOCAB)))


def test_a_killed_core_fails_every_stream_within_a_second():
    async def scenario() -> None:
        llm = _async_llm(0.05)
        params = SamplingParams(max_tokens=55, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        streams = [await llm.add_request(f"s{i}", [10 + i, 11, 12], params) for i in range(3)]
        first = await streams[0].__anext__()  # running
        assert first.outputs[0].token_ids
        os.kill(llm.engine.engine_core.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for stream in streams:  # each fails (none runs to its 55 tokens)
            with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
                async for _ in stream:
                    pass
        assert time.monotonic() - t0 < 30.0  # a second, usually: no hang, on a loaded machine too
        assert "the engine is dead" in llm.health_error()
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", [10], params)
        await llm.shutdown()

    asyncio.run(scenario())


def test_an_idle_core_killed_turns_health_bad_within_a_second():
    async def scenario() -> None:
        llm = _async_llm(0.0)
        out = [o async for o in llm.generate([10, 11], SamplingParams(max_tokens=2, detokenize=False), "a")]
        assert out[-1].finished and llm.health_error() is None
        os.kill(llm.engine.engine_core.pid, signal.SIGKILL)
        t0 = time.monotonic()  # a second, usually; bounded generously for a loaded machine
        while llm.health_error() is None:
            assert time.monotonic() - t0 < 30.0, "health still good after the core died"
            await asyncio.sleep(0.01)
        assert "engine core process" in llm.health_error()
        await llm.shutdown()

    asyncio.run(scenario())


def test_an_idle_cores_worker_killed_turns_health_bad_within_seconds():
    """The idle core checks its workers (IDLE_HEALTH_CHECK_MS): no request is needed to notice."""
    async def scenario() -> None:
        llm = AsyncLLM(_engine(True, backend="mp"))
        out = [o async for o in llm.generate([10, 11], SamplingParams(max_tokens=2, detokenize=False), "a")]
        assert out[-1].finished and llm.health_error() is None
        core = psutil.Process(llm.engine.engine_core.pid)
        (worker,) = core.children()
        worker.kill()
        t0 = time.monotonic()
        while llm.health_error() is None:
            assert time.monotonic() - t0 < 3.0
            await asyncio.sleep(0.05)
        assert "killed by signal SIGKILL" in llm.health_error()
        await llm.shutdown()
        psutil.wait_procs([core], timeout=5)
        assert not core.is_running()

    asyncio.run(scenario())


def test_async_llm_streams_through_the_process_and_its_shutdown_reaps_it():
    async def scenario() -> None:
        llm = _async_llm(0.001)
        llm._owns_engine = True  # as from_engine_args builds it
        pid = llm.engine.engine_core.pid
        params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
        results = await asyncio.gather(*[_collect(llm.generate([10 + i, 11], params, f"g{i}"))
                                         for i in range(4)])
        assert all(len(r[-1].outputs[0].token_ids) == 8 for r in results)
        stream = await llm.add_request("open", [5, 6], params.clone(max_tokens=55))
        await stream.__anext__()
        await llm.shutdown()  # with a request in flight
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    asyncio.run(scenario())


async def _collect(gen):
    return [out async for out in gen]
