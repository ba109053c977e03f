"""Bad input: the right status, OpenAI's error object naming the field, and a server that keeps
serving."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_utils import HTTP

OK = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 4}
CHAT_OK = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return HTTP.post(f"{server.url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == {400: "BadRequestError", 401: "AuthenticationError",
                             404: "NotFoundError", 503: "ServiceUnavailableError"}[status]
    return error


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "demo", "prompt": ', None),  # invalid JSON
    ("/v1/completions", "[1, 2]", None),  # JSON, but not an object
    ("/v1/completions", {"model": "demo"}, "prompt"),  # missing field
    ("/v1/completions", '{"model": "demo", "prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", '{"model": "demo", "prompt": "x", "use_beam_search": true, "length_penalty": NaN}',
     "length_penalty"),
    ("/v1/completions", {**OK, "seed": 2 ** 63}, "seed"),  # outside int64, as vLLM
    ("/v1/completions", {**OK, "prompt": "a\ud800b"}, "prompt"),  # a lone surrogate
    ("/v1/completions", {**OK, "prompt": ["ok", "\udfff"]}, "prompt"),
    ("/v1/completions", {**OK, "stop": ["\ud800"]}, "stop"),
    ("/v1/completions", {**OK, "use_beam_search": True, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**OK, "use_beam_search": True, "n": 0}, "n"),  # not beam_width
    ("/v1/completions", {**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),  # an invalid schema
    ("/v1/completions", {**OK, "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("/v1/completions", {**OK, "guided_json": {"type": "object"}}, "guided_json"),
    # tools without tool_choice mean auto, which needs --enable-auto-tool-choice (vLLM's 400)
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/chat/completions", {**CHAT_OK, "use_beam_search": True, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "word " * 5000}]},
     "messages"),  # renders past max_model_len: the field the client sent, not "prompt"
    ("/v1/completions", {**OK, "max_tokens": "four"}, "max_tokens"),  # ill-typed
    ("/v1/completions", {**OK, "prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {**OK, "max_tokens": 0}, "max_tokens"),  # out of range
    ("/v1/completions", {**OK, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**OK, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**OK, "n": 0}, "n"),
    ("/v1/completions", {**OK, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {**OK, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {**OK, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "stop": [""]}, "stop"),
    ("/v1/completions", {**OK, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {**OK, "prompt": [5] * 600}, "prompt"),  # longer than the model allows
    ("/v1/completions", {**OK, "max_tokens": 600}, "max_tokens"),  # prompt + output too long
    ("/v1/completions", {**OK, "prompt": [100000]}, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", {**OK, "prompt": []}, "prompt"),
    ("/v1/completions", {**OK, "use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {**OK, "use_beam_search": True, "logprobs": 2}, "use_beam_search"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {**OK, "stream": True, "prompt": [5] * 600}, "prompt"),  # 400 before the stream
    ("/v1/chat/completions", {**CHAT_OK, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    _assert_error(_post(server, path, body), 400, param)


def test_unknown_model_is_404(server, client):
    _assert_error(_post(server, "/v1/completions", {**OK, "model": "gpt-4"}), 404, "model")
    _assert_error(_post(server, "/v1/chat/completions", {**CHAT_OK, "model": "gpt-4"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_unknown_route_is_404_error_object(server):
    r = HTTP.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_server_keeps_serving_after_errors(server, client):
    for _ in range(3):
        _post(server, "/v1/completions", {**OK, "prompt": [5] * 600})
        _post(server, "/v1/completions", "{oops")
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4
    assert HTTP.get(f"{server.url}/health").status_code == 200


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
