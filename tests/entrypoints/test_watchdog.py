"""The watchdog: open requests and no token computed for watchdog_timeout_s makes the engine
report itself stuck (health_error, /health 503 with the reason, a metric, one log line), and
recover once steps compute again; a healthy busy engine is never reported."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
from server_utils import make_fake_engine

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

VOCAB = 512


class BlockingRunner(FakeRunner):
    """A step that does not return until released (a hung kernel, a wedged device)."""

    def __init__(self) -> None:
        super().__init__(VOCAB)
        self.release = threading.Event()
        self.release.set()

    def execute_model(self, so):
        self.release.wait(10)
        return super().execute_model(so)


def _params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_a_hung_step_is_reported_and_recovery_clears_it(demo_tokenizer, caplog):
    runner = BlockingRunner()
    llm = AsyncLLM(make_fake_engine(demo_tokenizer, runner, num_gpu_blocks_override=64),
                   watchdog_timeout_s=0.3)
    app = build_app(llm)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            runner.release.clear()  # the next step hangs
            task = asyncio.create_task(_collect(llm.generate([1, 403, 407], _params(), "a")))
            await asyncio.sleep(0.6)
            health = await client.get("/health")  # answered at once: it never waits for the engine
            metrics_task = asyncio.create_task(llm.get_metrics())
            await asyncio.sleep(0.05)
            runner.release.set()
            metrics = await metrics_task
            tokens = await asyncio.wait_for(task, 10)
            after = await client.get("/health")
            return health, metrics, tokens, after

    health, metrics, tokens, after = asyncio.run(run())
    assert health.status_code == 503 and "stuck" in health.json()["error"]["message"]
    assert metrics["pagedllm:engine_stuck"] == 1.0
    assert len(tokens) == 4  # nothing lost once the step returned
    assert after.status_code == 200
    assert sum("the engine is stuck" in r.message for r in caplog.records) == 1


def test_idle_loop_with_open_requests_is_stuck(demo_tokenizer):
    """The wedge of issue 15: the scheduler says nothing is left while a stream still waits."""
    engine = make_fake_engine(demo_tokenizer, None, num_gpu_blocks_override=64)
    llm = AsyncLLM(engine, watchdog_timeout_s=0.2)

    async def run():
        engine.has_unfinished_requests = lambda: False  # a lost request: the loop goes idle
        gen = llm.generate([1, 403, 407], _params(), "ghost")
        task = asyncio.create_task(gen.__anext__())
        await asyncio.sleep(0.4)
        reason = llm.health_error()
        task.cancel()
        return reason

    reason = asyncio.run(run())
    assert reason is not None and "1 requests open" in reason


class SteadyRunner(FakeRunner):
    """Every step takes ``delay`` seconds: a model that computes, slowly but steadily."""

    def __init__(self, delay: float) -> None:
        super().__init__(VOCAB)
        self.delay = delay

    def execute_model(self, so):
        time.sleep(self.delay)
        return super().execute_model(so)


def test_busy_engine_is_not_stuck(demo_tokenizer):
    """Steps of 0.2 s for two and a half watchdog periods of 1 s, requests open at every probe: a
    watchdog that counted from the request's arrival, or from the last finished request, instead
    of from the last computed token, reports this engine. (A 0.5 s timeout left too little room
    for a stall of the loaded 2-core machine in the full suite: it once saw 1.1 s without a step.)"""
    timeout_s, step_s = 1.0, 0.2
    llm = AsyncLLM(make_fake_engine(demo_tokenizer, SteadyRunner(step_s), num_gpu_blocks_override=64),
                   watchdog_timeout_s=timeout_s)

    async def run():
        probes: list[tuple[str | None, int]] = []  # (health_error, requests still open) per probe
        # 8 requests x 16 tokens: ~17 steps of 0.2 s, longer than the probing below.
        tasks = [asyncio.create_task(_collect(llm.generate([1, 403, 407 + i], _params(16), f"r{i}")))
                 for i in range(8)]
        await asyncio.sleep(0.1)  # the requests are queued
        start = time.monotonic()
        while time.monotonic() - start < 2.5 * timeout_s:
            probes.append((llm.health_error(), sum(not t.done() for t in tasks)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return probes

    probes = asyncio.run(run())
    assert len(probes) >= 20
    assert all(open_requests > 0 for _, open_requests in probes), probes  # busy at every probe
    assert all(reason is None for reason, _ in probes), probes


async def _collect(gen) -> list[int]:
    tokens: list[int] = []
    async for out in gen:
        tokens = out.outputs[0].token_ids
    return tokens

