"""Many clients at once, and clients that leave: every stream gets the right text, the metrics count
them, and a client that goes away mid-request has its request aborted and its KV blocks freed."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedllm import SamplingParams

PROMPTS = ["Once upon a time", "The cat sat on the mat.", "Tom", "Lily and Ben were friends.",
           "One day, a little boy named Tim", "There was a big tree in the garden.",
           "Sue had a red ball.", "The sun was hot and the sky was blue."]


def _wait_idle(metrics, url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_64_concurrent_streaming_clients(server, reference_llm, metrics):
    offline = reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    expected = [o.outputs[0].text for o in offline]
    before = metrics(server.url)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str, int]:
        text, chunks = "", 0
        body = {"model": "demo", "prompt": PROMPTS[i % 8], "max_tokens": 24, "temperature": 0,
                "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return i, text, chunks

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    for i, text, chunks in results:
        assert text == expected[i % 8], (i, text)
        assert chunks > 1  # streamed, not sent whole
    after = _wait_idle(metrics, server.url)
    done = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert done == 64
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "request_queue_time_seconds"):
        key = f"vllm:{name}_count"
        assert after[key] - before[key] == 64, name
    assert (after["vllm:inter_token_latency_seconds_count"]
            - before["vllm:inter_token_latency_seconds_count"]) > 64
    assert (after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
            == 8 * sum(len(o.outputs[0].token_ids) for o in offline))
    assert after["vllm:kv_cache_usage_perc"] == 0


def test_client_leaving_a_stream_aborts_its_request(server, metrics):
    before = metrics(server.url)
    body = {"model": "demo", "temperature": 0, "stream": True, "ignore_eos": True}

    async def stay(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with client.stream("POST", f"{server.url}/v1/completions",
                                 json={**body, "prompt": prompt, "max_tokens": 60}) as r:
            async for line in r.aiter_lines():
                text += line
        return text

    async def leave(client: httpx.AsyncClient) -> int:
        seen = 0
        async with client.stream("POST", f"{server.url}/v1/completions",
                                 json={**body, "prompt": "Once upon a time", "max_tokens": 400}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(leave(client), *(stay(client, p) for p in PROMPTS[:4]))

    seen, *texts = asyncio.run(run())
    assert seen == 3 and all(t.endswith("data: [DONE]") for t in texts)
    after = _wait_idle(metrics, server.url)
    assert (after["vllm:request_success_total{finished_reason=abort}"]
            - before["vllm:request_success_total{finished_reason=abort}"]) == 1
    assert after["vllm:kv_cache_usage_perc"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 4 * 60 + 200  # the leaver's 400 tokens were never all generated


def test_client_leaving_a_whole_request_aborts_it(server, metrics):
    """A non-streaming client leaves while its request runs. It leaves once the server reports
    the request running, not after a fixed time, which a fast machine outruns (500 tokens of the
    demo model can take under half a second)."""
    before = metrics(server.url)

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            post = asyncio.create_task(client.post(
                f"{server.url}/v1/completions",
                json={"model": "demo", "prompt": "Once upon a time", "max_tokens": 500,
                      "ignore_eos": True, "temperature": 0}))
            while (await asyncio.to_thread(metrics, server.url))["vllm:num_requests_running"] == 0:
                assert not post.done(), "the request ended before the server reported it running"
            post.cancel()  # drops the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(leave())
    after = _wait_idle(metrics, server.url, timeout=5)
    assert (after["vllm:request_success_total{finished_reason=abort}"]
            - before["vllm:request_success_total{finished_reason=abort}"]) == 1
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 500
