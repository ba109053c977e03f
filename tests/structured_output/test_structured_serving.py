"""Serving: response_format (json_object, json_schema) and vLLM's structured_outputs on
/v1/completions and /v1/chat/completions (a FakeRunner engine, the demo tokenizer); bad
constraints are 400s naming the field the client used."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from so_helpers import DEMO_HF, VOCAB, check_json, check_regex

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.model_info import ModelInfo
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.runner.fake import FakeRunner

    engine = LLMEngine(EngineConfig.from_kwargs(DEMO_HF, num_gpu_blocks_override=64),
                       runner=FakeRunner(VOCAB), model_info=ModelInfo.from_folder(DEMO_HF))
    with TestClient(build_app(engine, ["demo"], chat_template=TEMPLATE)) as c:
        yield c


def complete(client, route: str, body: dict) -> list[str]:
    base = {"model": "demo", "max_tokens": 100, "n": 2, "temperature": 0}
    if route == "chat":
        r = client.post("/v1/chat/completions", json={**base, "messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]
    r = client.post("/v1/completions", json={**base, "prompt": "Once upon a time", **body})
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_response_format_and_structured_outputs(client, route):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for text in complete(client, route, {"response_format": fmt}):
        check_json(text, SCHEMA)
    for text in complete(client, route, {"response_format": {"type": "json_object"}, "max_tokens": 200}):
        assert text.startswith("{")
    for text in complete(client, route, {"structured_outputs": {"regex": "[a-z]{2,4}-[0-9]"}}):
        check_regex(text, "[a-z]{2,4}-[0-9]")
    for text in complete(client, route, {"structured_outputs": {"choice": ["left", "right"]}}):
        assert text in ("left", "right")
    for text in complete(client, route, {"structured_outputs": {"json": json.dumps(SCHEMA),
                                                                "disable_any_whitespace": True}}):
        check_json(text, SCHEMA)
    for text in complete(client, route, {"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}}):
        check_regex(text, "x[yz]")


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_constraints_are_400s_naming_the_field(client, route, body, field):
    base = {"model": "demo", "max_tokens": 5}
    base |= {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = client.post(route, json={**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_beam_search_with_a_constraint_is_refused(client):
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 5, "n": 2,
                                             "use_beam_search": True,
                                             "structured_outputs": {"regex": "[a-z]+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
