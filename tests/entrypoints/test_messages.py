"""Anthropic's Messages API with the official ``anthropic`` SDK against live servers: the demo
model (answers compared with the chat route's at the same prompt), every stream event parsed
(the SDK's and the raw server-sent events, ping included), stop sequences, forced tool calls and
a tool_result round trip, auto tool calls from a scripted model, count_tokens, keys and errors
in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_utils import ServerThread
from tool_helpers import TOOL_TEMPLATE, WEATHER, check_call, scripted_server

from pagedllm.entrypoints.anthropic.protocol import MessagesRequest
from pagedllm.entrypoints.anthropic.translate import to_chat_request
from pagedllm.entrypoints.openai.server_options import ServerOptions

KEY = "messages-key"
GREEDY = {"temperature": 0}  # the SDK's create() no longer names the sampling fields; the API has them
SYSTEM = "You tell short stories."
USER = [{"role": "user", "content": "Tell me about a cat"}]
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                              "required": ["zone"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def messages_server():
    """The demo model with the tool template, an API key, tool_choice auto on hermes."""
    from pagedllm.config import default_model
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    options = ServerOptions(api_keys=(KEY,), enable_auto_tool_choice=True, tool_call_parser="hermes")
    llm = AsyncLLM.from_engine_args(default_model())
    srv = ServerThread(build_app(llm, ["demo"], chat_template=TOOL_TEMPLATE, options=options)).start()
    yield srv
    srv.stop()


def _client(srv, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=kwargs.pop("api_key", KEY), max_retries=0, **kwargs)


def raw_events(url: str, body: dict, key: str = KEY) -> list[dict]:
    """Every server-sent event of a streamed request, checked to be Anthropic's framing: an
    ``event:`` line naming the ``type`` of its JSON ``data:`` line."""
    events = []
    body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for frame in r.read().decode().split("\n\n"):
            if not frame.strip():
                continue
            lines = dict(line.split(": ", 1) for line in frame.split("\n"))
            data = json.loads(lines["data"])
            assert data["type"] == lines["event"], frame
            events.append(data)
    return events


def check_event_order(events: list[dict]) -> list[dict]:
    """message_start, ping, then blocks (start, deltas of the block's kind, stop) numbered from
    0, then message_delta, message_stop; returns the blocks as the deltas build them."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks: list[dict] = []
    open_index = None
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            open_index = e["index"]
            blocks.append({**e["content_block"], "partial_json": ""})
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            block, delta = blocks[open_index], e["delta"]
            if block["type"] == "text":
                assert delta["type"] == "text_delta"
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta"
                block["partial_json"] += delta["partial_json"]
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index, e
            open_index = None
    assert open_index is None
    return blocks


def test_create_and_stream_match_chat_completions(messages_server):
    client = _client(messages_server)
    kwargs = dict(model="demo", max_tokens=24, system=SYSTEM, messages=USER, extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    chat = openai.OpenAI(base_url=f"{messages_server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="demo", max_tokens=24, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *USER])
    assert message.type == "message" and message.role == "assistant" and message.model == "demo"
    assert message.id.startswith("msg_") and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert (message.stop_reason, chat.choices[0].finish_reason) in (("max_tokens", "length"), ("end_turn", "stop"))
    count = client.messages.count_tokens(model="demo", system=SYSTEM, messages=USER).input_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == count
    assert count == chat.usage.prompt_tokens and message.usage.output_tokens == chat.usage.completion_tokens

    events = raw_events(messages_server.url, kwargs)
    blocks = check_event_order(events)
    assert blocks == [{"type": "text", "text": message.content[0].text, "partial_json": ""}]
    assert events[0]["message"]["usage"]["input_tokens"] == count
    assert events[-2]["delta"]["stop_reason"] == message.stop_reason
    assert events[-2]["usage"]["output_tokens"] == message.usage.output_tokens
    with client.messages.stream(**kwargs) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop", "text"} <= kinds
    assert final.content[0].text == message.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_stop_sequences(messages_server):
    client = _client(messages_server)
    kwargs = dict(model="demo", max_tokens=32, messages=USER, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[8:11]
    before = text[:text.index(stop)]
    message = client.messages.create(**kwargs, stop_sequences=["<never>", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == before
    events = raw_events(messages_server.url, {**kwargs, "stop_sequences": [stop]})
    assert check_event_order(events)[0]["text"] == before
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_forced_tool_call_round_trip(messages_server):
    client = _client(messages_server)
    kwargs = dict(model="demo", max_tokens=200, messages=USER, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"})
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    call = message.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    blocks = check_event_order(raw_events(messages_server.url, kwargs))
    assert [(b["type"], b["name"], json.loads(b["partial_json"])) for b in blocks] == [
        ("tool_use", "get_weather", call.input)]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"

    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny"}]}]}]
    reply = client.messages.create(**{**kwargs, "messages": history, "tool_choice": {"type": "none"},
                                      "max_tokens": 12})
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason in ("max_tokens", "end_turn")
    grown = client.messages.count_tokens(model="demo", messages=history, tools=TOOLS).input_tokens
    assert grown > client.messages.count_tokens(model="demo", messages=USER, tools=TOOLS).input_tokens

    one = client.messages.create(**{**kwargs, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert one.stop_reason == "tool_use" and len(one.content) == 1
    check_call(one.content[0].name, json.dumps(one.content[0].input))


def test_auto_tool_calls_from_the_model(demo_tokenizer):
    reply = ('Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
             '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>')
    srv = scripted_server(demo_tokenizer, reply)
    try:
        client = _client(srv, api_key="unused")
        kwargs = dict(model="demo", max_tokens=200, messages=USER, tools=TOOLS)  # tool_choice: auto
        message = client.messages.create(**kwargs)
        assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
                for b in message.content] == [
            ("text", " Checking. ", None, None),  # the text around the calls, as the chat route's
            ("tool_use", None, "get_weather", {"city": "Rome", "days": 2}),
            ("tool_use", None, "get_time", {"zone": "cet"})]
        assert message.stop_reason == "tool_use"
        blocks = check_event_order(raw_events(srv.url, kwargs, key="unused"))
        assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
        assert blocks[0]["text"] == message.content[0].text
        assert [json.loads(b["partial_json"]) for b in blocks[1:]] == [b.input for b in message.content[1:]]
    finally:
        srv.stop()


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "claude-x", "max_tokens": 4, "messages": USER}, 404, "not_found_error", "does not exist"),
    ({"model": "demo", "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AA", "media_type": "image/png"}}]}]},
     400, "invalid_request_error", "'image' are not supported"),
    ({"model": "demo", "max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                                    "name": "web_search"}]},
     400, "invalid_request_error", "server tools"),
    ({"model": "demo", "max_tokens": 4, "messages": USER, "tool_choice": {"type": "maybe"}},
     400, "invalid_request_error", "tool_choice.type"),
    ({"model": "demo", "max_tokens": 4, "messages": USER, "temperature": -1},
     400, "invalid_request_error", "temperature"),
])
def test_errors_in_anthropic_shape(messages_server, body, status, kind, words):
    r = httpx.post(f"{messages_server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and words in r.json()["error"]["message"]


def test_keys(messages_server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(messages_server, api_key="wrong").messages.create(model="demo", max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=messages_server.url, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="demo", messages=USER).input_tokens > 0
    r = httpx.post(f"{messages_server.url}/v1/messages/count_tokens", json={"model": "demo", "messages": USER},
                   headers={"x-api-key": KEY, "Authorization": "Bearer other"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_translation_to_chat_messages():
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n"],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Looking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Rome", "days": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sun"},
                                         {"type": "text", "text": "And tomorrow?"}]}]})
    chat = to_chat_request(request)
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}}]},
        {"role": "tool", "content": "Sun", "tool_call_id": "t1"}, {"role": "user", "content": "And tomorrow?"}]
    assert chat.effective_tool_choice() == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["\n"] and chat.max_tokens == 5
    assert [t.function.parameters for t in chat.tools] == [t["input_schema"] for t in TOOLS]


