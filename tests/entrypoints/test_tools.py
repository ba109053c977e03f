"""Tool calling through the official openai client: tool_choice required and a named function
on the demo model (the grammar forces valid calls out of it), auto on the demo model (it writes
no call: plain content) and on a scripted model that writes hermes / llama3_json calls,
streaming and not; the chat template's tool rendering; the 400s and the CLI flags."""
from __future__ import annotations

import argparse
import json

import jsonschema
import openai
import pytest
from server_utils import HTTP, ServerThread
from tool_helpers import (
    MESSAGES,
    SCHEMAS,
    TOOL_TEMPLATE,
    TOOLS,
    auto_options,
    check_call,
    scripted_server,
    streamed_calls,
)

from pagedllm.config import default_model
from pagedllm.errors import PagedLLMError

WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server():
    """The demo model, the tool template, tool_choice auto on the hermes parser."""
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    llm = AsyncLLM.from_engine_args(default_model())
    srv = ServerThread(build_app(llm, ["demo"], chat_template=TOOL_TEMPLATE, options=auto_options())).start()
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", WEATHER_CHOICE])
def test_forced_tool_calls_parse_and_validate(tool_server, tool_choice, stream):
    """Sampled at temperature 1 with n=3: whatever the model picks, every call is a tool of the
    request with arguments its schema accepts, and the choice finishes with tool_calls."""
    kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                  temperature=1.0, seed=7, n=3, parallel_tool_calls=False)
    client = _client(tool_server)
    if not stream:
        out = client.chat.completions.create(**kwargs)
        assert len(out.choices) == 3
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            check_call(call.function.name, call.function.arguments)
            if tool_choice != "required":
                assert call.function.name == "get_weather"
        return
    for i in range(3):  # one choice at a time, so the stream's deltas are easy to check
        content, calls, reasons = streamed_calls(client.chat.completions.create(
            stream=True, **{**kwargs, "n": 1, "seed": 7 + i}))
        assert content == "" and reasons == ["tool_calls"] and list(calls) == [0]
        _, name, arguments = calls[0]
        check_call(name, arguments)


def test_required_parallel_calls(tool_server):
    """Without parallel_tool_calls=false the array may hold many calls; greedy, the demo model
    keeps adding calls until max_tokens. The whole reply returns the calls that closed before the
    cut (finish_reason length); the stream has sent the same calls by then (its last one may be
    cut off: its name went out before the cut)."""
    kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                  temperature=0)
    client = _client(tool_server)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert len(whole.message.tool_calls) >= 2
    for call in whole.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    _, calls, reasons = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert reasons == ["length"] and len(calls) in (len(whole.message.tool_calls), len(whole.message.tool_calls) + 1)
    assert [(name, json.loads(arguments)) for _, name, arguments in list(calls.values())[:len(whole.message.tool_calls)]
            ] == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_required_single_call_stays_one(tool_server):
    """parallel_tool_calls=false bounds the array to one call: it closes after it (tool_calls);
    cut inside that call, the reply has no complete call and is the raw text."""
    kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                  parallel_tool_calls=False)
    client = _client(tool_server)
    one = client.chat.completions.create(max_tokens=300, **kwargs).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    cut = client.chat.completions.create(max_tokens=6, **kwargs).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls and cut.message.content.startswith("[")


def test_auto_on_a_model_that_writes_no_call_is_content(tool_server):
    kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0)  # auto
    client = _client(tool_server)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content and not whole.message.tool_calls and whole.finish_reason == "length"
    content, calls, reasons = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, reasons) == (whole.message.content, {}, ["length"])
    plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert plain.message.content == whole.message.content


HERMES_REPLY = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
                '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>')
LLAMA3_REPLY = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 5}}; '
                '{"name": "get_time", "parameters": {"zone": "utc"}}')


