"""POST /v1/responses with the official openai SDK against the live demo server: the answer equals
the chat completion of the same conversation (greedy), streamed events in the Responses order,
a forced function call and its output sent back through previous_response_id, stored responses,
and bad input as 400s in OpenAI's error shape."""
from __future__ import annotations

import json

import openai
import pytest
from server_utils import HTTP

from pagedllm.entrypoints.openai.protocol_responses import ResponseObject
from pagedllm.entrypoints.openai.response_store import ResponseStore

MODEL_NAME = "demo"  # the name conftest.py's server serves

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"]}}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                         temperature=0)
    return out.choices[0].message.content, out.choices[0].finish_reason


def test_create_matches_chat(client):
    resp = client.responses.create(model=MODEL_NAME, input="Once upon a time", max_output_tokens=12,
                                   temperature=0, instructions="Tell a story.")
    text, finish_reason = _chat_text(client, [{"role": "system", "content": "Tell a story."},
                                              {"role": "user", "content": "Once upon a time"}], 12)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == text and text
    assert resp.status == ("incomplete" if finish_reason == "length" else "completed")
    if finish_reason == "length":
        assert resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage.output_tokens == 12
    assert resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.instructions == "Tell a story." and resp.max_output_tokens == 12


def test_items_and_reasoning_passed_through(client):
    """Message items with text parts; a reasoning item is accepted and changes nothing."""
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Tom had a dog"}]}]
    plain = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=8, temperature=0)
    with_reasoning = client.responses.create(
        model=MODEL_NAME, max_output_tokens=8, temperature=0,
        input=[*items, {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}])
    text, _ = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Tom had a dog"}], 8)
    assert plain.output_text == with_reasoning.output_text == text


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events


def test_stream_text_events(client):
    kwargs = dict(model=MODEL_NAME, input="Lily went to the park", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    events = _events(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    streamed = "".join(d.delta for d in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert streamed == done.text == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == item_id
    assert client.responses.retrieve(final.id).output_text == streamed  # streamed ones are stored too


def test_function_call_round_trip(client):
    """A forced call, its output sent back with previous_response_id: the second answer equals
    the one for the whole conversation sent as items."""
    first = client.responses.create(model=MODEL_NAME, input="What is the weather in Paris?",
                                    tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER, max_output_tokens=40,
                                    temperature=0)
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert first.status == "completed"
    output_item = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=[output_item],
                                     tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=10,
                                     temperature=0)
    whole = client.responses.create(
        model=MODEL_NAME, tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=10, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               output_item])
    assert second.previous_response_id == first.id
    assert second.output_text == whole.output_text and second.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens


def test_stream_function_call(client):
    kwargs = dict(model=MODEL_NAME, input="Weather in Rome?", tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
                  max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kwargs)
    events = _events(client.responses.create(stream=True, **kwargs))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments  # the model's text; the whole answer re-serialises it
    assert json.loads(done.arguments) == json.loads(whole.output[0].arguments)
    assert events[-1].response.output[0].call_id == added.item.call_id


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}
    resp = client.responses.create(model=MODEL_NAME, input="Pick a color", max_output_tokens=30, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert json.loads(resp.output_text)["color"] in ("red", "blue")


def test_retrieve_and_store(client, server):
    kept = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    assert HTTP.delete(f"{server.url}/v1/responses/{kept.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
      }, "input"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "background": True}, "background"),
    ({}, "input"),
    ({"input": 5}, "input"),
])
def test_bad_input_400(server, body, param):
    r = HTTP.post(f"{server.url}/v1/responses", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"]


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")


def test_store_is_bounded():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(ResponseObject(id=f"resp_{i}", model="m"), [])
    assert len(store) == 2 and store.get("resp_0") is None and store.get("resp_2") is not None


SHELL_TOOL = {  # Codex's shell tool, as its requests declare it
    "type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["command"],
                   "properties": {"command": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                              "maxItems": 2},
                                  "workdir": {"type": "string", "maxLength": 8}}}}


def _codex_turn(client, history: list) -> tuple[list, object]:
    """One turn as Codex sends it: store off, the whole history each time, streamed."""
    events = _events(client.responses.create(
        model=MODEL_NAME, instructions="You are a coding agent.", input=history, tools=[SHELL_TOOL],
        tool_choice={"type": "function", "name": "shell"} if len(history) == 1 else "none",
        parallel_tool_calls=False, reasoning={"effort": "medium", "summary": "auto"}, store=False,
        stream=True, include=["reasoning.encrypted_content"], max_output_tokens=120, temperature=0,
        extra_body={"prompt_cache_key": "session-1"}))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    return done, events[-1].response


def test_codex_shaped_tool_conversation(client):
    """Codex's request shape over two turns: a forced shell call, then its output and the
    whole history (a reasoning item included) sent back without previous_response_id."""
    history: list = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]}]
    items, response = _codex_turn(client, history)
    assert [i.type for i in items] == ["function_call"] and response.status == "completed"
    call = items[0]
    assert isinstance(json.loads(call.arguments)["command"], list)
    with pytest.raises(openai.NotFoundError):  # store: false
        client.responses.retrieve(response.id)
    history += [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "README.md\nsetup.py"}]
    items, response = _codex_turn(client, history)
    assert [i.type for i in items] == ["message"] and items[0].content[0].text == response.output_text
    assert response.output_text and response.usage.input_tokens > 0