def test_tool_calls_cut_by_max_tokens(messages_server):
    """tool_choice any (parallel calls allowed): greedy, the demo model keeps calling until
    max_tokens; the calls that closed come back as tool_use blocks, stop_reason max_tokens."""
    message = _client(messages_server).messages.create(
        model="demo", max_tokens=300, messages=USER, tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY)
    assert message.stop_reason == "max_tokens" and len(message.content) >= 2
    for block in message.content:
        assert block.type == "tool_use"
        check_call(block.name, json.dumps(block.input))


def test_claude_code_request_shapes(demo_tokenizer):
    """A two-turn tool conversation shaped as Claude Code sends it (system and content blocks with
    cache_control, metadata, anthropic-beta headers and ?beta=true, a tool schema with $schema, a
    large max_tokens, a streamed reply, a tool_result with is_error) on a scripted model."""
    reply = 'Running. <tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>'
    srv = scripted_server(demo_tokenizer, reply)
    bash = {"name": "Bash", "description": "Run a shell command",
            "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                             "properties": {"command": {"type": "string"}}, "required": ["command"],
                             "additionalProperties": False}}
    body = {"model": "demo", "max_tokens": 32000, "temperature": 1, "stream": True, "tools": [bash],
            "metadata": {"user_id": "user_abc_account__session_1"},
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files",
                                                      "cache_control": {"type": "ephemeral"}}]}]}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    try:
        for turn in range(2):
            events = []
            with httpx.stream("POST", f"{srv.url}/v1/messages?beta=true", json=body, headers=headers,
                              timeout=60) as r:
                assert r.status_code == 200, r.read()
                for frame in r.read().decode().split("\n\n"):
                    if frame.strip():
                        events.append(json.loads(dict(line.split(": ", 1) for line in frame.split("\n"))["data"]))
            blocks = check_event_order(events)
            assert [b["type"] for b in blocks] == ["text", "tool_use"], turn
            assert blocks[0]["text"].strip() == "Running."
            assert json.loads(blocks[1]["partial_json"]) == {"command": "ls"}
            assert events[-2]["delta"]["stop_reason"] == "tool_use"
            content = [{"type": "text", "text": blocks[0]["text"]},
                       {"type": "tool_use", "id": blocks[1]["id"], "name": "Bash", "input": {"command": "ls"}}]
            body["messages"] += [{"role": "assistant", "content": content},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[1]["id"],
                                                               "content": "a.txt\nb.txt", "is_error": False}]}]
    finally:
        srv.stop()


