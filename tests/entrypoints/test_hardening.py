"""Hostile and careless clients: unknown fields, API keys on every state-changing route, the
per-key cache salt, body/header limits and timeouts, and the per-request caps."""
from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
from server_utils import HTTP, ServerThread, make_fake_engine, scrape

from pagedllm.config import default_model
from pagedllm.engine.model_info import ModelInfo
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.runner.fake import FakeRunner

OK = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 2}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_unknown_fields_are_accepted_and_logged_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="pagedllm.entrypoints.openai")
    extras = {"metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True,
              "reasoning_effort": "low", "zz_field_for_this_test": 1}
    for _ in range(2):
        r = HTTP.post(f"{server.url}/v1/completions", json={**OK, **extras})
        assert r.status_code == 200, r.text
        r = HTTP.post(f"{server.url}/v1/chat/completions", json={**CHAT, **extras})
        assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "zz_field_for_this_test" in rec.getMessage()]
    assert len(logged) == 1 and "ignored" in logged[0]


def test_known_fields_without_support_stay_400(server):
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                  json={**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = HTTP.post(f"{server.url}/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"},
                                                             "tool_choice": "none"})
    assert r.status_code == 200  # values that ask for nothing special are fine


def test_api_keys_guard_every_route_but_the_open_probes(fake_server):
    srv = fake_server(options=ServerOptions(api_keys=("k1", "k2")))
    url = srv.url
    for method, path, body in [("POST", "/reset_prefix_cache", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [5]}), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", OK)]:
        r = HTTP.request(method, f"{url}{path}", json=body)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert HTTP.request(method, f"{url}{path}", json=body, headers=_bearer("k2")).status_code == 200, path
    for path in ("/health", "/ping", "/version", "/metrics", "/openapi.json"):
        assert HTTP.get(f"{url}{path}").status_code == 200, path
    # Two Authorization headers: refused, whichever is right.
    r = HTTP.post(f"{url}/v1/completions", json=OK,
                  headers=[("Authorization", "Bearer wrong"), ("Authorization", "Bearer k1")])
    assert r.status_code == 400 and "Authorization" in r.json()["error"]["message"]


def test_cache_salt_per_key_separates_the_prefix_cache(fake_server):
    srv = fake_server(options=ServerOptions(api_keys=("alice", "bob"), cache_salt_per_key=True))
    body = {**OK, "prompt": list(range(10, 60)), "max_tokens": 1}

    def cached(key: str) -> int:
        r = HTTP.post(f"{srv.url}/v1/completions", json=body, headers=_bearer(key))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") > 0  # the same key hits its own cache
    assert cached("bob") == 0  # another key cannot see it


def test_body_size_limit_is_413(fake_server):
    srv = fake_server(options=ServerOptions(max_request_body_bytes=2000))
    big = {**OK, "prompt": "x" * 3000}
    r = HTTP.post(f"{srv.url}/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 500

    r = HTTP.post(f"{srv.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert HTTP.post(f"{srv.url}/v1/completions", json=OK).status_code == 200


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def test_stalled_body_is_408_and_stalled_headers_are_closed(fake_server):
    srv = fake_server(options=ServerOptions(request_body_timeout=0.5, request_header_timeout=0.5))
    with _raw(srv.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        start = time.monotonic()
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert time.monotonic() - start < 5
    with _raw(srv.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        start = time.monotonic()
        assert sock.recv(4096) == b""  # closed by the server
        assert time.monotonic() - start < 5
    assert HTTP.post(f"{srv.url}/v1/completions", json=OK).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**OK, "n": 5}, "n"),
    ("/v1/completions", {**OK, "prompt": ["a", "b", "c"], "n": 2}, "n"),  # n x prompts
    ("/v1/completions", {**OK, "n": 5, "use_beam_search": True}, "n"),  # the beam width
    ("/v1/chat/completions", {**CHAT, "n": 5}, "n"),
    ("/v1/completions", {**OK, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {**OK, "prompt_logprobs": 3}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
])
def test_per_request_caps(fake_server, path, body, param):
    srv = fake_server(options=ServerOptions(max_seqs_per_request=4, max_logprobs=2))
    r = HTTP.post(f"{srv.url}{path}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_default_sequence_cap_is_half_the_batch_at_most_64(server):
    cap = ServerOptions().seqs_per_request_cap
    assert cap(256) == 64 and cap(8) == 4 and cap(1) == 1
    r = HTTP.post(f"{server.url}/v1/completions", json={**OK, "n": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


class _SteppingRunner(FakeRunner):
    """A FakeRunner whose steps take a fixed time (a model that computes), so a 200-token request
    lasts seconds and 'finished before the big one' is a matter of steps, not of luck."""

    def __init__(self, vocab_size: int, delay: float) -> None:
        super().__init__(vocab_size)
        self.delay = delay

    def execute_model(self, so):
        time.sleep(self.delay)
        return super().execute_model(so)


def _wait_for(condition, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_largest_allowed_request_does_not_stall_a_small_one(demo_tokenizer):
    """The README's bound: a one-token request sent while the largest request the server accepts
    is decoding is admitted at the next step (the big one cannot hold every slot) and finishes
    while the big one is still running, within 20% of the big one's run time.

    max_num_seqs is 8, so without the per-request cap the largest accepted request (n=8) fills
    every slot and the small one waits for all its 200 steps: the test then fails. The largest
    n is found by asking the server, not assumed from the cap's rule."""
    max_num_seqs = 8
    runner = _SteppingRunner(ModelInfo.from_folder(default_model()).vocab_size, delay=0.02)
    engine = make_fake_engine(demo_tokenizer, runner, max_num_seqs=max_num_seqs,
                              num_gpu_blocks_override=512)  # roomy: no preemption muddles it
    srv = ServerThread(build_app(engine, ["demo"])).start()
    try:
        largest = next(n for n in range(max_num_seqs, 0, -1)
                       if HTTP.post(f"{srv.url}/v1/completions", json={**OK, "n": n, "max_tokens": 1}
                                    ).status_code == 200)
        assert 1 < largest < max_num_seqs, largest
        big_done: list[float] = []

        def big() -> None:
            r = HTTP.post(f"{srv.url}/v1/completions", timeout=120,
                          json={**OK, "n": largest, "max_tokens": 200, "ignore_eos": True})
            assert r.status_code == 200, r.text
            big_done.append(time.monotonic())

        big_start = time.monotonic()
        thread = threading.Thread(target=big)
        thread.start()
        # Every sample of the big request is decoding (forked and running) before the small one is sent.
        _wait_for(lambda: scrape(srv.url).get("vllm:num_requests_running") == largest,
                  what=f"{largest} running sequences")
        start = time.monotonic()
        r = HTTP.post(f"{srv.url}/v1/completions", json={**OK, "max_tokens": 1}, timeout=120)
        small_done = time.monotonic()
        assert r.status_code == 200, r.text
        # The big request's samples are all still decoding: the small one did not wait for them.
        assert scrape(srv.url)["vllm:num_requests_running"] >= largest and not big_done, \
            "the small request waited for the big one"
        thread.join(timeout=120)
        assert big_done, "the big request did not finish"
        assert small_done - start < 0.2 * (big_done[0] - big_start), (small_done - start, big_done[0] - big_start)
    finally:
        srv.stop()


def test_chat_beam_search(server):
    r = HTTP.post(f"{server.url}/v1/chat/completions", json={**CHAT, "use_beam_search": True, "n": 2,
                                                             "max_tokens": 4})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["message"]["content"] for c in choices)


def test_openai_client_lone_surrogate_is_a_400(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert HTTP.get(f"{server.url}/health").status_code == 200
