"""Tool-call parsers (hermes, llama3_json, and the readers of required / named replies): what
extract_tool_calls reads from a whole reply, and that the same reply streamed in random chunks
rebuilds the same content and calls from OpenAI-shaped deltas (id, type and name first, then
argument fragments)."""
from __future__ import annotations

import json
import random
import zlib

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.forced_tool_calls import NamedToolCallParser, RequiredToolCallsParser
from pagedllm.errors import ValidationError

hermes = ToolParserManager.get_tool_parser("hermes")
llama3 = ToolParserManager.get_tool_parser("llama3_json")


def streamed(parser, text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, object]]]:
    """Feed ``text`` in random chunks; check each delta's shape; return (content, calls)."""
    content, calls, ids = "", [], []
    previous, i = "", 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        current = previous + text[i:j]
        delta = parser.extract_tool_calls_streaming(previous, current, text[i:j], None, finished=j == len(text))
        if delta is not None:
            content += delta.content or ""
            for d in delta.tool_calls or []:
                wire = d.model_dump()
                if d.index == len(calls):  # a new call: its first delta carries id, type, name
                    assert d.id.startswith("chatcmpl-tool-") and d.id not in ids
                    assert wire["type"] == "function" and d.function.name
                    ids.append(d.id)
                    calls.append([d.function.name, d.function.arguments or ""])
                else:  # later ones: argument text only, never empty
                    assert set(wire) == {"index", "function"} and set(wire["function"]) == {"arguments"}
                    assert d.function.arguments
                    calls[d.index][1] += d.function.arguments
        previous, i = current, j
    return content or None, [(name, json.loads(args)) for name, args in calls]


def whole(parser, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    info = parser.extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    assert len({c.id for c in info.tool_calls}) == len(info.tool_calls)
    return info.content, [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('Let me check. <tool_call>{"name": "a", "arguments": {"q": "x\\"}y", "n": [1, {"k": null}]}}</tool_call>'
     '\n<tool_call>{"arguments": {}, "name": "b"}</tool_call>',
     "Let me check. ", [("a", {"q": 'x"}y', "n": [1, {"k": None}]}), ("b", {})]),
    ('<tool_call>{"name": "c", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("c", {"x": 2})]),
    ('<tool_call>{"name": "d"}</tool_call>', None, [("d", {})]),
    ('<tool_call>{"name": "e", "arguments": {"t": "<tool_call>"}}', None, [("e", {"t": "<tool_call>"})]),
    ('<tool_call>{"name": "g", "arguments": {"s": "</tool_call>"}}</tool_call>', None,
     [("g", {"s": "</tool_call>"})]),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    ("Once upon a time there was a <tool", "Once upon a time there was a <tool", []),
    ("no calls here < tool_call >", "no calls here < tool_call >", []),
    ('x <tool_call>{"name": 5}</tool_call>', 'x <tool_call>{"name": 5}</tool_call>', []),
    ('<tool_call>{"nom": "f", "arguments": {}}</tool_call>',
     '<tool_call>{"nom": "f", "arguments": {}}</tool_call>', []),
    ("hello <tool_call>", "hello <tool_call>", []),
]
LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "arguments": {"y": "; }"}}',
     None, [("a", {"x": [1, 2]}), ("b", {"y": "; }"})]),
    ('  {"name": "c", "parameters": {}};', None, [("c", {})]),
    ("Once upon a time {", "Once upon a time {", []),
    ('{"story": "not a call"}', '{"story": "not a call"}', []),
    ("<|python_", "<|python_", []),
]


@pytest.mark.parametrize("parser_cls, text, content, calls",
                         [(hermes, *c) for c in HERMES_CASES] + [(llama3, *c) for c in LLAMA3_CASES])
def test_auto_parsers_whole_and_streamed(parser_cls, text, content, calls):
    assert whole(parser_cls(), text) == (content, calls)
    rng = random.Random(zlib.crc32(text.encode()))  # hash() of a str is per process
    for _ in range(25):
        assert streamed(parser_cls(), text, rng) == (content, calls), text


def test_junk_after_a_call_makes_the_whole_reply_content():
    # A stream has sent the call by the time the junk comes (deltas cannot be taken back);
    # the whole reply is read as vLLM reads it.
    text = '{"name": "a", "parameters": {}} and more text'
    assert whole(llama3(), text) == (text, [])
    assert whole(hermes(), f"<tool_call>{text}</tool_call>") == (f"<tool_call>{text}</tool_call>", [])


def test_forced_readers_whole_and_streamed():
    required = '[{"name": "a", "parameters": {"x": 1}} , {"name":"b","parameters":{"s":"]}"}}]'
    named = ' {"city": "Paris", "days": [1, 2]}'
    rng = random.Random(0)
    for make, text, calls in [(RequiredToolCallsParser, required, [("a", {"x": 1}), ("b", {"s": "]}"})]),
                              (lambda: NamedToolCallParser("f"), named, [("f", {"city": "Paris", "days": [1, 2]})])]:
        assert whole(make(), text) == (None, calls)
        for _ in range(25):
            assert streamed(make(), text, rng) == (None, calls)
    # Cut short (max_tokens): no calls, the text is the content.
    assert whole(RequiredToolCallsParser(), required[:30]) == (required[:30], [])
    assert whole(NamedToolCallParser("f"), named[:10]) == (named[:10], [])
    assert whole(RequiredToolCallsParser(), "[]") == ("[]", [])


def test_parsers_by_name():
    assert ToolParserManager.get_tool_parser("llama4_json") is llama3
    with pytest.raises(ValidationError, match="invalid tool call parser: nope"):
        ToolParserManager.get_tool_parser("nope")


def test_special_tokens_kept_when_tools_are_used():
    class Request:
        tools = [{"type": "function"}]
        tool_choice = "auto"
        skip_special_tokens = True

    for parser_cls in (hermes, llama3):
        assert parser_cls().adjust_request(Request()).skip_special_tokens is False
    r = Request()
    r.tool_choice = "none"
    assert hermes().adjust_request(r).skip_special_tokens is True


def test_complete_calls_of_a_truncated_array():
    """A required reply cut by max_tokens: the calls that closed are kept, the open one is not;
    text that is not an array of calls has none."""
    parser = RequiredToolCallsParser()
    text = '[{"name": "a", "parameters": {"x": [1, "]"]}}, {"name": "b", "parameters": {}}, {"name": "c", "param'
    assert not parser.extract_tool_calls(text).tools_called
    calls = parser.extract_complete_tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("a", {"x": [1, "]"]}), ("b", {})]
    assert parser.extract_complete_tool_calls('[{"name": "a", "parameters": {"x": ') == []
    assert parser.extract_complete_tool_calls('{"name": "a"}') == []
    hermes = ToolParserManager.get_tool_parser("hermes")().extract_complete_tool_calls(
        'hi <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"na')
    assert [(c.function.name, c.function.arguments) for c in hermes] == [("a", "{}")]
