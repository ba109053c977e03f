"""Regression of issue 15's critical bug: an aborted n > 1 request left its children in the
scheduler's queues (ghost "running" requests, KV usage that never went back to 0, and finally a
wedged engine), when the client left while the group was waiting, or Ctrl-C hit LLM.generate.

* Served: 128 streaming clients, each n = 4 and max_tokens 200, half of them leaving mid-stream
  (after a few events, or before the first one while the request still waits), run twice against
  an in-process app over a FakeRunner engine (the real scheduler, tokens that cost nothing).
  After each round: running = waiting = 0 and KV usage 0 on /metrics, check_integrity(), every
  block free, and a fresh request completes.
* Offline: LLM.generate(n=4) with max_num_seqs=16 interrupted by Ctrl-C, and requests aborted
  between steps whatever state their children are in: nothing is left behind.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from chaos_mix import idle_leaks, wait_idle
from server_utils import ServerThread, make_fake_engine

from pagedllm import SamplingParams

ROUNDS = 2


def _assert_engine_idle(engine) -> None:
    scheduler = engine.scheduler
    scheduler.check_integrity()
    assert not engine.has_unfinished_requests()
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == engine.num_blocks


async def _client(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> tuple[bool, list]:
    """One n = 4 stream; every other client leaves early. Returns (left, finish reasons)."""
    leaves = i % 2 == 1
    cut_after = rng.randint(0, 30)  # events before leaving
    give_up_s = rng.uniform(0.02, 1.5)  # or this long, whichever comes first (queued groups too)
    body = {"prompt": f"Once upon a time {i}", "n": 4, "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": i}
    finishes: dict[int, str] = {}

    async def consume() -> None:
        events = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if leaves and events >= cut_after:
                    return  # closing the response mid-stream drops the connection
                events += 1
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    if c.get("finish_reason"):
                        finishes[c["index"]] = c["finish_reason"]

    if not leaves:
        await consume()
        return False, [finishes.get(k) for k in range(4)]
    try:
        await asyncio.wait_for(consume(), give_up_s)
    except asyncio.TimeoutError:
        pass
    return True, []


async def _round(url: str, seed: int, num_clients: int) -> list[tuple[bool, list]]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        return list(await asyncio.gather(*(_client(client, url, i, rng) for i in range(num_clients))))


# The size (128 clients, ~50k streamed tokens a round) takes ~40 s on two shared cores:
# it runs with the slow tests; 32 clients keep every state (waiting groups, preemption, cuts
# before and after the first event) in the fast suite.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_clients", [32, pytest.param(128, marks=pytest.mark.slow)])
def test_n4_streams_with_disconnects_leave_nothing_behind(demo_tokenizer, num_clients):
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.server_options import ServerOptions

    # 16-token blocks: a 4-way group at 200 tokens holds ~52 blocks, so 640 blocks keep about
    # 48 sequences resident: groups wait, and running ones are preempted as they grow.
    engine = make_fake_engine(demo_tokenizer, None, num_gpu_blocks_override=640, block_size=16,
                              max_num_seqs=64)
    llm = AsyncLLM(engine)
    srv = ServerThread(build_app(llm, ["demo"], options=ServerOptions())).start()
    try:
        for k in range(ROUNDS):
            results = asyncio.run(_round(srv.url, k, num_clients))
            stayed = [f for left, f in results if not left]
            assert len(stayed) == num_clients // 2
            assert all(f == ["length"] * 4 for f in stayed), stayed
            m = wait_idle(srv.url)
            assert not idle_leaks(m), (k, idle_leaks(m))
            assert m["vllm:num_preemptions_total"] > 0 or k > 0
            asyncio.run(llm.run(_assert_engine_idle, engine))  # on the engine thread, between steps
            fresh = httpx.post(srv.url + "/v1/completions", timeout=30,
                               json={"prompt": "Tom", "n": 4, "max_tokens": 8, "ignore_eos": True})
            assert fresh.status_code == 200
            assert [c["finish_reason"] for c in fresh.json()["choices"]] == ["length"] * 4
    finally:
        srv.stop()
    _assert_engine_idle(engine)


@pytest.fixture(scope="module")
def small_llm():
    from pagedllm import LLM
    from pagedllm.config import default_model

    return LLM(default_model(), max_num_seqs=16, num_gpu_blocks_override=160, block_size=4)


PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben", "Tom had a red ball."] * 4


def test_ctrl_c_in_generate_with_n4_leaves_nothing_behind(small_llm):
    engine = small_llm.llm_engine
    params = SamplingParams(n=4, max_tokens=200, ignore_eos=True, temperature=0.8, seed=1)
    real_step = engine.step
    for interrupt_at in (1, 4, 25):  # a leader still waiting, forked children, preempted ones
        calls = 0

        def step():
            nonlocal calls
            calls += 1
            if calls == interrupt_at:
                raise KeyboardInterrupt
            return real_step()

        engine.step = step
        try:
            with pytest.raises(KeyboardInterrupt):
                small_llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            del engine.step  # back to the class's method
        _assert_engine_idle(engine)
    out = small_llm.generate(PROMPTS[:2], SamplingParams(n=4, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs) for o in out] == [4, 4]
    assert all(len(c.token_ids) == 8 for o in out for c in o.outputs)
    _assert_engine_idle(engine)


def test_aborts_between_steps_whatever_the_children_do(small_llm):
    engine = small_llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(n=4, max_tokens=200, ignore_eos=True, temperature=0.8, seed=2)
    ids = [f"abort-{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, params)
    open_ids = list(ids)
    preempted = engine.get_metrics().get("pagedllm:num_preemptions", 0.0)
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if step in (0, 2, 10, 40, 120) and open_ids:  # waiting leaders, running and preempted groups
            victims = rng.sample(open_ids, min(3, len(open_ids)))
            engine.abort_request(victims)
            engine.abort_request(victims)  # idempotent
            open_ids = [r for r in open_ids if r not in victims]
            engine.scheduler.check_integrity()
        if step == 200:
            engine.abort_request(open_ids)  # whatever is left
    _assert_engine_idle(engine)
    assert engine.get_metrics().get("pagedllm:num_preemptions", 0.0) > preempted
