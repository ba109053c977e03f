"""Structured outputs and forced tool calls on the demo model (stories260K, the real runner)
through the official openai client, sampled at temperature 1 over several seeds: the JSON a
reply holds wastes no tokens on whitespace (at most one space between JSON tokens, by default)
and parses; tool arguments carry only the keys their schema declares, as OpenAI's strict mode
generates them, even when the schema does not say additionalProperties."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from so_helpers import DEMO_HF

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Tell me about the little girl."}]
SEEDS = range(6)
# Whitespace outside JSON strings: strings are cut out first (a name may hold spaces).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


@pytest.fixture(scope="module")
def client():
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    llm = AsyncLLM.from_engine_args(DEMO_HF, max_num_seqs=8)
    # TestClient is an httpx.Client: the openai client talks to the app in this process.
    with TestClient(build_app(llm, ["demo"], chat_template=TEMPLATE)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                            http_client=http)


def _between_tokens(text: str) -> str:
    return _STRING.sub('""', text)


def test_json_schema_replies_parse_with_at_most_one_space(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in SEEDS:
        out = client.chat.completions.create(model="demo", messages=MESSAGES, response_format=fmt,
                                             temperature=1.0, max_tokens=60, seed=seed)
        text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        assert not re.search(r"\s\s|[^\S ]", _between_tokens(text)), (seed, text)
        assert reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("body", [{"response_format": {"type": "json_object"}},
                                  {"structured_outputs": {"json": PERSON}}],
                         ids=["json_object", "structured_outputs.json"])
def test_json_object_and_structured_outputs_json_too(client, body):
    for seed in SEEDS[:3]:
        out = client.chat.completions.create(model="demo", messages=MESSAGES, temperature=1.0,
                                             max_tokens=60, seed=seed, extra_body=body)
        text = out.choices[0].message.content
        assert not re.search(r"\s\s|[^\S ]", _between_tokens(text)), (seed, text)


def test_disable_any_whitespace_true_is_compact(client):
    for seed in SEEDS[:3]:
        out = client.chat.completions.create(
            model="demo", messages=MESSAGES, temperature=1.0, max_tokens=60, seed=seed,
            extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
        text = out.choices[0].message.content
        assert not re.search(r"\s", _between_tokens(text)), (seed, text)


def test_required_tool_call_has_only_declared_keys(client):
    """The parameters omit additionalProperties: the arguments still hold ``city`` alone."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    for seed in range(3):
        out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=tools,
                                             tool_choice="required", parallel_tool_calls=False,
                                             temperature=1.0, max_tokens=120, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice.message.content)
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert set(args) == {"city"}, (seed, call.function.arguments)