@pytest.mark.parametrize("parser, reply, content, expected", [
    ("hermes", HERMES_REPLY, "Checking.",
     [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "cet"})]),
    ("llama3_json", LLAMA3_REPLY, None,
     [("get_weather", {"city": "Oslo", "days": 5}), ("get_time", {"zone": "utc"})]),
])
def test_auto_parses_the_models_calls(demo_tokenizer, parser, reply, content, expected):
    srv = scripted_server(demo_tokenizer, reply, parser)
    try:
        client = _client(srv)
        kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=200)
        whole = client.chat.completions.create(**kwargs).choices[0]
        # (The demo tokenizer puts a space before the reply's first word: compare stripped.)
        assert whole.finish_reason == "tool_calls" and _stripped(whole.message.content) == content
        assert [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls] == expected
        text, calls, reasons = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        assert (_stripped(text), reasons) == (content, ["tool_calls"])
        assert [(name, json.loads(args)) for _, name, args in calls.values()] == expected
        one = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
        assert [t.function.name for t in one.message.tool_calls] == ["get_weather"]
        _, calls, _ = streamed_calls(client.chat.completions.create(stream=True, parallel_tool_calls=False, **kwargs))
        assert [name for _, name, _ in calls.values()] == ["get_weather"]
        # tool_choice none: the same reply is plain text.
        plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
        assert plain.message.content.strip() == reply and not plain.message.tool_calls
        assert plain.finish_reason == "stop"
    finally:
        srv.stop()


def _stripped(text: str | None) -> str | None:
    return text.strip() or None if text is not None else None


def test_template_renders_tools_and_tool_history(tool_server, demo_tokenizer):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = HTTP.post(f"{tool_server.url}/v1/chat/completions", json={
        "model": "demo", "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = demo_tokenizer.decode(r.json()["prompt_token_ids"])
    assert "<tools>get_weather(city, days) get_time(zone) </tools>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in prompt
    assert "tool: <tool_response>sunny</tool_response>" in prompt


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not match"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tool_choice": "required", "use_beam_search": True}, "use_beam_search", "tool call"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", ""),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ""),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}], "tool_choice": "none"}, "messages", "not valid JSON"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tool_server, body, param, message):
    r = HTTP.post(f"{tool_server.url}/v1/chat/completions",
                  json={"model": "demo", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_required_with_defs_and_refs(fake_server):
    """A tool schema with $defs / $ref: they are lifted to the root of the required schema, so
    the references still resolve (vLLM's way); a FakeRunner picks the tokens."""
    schema = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
              "additionalProperties": False, "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}}
    srv = fake_server(chat_template=TOOL_TEMPLATE)
    tools = [*TOOLS, {"type": "function", "function": {"name": "set_unit", "parameters": schema}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        r = HTTP.post(f"{srv.url}/v1/chat/completions", json={
            "model": "demo", "messages": MESSAGES, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": False, "max_tokens": 150})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]),
                            schema if call["name"] == "set_unit" else SCHEMAS[call["name"]])
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 5}}}]
    r = HTTP.post(f"{srv.url}/v1/chat/completions", json={
        "model": "demo", "messages": MESSAGES, "tools": bad, "tool_choice": "required", "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_auto_needs_the_flags(fake_server):
    srv = fake_server(chat_template=TOOL_TEMPLATE)
    body = {"model": "demo", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5}
    for extra in ({}, {"tool_choice": "auto"}):  # auto is the default when tools are given
        r = HTTP.post(f"{srv.url}/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert r.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice '
                                                "and --tool-call-parser to be set")
    r = HTTP.post(f"{srv.url}/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 200, r.text  # required and named need no flag
    r = HTTP.post(f"{srv.url}/v1/chat/completions", json={**body, "tools": [], "tool_choice": "required"})
    assert r.status_code == 200, r.text  # no tools offered: OpenAI answers as with tool_choice none
    assert r.json()["choices"][0]["message"]["tool_calls"] == []


def test_cli_tool_flags():
    from pagedllm.entrypoints.serve_args import add_serve_args, check_compat_flags

    p = argparse.ArgumentParser()
    add_serve_args(p, {"tensor_parallel_size", "enforce_eager"})
    fields = {"tensor_parallel_size", "enforce_eager"}
    check_compat_flags(p.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]), fields)
    with pytest.raises(PagedLLMError, match="requires --tool-call-parser"):
        check_compat_flags(p.parse_args(["--enable-auto-tool-choice"]), fields)
    with pytest.raises(PagedLLMError, match=r"invalid tool call parser: mistral \(choose from"):
        check_compat_flags(p.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"]), fields)
