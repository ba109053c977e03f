"""AsyncLLM on a FakeRunner engine (deterministic tokens, real tokenizer): streams, concurrency,
aborts on cancellation, validation errors, a dying loop, shutdown, a responsive event loop."""
from __future__ import annotations

import asyncio
import time

import pytest
from server_utils import make_fake_engine

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.runner.fake import FakeRunner, fake_generate
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 512


def _params(max_tokens: int, kind=RequestOutputKind.DELTA, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw)


class SlowRunner(FakeRunner):
    """Sleeps in every step (a model that takes time), and can be told to fail."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(VOCAB)
        self.delay = delay
        self.fail = False

    def execute_model(self, so):
        if self.fail:
            raise RuntimeError("the accelerator fell off")
        time.sleep(self.delay)
        return super().execute_model(so)


@pytest.fixture
def make_llm(demo_tokenizer):
    def make(runner=None, **engine_args) -> AsyncLLM:
        return AsyncLLM(make_fake_engine(demo_tokenizer, runner, num_gpu_blocks_override=64, **engine_args))
    return make


def _assert_idle(llm: AsyncLLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0
    engine.scheduler.kv_cache_manager.check_integrity()
    assert not llm._streams


def test_stream_deltas_and_final_only(make_llm, demo_tokenizer):
    llm = make_llm()
    prompt_ids = [1, 403, 407, 261, 378]

    async def run():
        deltas = [out async for out in llm.generate(prompt_ids, _params(12), "a")]
        finals = [out async for out in llm.generate(prompt_ids, _params(12, RequestOutputKind.FINAL_ONLY), "b")]
        return deltas, finals

    deltas, finals = asyncio.run(run())
    expected = fake_generate(prompt_ids, 12, VOCAB, ignore_eos=True)
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected
    assert len(deltas) == 12 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == finals[0].outputs[0].text
    assert len(finals) == 1 and finals[0].outputs[0].token_ids == expected
    _assert_idle(llm)


def test_many_concurrent_streams(make_llm):
    llm = make_llm()
    prompts = [[1, 10 + i, 20 + i] for i in range(40)]

    async def one(i):
        return [t async for out in llm.generate(prompts[i], _params(5 + i % 7), f"r{i}")
                for t in out.outputs[0].token_ids]

    async def run():
        return await asyncio.gather(*(one(i) for i in range(40)))

    got = asyncio.run(run())
    for i, tokens in enumerate(got):
        assert tokens == fake_generate(prompts[i], 5 + i % 7, VOCAB, ignore_eos=True)
    _assert_idle(llm)


def test_validation_error_reaches_caller_and_engine_keeps_serving(make_llm):
    llm = make_llm()

    async def run():
        with pytest.raises(ValidationError) as e:
            async for _ in llm.generate([5] * 600, _params(4), "too-long"):
                pass
        assert e.value.param == "prompt"
        with pytest.raises(ValidationError):
            await llm.add_request("bad-temp", [1, 2], SamplingParams(temperature=-1))
        return [out async for out in llm.generate([1, 2, 3], _params(3), "ok")]

    outs = asyncio.run(run())
    assert outs[-1].finished and not llm.errored
    _assert_idle(llm)


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_leaving_a_stream_aborts_the_request(make_llm, how):
    llm = make_llm(SlowRunner(delay=0.002))

    async def consume(gen, n):
        got = 0
        async for _ in gen:
            got += 1
            if got == n and how == "aclose":
                break
        return got

    async def run():
        gen = llm.generate([1, 2, 3], _params(400), "long")
        if how == "aclose":
            await consume(gen, 3)
            await gen.aclose()
        else:
            task = asyncio.ensure_future(consume(gen, 10**6))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The abort lands before the next step: the engine goes idle without finishing it.
        for _ in range(100):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        others = [o async for o in llm.generate([4, 5], _params(3), "next")]
        return others

    others = asyncio.run(run())
    assert others[-1].finished
    assert llm.num_aborted_requests == 1
    assert llm.engine.get_metrics()["pagedllm:generation_tokens"] < 400
    _assert_idle(llm)


def test_loop_failure_kills_engine_and_fails_every_stream(make_llm):
    runner = SlowRunner(delay=0.001)
    llm = make_llm(runner)

    async def drain(rid):
        async for _ in llm.generate([1, 2, rid], _params(300), f"r{rid}"):
            await asyncio.sleep(0)

    async def run():
        tasks = [asyncio.ensure_future(drain(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        runner.fail = True
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", [1, 2], _params(2))
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "the accelerator fell off" in str(results[0])
    assert llm.errored and isinstance(llm.dead_error, EngineDeadError)


def test_shutdown_ends_open_streams(make_llm):
    llm = make_llm(SlowRunner(delay=0.002))

    async def run():
        task = asyncio.ensure_future(asyncio.gather(
            *(_drain(llm.generate([1, i], _params(400), f"s{i}")) for i in range(3)), return_exceptions=True))
        await asyncio.sleep(0.05)
        await llm.shutdown()
        return await asyncio.wait_for(task, timeout=10)

    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results)


async def _drain(gen):
    async for _ in gen:
        pass


def test_event_loop_stays_responsive_while_steps_run(make_llm):
    llm = make_llm(SlowRunner(delay=0.03))  # every step blocks its thread for 30 ms

    async def run():
        ticks = 0
        gen_task = asyncio.ensure_future(_drain(llm.generate([1, 2], _params(15), "slow")))
        start = time.monotonic()
        while not gen_task.done():
            await asyncio.sleep(0.002)
            ticks += 1
        await gen_task
        return ticks, time.monotonic() - start

    ticks, elapsed = asyncio.run(run())
    assert elapsed >= 0.4
    # With steps on the event loop the ticker would get about one tick per step (15).
    assert ticks > 40


def test_abort_from_outside_ends_the_stream(make_llm):
    llm = make_llm(SlowRunner(delay=0.002))

    async def run():
        stream = await llm.add_request("victim", [1, 2, 3], _params(400))
        first = await stream.__anext__()
        await llm.abort("victim")
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished and all(not o.finished for o in rest)
    assert llm.engine.get_metrics()["pagedllm:generation_tokens"] < 400
    _assert_idle(llm)


def test_a_duplicate_id_is_refused_and_the_first_stream_lives_on(make_llm):
    llm = make_llm()
    prompt_ids = [1, 403, 407]

    async def run():
        stream = await llm.add_request("dup", prompt_ids, _params(6, RequestOutputKind.FINAL_ONLY))
        with pytest.raises(ValidationError, match="request id 'dup' is already in use") as e:
            await llm.add_request("dup", [1, 2], _params(2))
        assert e.value.param == "request_id"
        return [out async for out in stream]

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == fake_generate(prompt_ids, 6, VOCAB, ignore_eos=True)
    _assert_idle(llm)
