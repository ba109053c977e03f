"""LangChain's ``bind_tools`` against the server: tool_choice required and a named function on
the demo model, auto on a scripted model that writes hermes calls, then the tool's result sent
back (an assistant message with tool_calls and a tool message, rendered by the template);
invoke and stream."""
from __future__ import annotations

import functools
import json
import operator
from typing import Literal

import langchain_openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from pydantic import BaseModel, Field
from server_utils import ServerThread
from tool_helpers import TIME, TOOL_TEMPLATE, TOOLS, check_call, scripted_server

from pagedllm.config import default_model

QUESTION = [HumanMessage("What is the weather in Paris?")]


class get_weather(BaseModel):  # noqa: N801 - the class name is the tool's name
    """Weather forecast for a city."""
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def demo_server():
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    srv = ServerThread(build_app(AsyncLLM.from_engine_args(default_model()), ["demo"],
                                 chat_template=TOOL_TEMPLATE)).start()
    yield srv
    srv.stop()


def _chat(srv, **kwargs):
    return langchain_openai.ChatOpenAI(base_url=f"{srv.url}/v1", api_key="unused", model="demo",
                                       max_retries=0, timeout=120, **kwargs)


def _message(runnable, messages, stream: bool):
    if not stream:
        return runnable.invoke(messages)
    return functools.reduce(operator.add, runnable.stream(messages))  # chunks sum to the message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_bind_tools_forced(demo_server, tool_choice, stream):
    # A pydantic model as the tool (strict: LangChain adds additionalProperties false) and
    # an OpenAI-format dict beside it.
    tools = [get_weather, {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
    llm = _chat(demo_server, temperature=1.0, seed=3, max_tokens=200).bind_tools(
        tools, tool_choice=tool_choice, parallel_tool_calls=False, strict=True)
    msg = _message(llm, QUESTION, stream)
    assert msg.response_metadata.get("finish_reason") == "tool_calls"
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
    call = msg.tool_calls[0]
    assert call["id"].startswith("chatcmpl-tool-")
    if tool_choice == "get_weather":
        assert call["name"] == "get_weather"
    check_call(call["name"], json.dumps(call["args"]))


@pytest.mark.parametrize("stream", [False, True])
def test_bind_tools_auto_round_trip(demo_tokenizer, stream):
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    srv = scripted_server(demo_tokenizer, reply)
    try:
        llm = _chat(srv, max_tokens=100).bind_tools(TOOLS)  # no tool_choice: auto
        msg = _message(llm, QUESTION, stream)
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo", "days": 3})]
        assert msg.response_metadata.get("finish_reason") == "tool_calls"
        # The result goes back: the history now holds the call and the tool's answer.
        history = [*QUESTION, msg, ToolMessage("sunny, 20 C", tool_call_id=msg.tool_calls[0]["id"])]
        again = _message(llm, history, stream)
        assert [c["name"] for c in again.tool_calls] == ["get_weather"]  # the scripted model insists
        plain = _message(_chat(srv, max_tokens=100).bind_tools(TOOLS, tool_choice="none"), history, stream)
        assert not plain.tool_calls and "<tool_call>" in plain.content
    finally:
        srv.stop()