def test_body_limit_in_anthropic_shape(fake_server):
    srv = fake_server(options=ServerOptions(max_request_body_bytes=1000))
    big = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 2000}]}
    r = httpx.post(f"{srv.url}/v1/messages", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] != "request_too_large"  # OpenAI's shape


def test_claude_code_tool_conversation_through_the_sdk(demo_tokenizer):
    """The same two-turn Bash conversation through the anthropic SDK's beta client (as Claude Code
    sends it: ?beta=true, betas, streamed), every event parsed into the SDK's final message."""
    reply = 'Running. <tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>'
    srv = scripted_server(demo_tokenizer, reply)
    bash = {"name": "Bash", "description": "Run a shell command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "List the files",
                                                    "cache_control": {"type": "ephemeral"}}]}]
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    try:
        for turn in range(2):
            with client.beta.messages.stream(model="demo", max_tokens=32000, tools=[bash], messages=messages,
                                             system=[{"type": "text", "text": "You are a coding agent."}],
                                             betas=["claude-code-20250219"]) as stream:
                final = stream.get_final_message()
            assert [b.type for b in final.content] == ["text", "tool_use"], turn
            assert final.stop_reason == "tool_use" and final.content[1].input == {"command": "ls"}
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[1].id,
                                                       "content": "a.txt\nb.txt", "is_error": False}]}]
    finally:
        srv.stop()
