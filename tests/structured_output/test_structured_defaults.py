"""The defaults a JSON constraint is generated under, checked on the grammar itself (the demo
tokenizer, no model): at most one space between JSON tokens unless ``disable_any_whitespace``
(per request, or the engine's structured_outputs_config) says none or any; objects closed to
undeclared keys for tool arguments and response_format json_schema (unless strict is false)."""
from __future__ import annotations

import pytest
from so_helpers import DEMO_EOS, DEMO_HF

from pagedllm import StructuredOutputsParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.structured_request import structured_outputs_params
from pagedllm.errors import ValidationError
from pagedllm.structured_output.backend import GrammarBackend
from pagedllm.structured_output.grammar import grammar_source
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.strict_schema import strict_schema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def backend():
    return GrammarBackend(DEMO_HF, DEMO_EOS)


@pytest.fixture(scope="module")
def vocab():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_HF).get_vocab()


@pytest.fixture
def accepts(backend, vocab):
    """Does the grammar of ``params`` accept ``text``, fed one token per character (the demo
    vocabulary has every character, or its bytes), so the answer never depends on merges?"""
    def check(params: StructuredOutputsParams, text: str) -> bool:
        pieces = ["\u2581" if ch == " " else ch for ch in text]
        ids = [vocab[p] if p in vocab else vocab[f"<0x{ord(p):02X}>"] for p in pieces]
        matcher = backend.compile(grammar_source(params))
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return check


COMPACT, ONE_SPACE, NEWLINES, TWO_SPACES = ('{"name":"Al","age":3}', '{ "name": "Al", "age": 3 }',
                                            '{\n  "name": "Al",\n  "age": 3\n}', '{"name":  "Al","age":3}')


@pytest.mark.parametrize("disable_any_whitespace, allowed", [
    (None, {COMPACT, ONE_SPACE}),  # the default: at most one space between tokens
    (True, {COMPACT}),
    (False, {COMPACT, ONE_SPACE, NEWLINES, TWO_SPACES}),  # vLLM's default: JSON's own rule
])
@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_whitespace_between_json_tokens(accepts, kind, disable_any_whitespace, allowed):
    spec = {"json": PERSON} if kind == "json" else {"json_object": True}
    params = StructuredOutputsParams(**spec, disable_any_whitespace=disable_any_whitespace)
    for text in (COMPACT, ONE_SPACE, NEWLINES, TWO_SPACES):
        assert accepts(params, text) == (text in allowed), (text, disable_any_whitespace)


def test_the_engine_default_fills_unset_requests_only():
    manager = StructuredOutputManager(DEMO_HF, disable_any_whitespace=True)
    try:
        for rid, option in (("unset", None), ("any", False)):
            manager.add(rid, StructuredOutputsParams(json=PERSON, disable_any_whitespace=option),
                        [rid], DEMO_EOS, lambda: None)
        assert manager._keys["unset"][1].endswith("|ws=True:None")
        assert manager._keys["any"][1].endswith("|ws=False:None")
    finally:
        manager.shutdown()
    # vLLM's spelling, from the command line to the engine core's manager.
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.model_info import ModelInfo
    from pagedllm.entrypoints.cli import engine_kwargs, make_parser
    from pagedllm.runner.fake import FakeRunner

    args = make_parser().parse_args(["serve", DEMO_HF, "--structured-outputs-config",
                                     '{"disable_any_whitespace": true}'])
    config = EngineConfig.from_kwargs(DEMO_HF, **engine_kwargs(args))
    assert config.structured_outputs_config == {"disable_any_whitespace": True}
    engine = LLMEngine(config, runner=FakeRunner(512), model_info=ModelInfo.from_folder(DEMO_HF),
                       multiprocess=False)
    try:
        assert engine.engine_core.structured_output.disable_any_whitespace is True
    finally:
        engine.shutdown()
    for bad in ({"disable_any_whitespace": "yes"}, {"backend": "xgrammar"}):
        with pytest.raises(ValidationError) as e:
            EngineConfig.from_kwargs(DEMO_HF, structured_outputs_config=bad)
        assert e.value.param == "structured_outputs_config"


def test_strict_schema_closes_objects_that_declare_properties():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object"},  # declares no properties: any object
        "c": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
        "d": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "e": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]}},
        "$defs": {"item": {"properties": {"y": {"type": "string"}}}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["b"]
    assert out["properties"]["c"]["additionalProperties"] == {"type": "integer"}  # kept as given
    assert out["$defs"]["item"]["additionalProperties"] is False
    assert all("additionalProperties" not in s for s in out["properties"]["e"]["allOf"])
    assert "additionalProperties" not in schema  # a copy: the request's own schema is untouched


def test_response_format_strict(accepts):
    def fmt(**extra):
        return structured_outputs_params({"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, **extra}}, None)

    extra_key = '{"name":"Al","age":3,"x":1}'
    assert not accepts(fmt(), extra_key)  # unset: OpenAI's strict reading
    assert not accepts(fmt(strict=True), extra_key)
    assert accepts(fmt(strict=False), extra_key)  # plain JSON Schema
    assert accepts(fmt(), COMPACT)
    with pytest.raises(ValidationError) as e:
        fmt(strict="yes")
    assert e.value.param == "response_format"
